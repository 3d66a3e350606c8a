# The two commands: `make demo` and `make test`. Both create .venv and install everything first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.imerge-installed
WORKERS ?= 3
SERVERS ?= 1

.PHONY: demo test gpu-check venv lint bench-transport clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -r requirements-dev.txt
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 IMERGE_NUM_SERVERS=$(SERVERS) $(VENV)/bin/mpiexec -n $$(( $(WORKERS) + $(SERVERS) )) \
		$(PY) examples/lightning_digits.py

# Two test files at a time (--dist loadfile keeps a file's shared launches in one process).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# On a GPU machine: tests/gpu, then the GPU benchmark (benchmarks/results/gpu.json). GPU_PY=python3 uses a
# Python that already holds CUDA torch, mpi4py and an MPI instead of .venv (nothing is installed then).
GPU_PY ?= $(PY)
gpu-check: $(if $(filter $(PY),$(GPU_PY)),$(STAMP))
	PYTHONPATH=. $(GPU_PY) -m pytest -q -ra tests/gpu
	PYTHONPATH=. $(GPU_PY) benchmarks/gpu.py

lint: $(STAMP)
	$(VENV)/bin/ruff check imerge_hooks lightning_plugin examples benchmarks tests

bench-transport: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/mpiexec -n 2 $(PY) benchmarks/transport.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
