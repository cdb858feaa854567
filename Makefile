# `make test` and `make bench` work on a fresh machine: each first runs `setup`, which makes a virtual
# environment in the checkout (unless one is active), installs torch==2.13.0 when no torch imports (an
# unpinned torch pulls gigabytes of CUDA packages), then `pip install -e ".[test]"`.

SHELL := /bin/bash
ifdef VIRTUAL_ENV
PY := python
else
PY := .venv/bin/python
endif
STAMP := .setup-stamp
BENCH_ARGS ?=

.PHONY: setup test bench gate fuzz mutants verify lint clean lease-wheels

setup: $(STAMP)

# The stamp also follows the CPU Adam's C++ sources: `pip install -e .` rebuilds the extension when they change.
$(STAMP): setup.py pyproject.toml $(wildcard zkern/cpu/csrc/*)
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	@touch $(STAMP)

# The whole suite, then the tests of the CPU kernels again on the paths this CPU would not pick: zkern's AVX2 Adam
# with torch's AVX2 kernels, and zkern's scalar Adam with torch's scalar kernels (a CPU without AVX2).
CPU_KERNEL_TESTS := tests/kernels/test_cpu_adam.py tests/kernels/test_reference.py tests/offload/test_offload.py tests/offload/test_nvme.py

# --durations: the slowest tests go to CI's log, where the 30-minute budget is watched.
test: setup
	$(PY) -m pytest -q --durations=15
	@for isa in avx2 scalar; do \
	  if $(PY) -c "import sys; from zkern.cpu import _ext; sys.exit('$$isa' not in _ext.SUPPORTED)"; then \
	    cap=$$( [ $$isa = avx2 ] && echo avx2 || echo default ); \
	    echo "== the CPU kernel tests on zkern's $$isa path, with torch's $$cap kernels"; \
	    ZKERN_CPU_ISA=$$isa ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q $(CPU_KERNEL_TESTS) || exit 1; \
	  fi; \
	done

bench: setup
	$(PY) bench/run.py --stage 3 $(BENCH_ARGS)

# CI's quick regression gate: ratios measured in one run, checked against bench/gates.toml (about a minute), then
# each rank's memory at world 4 (the memory suite, about two minutes). The
# stock peers only: DeepSpeed (installed for the tests) is measured by `make bench` and by hand. Then the GPU half
# without a GPU: every Triton kernel compiled for sm_80/sm_90 at the launchers' specialisations, no spill, 128-bit
# access on aligned launches (bench/gpu_static_suite.py, about a minute).
#
# The GPU half runs twice: under the Triton the test environment installs (the newest: a CPU torch pins none) and
# under GATE_TRITON, the one torch's public (CUDA) wheel pins for the torch the README names (torch 2.13.0: triton
# 3.7.1), installed apart in .gate/ without its dependencies and put first on PYTHONPATH (about 10 s and 700 MB once;
# the check about two minutes on 2 cores). Both runs land in bench/out/gpu-static.json, one record per version.
GATE_TRITON ?= 3.7.1
GATE_TRITON_DIR := .gate/triton-$(GATE_TRITON)
gate: setup
	$(PY) bench/run.py --suite all --stage 0,1,2,3 --model small --steps 8 --gate bench/gates.toml --peers zero1,fsdp2
	$(PY) bench/run.py --suite memory --world 4 --stage 0,1,2,3 --model small --gate bench/gates.toml --peers zero1,fsdp2
	$(PY) bench/run.py --suite gpu-static --json bench/out/gpu-static.json
	@test -d $(GATE_TRITON_DIR)/triton || $(PY) -m pip install -q --no-deps --target $(GATE_TRITON_DIR) \
	  triton==$(GATE_TRITON)
	PYTHONPATH=$(GATE_TRITON_DIR) $(PY) bench/run.py --suite gpu-static --json bench/out/gpu-static.json

# The differential fuzzer (zkern/verify/): FUZZ_DRAWS random crossings of features on 1, 2 and 4 CPU ranks, each against
# a single-process torch reference; a failing draw prints as the command that repeats it. CI runs a fixed sample.
FUZZ_DRAWS ?= 2000
FUZZ_SEED ?= 0
fuzz: setup
	$(PY) -m zkern.verify.fuzz --draws $(FUZZ_DRAWS) --seed $(FUZZ_SEED) --json fuzz-$(FUZZ_SEED).json

# The fuzzer's own test (zkern/verify/mutants.py): each planted bug in turn, draws run until one fails; a mutant no
# draw kills is a hole in the net (exit 1). The record: which draw killed which mutant.
mutants: setup
	$(PY) -m zkern.verify.mutants --draws 40 --json mutants.json

# zkern's self-test on this machine (python -m zkern.verify): a short matrix against the single-process reference.
verify: setup
	$(PY) -m zkern.verify

# DeepSpeed for a lent GPU machine, which reaches no package index: its wheel and its dependencies' for the machine's
# Python (3.12, x86_64; torch and numpy are the image's), into .lease-wheels/ (about 6 MB). Carry that folder on the
# lease's call; bench/gpu_lease.sh installs it apart, for the DeepSpeed steps only (docs/gpu.md).
LEASE_PY ?= 3.12
LEASE_DEPS := einops hjson msgpack ninja psutil py-cpuinfo pydantic pydantic-core annotated-types typing-inspection \
  typing-extensions
lease-wheels: setup
	rm -rf .lease-wheels
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w .lease-wheels \
	  deepspeed==$$($(PY) -c "import importlib.metadata as m; print(m.version('deepspeed'))")
	$(PY) -m pip download -q --only-binary=:all: --no-deps --python-version $(LEASE_PY) -d .lease-wheels \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $(LEASE_DEPS)

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(STAMP) .lease-wheels build *.egg-info .pytest_cache .ruff_cache .gate zkern/cpu/_adam_ext*.so
