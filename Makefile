# Two entry points: `make demo` and `make test`. Each builds .venv when it is missing.
# `make test-compat` runs the suite against the ends of the torch range pyproject.toml declares,
# each in a venv of its own (.venv-torch-<version>); .ci/run calls it after `make test`.
PY      := .venv/bin/python
UV      := .venv/bin/uv
STAMP   := .venv/.installed
TORCH   := torch==2.13.0
# torchtitan's own models for the tests and benchmarks that train them; its imports are pyproject.toml's
# `titan` extra, its training dependencies left out (--no-deps)
TITAN   := torchtitan==0.3.0
NOT_TITAN := --ignore=tests/models/test_titan.py --ignore=tests/nn/test_scale_memory.py
# the ends of the supported range (pyproject.toml: torch>=2.9,<2.16); docs/versions.md says why
TORCH_OLDEST := 2.9.1
TORCH_NEWEST := 2.15.0

.PHONY: demo test test-compat compat-venvs bench docs-numbers clean

# The suite's processes (two pytest workers per run, launched ranks, three runs in CI) read the
# project's modules from bytecode caches where an environment turns them off (PYTHONDONTWRITEBYTECODE):
# the first process compiles and rewrites them, the rest load them (each worker's collection: 29 -> 14 s).
unexport PYTHONDONTWRITEBYTECODE
# worksteal: a worker that runs out of tests takes half the other's queue, instead of idling while the
# other ends a long launched job
PYTEST := -m pytest -n 2 --dist worksteal

$(PY):
	python3 -m venv .venv

# torch by pip, from this machine's disk; the package and its dev extras by uv (below): the same
# releases as pip picks, in 5 s against pip's 85 (their modules compile when first imported)
$(STAMP): pyproject.toml | $(UV)
	$(PY) -m pip install -q "$(TORCH)"
	$(UV) pip install -q --python $(PY) -e ".[dev,titan]"
	$(UV) pip install -q --python $(PY) --no-deps "$(TITAN)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) $(PYTEST) tests

$(UV): | $(PY)
	$(PY) -m pip install -q uv

# The ends' venvs install with uv, from PyPI: uv reads no pip configuration (so the cap at torch 2.14.1
# on these machines does not apply), and it installs a CUDA build of several GB in a quarter of pip's
# time and CPU (2.15.0 with the dev extras: 34 s against 185 s here). They hold the package's
# dependencies and dev extras, not the package: test-compat imports it from src/, so no install of
# theirs writes its metadata while the development venv's does (.ci/run builds them side by side).
.venv-torch-%/.installed: pyproject.toml | $(UV)
	test -x .venv-torch-$*/bin/python || python3 -m venv .venv-torch-$*
	$(UV) pip install -q --python .venv-torch-$*/bin/python "torch==$*" -r pyproject.toml --extra dev
	touch $@

compat-venvs: .venv-torch-$(TORCH_OLDEST)/.installed .venv-torch-$(TORCH_NEWEST)/.installed

# at the ends, the tests of the library's own process handling stay out (tests/conftest.py, PIN_ONLY);
# the package from src/ (an absolute path: launched jobs run in folders of their own)
# and torchtitan's models, installed at the pin only (TITAN), stay out too
test-compat: compat-venvs
	PYTHONPATH=$(CURDIR)/src .venv-torch-$(TORCH_OLDEST)/bin/python $(PYTEST) tests -m "not pin_only" $(NOT_TITAN)
	PYTHONPATH=$(CURDIR)/src .venv-torch-$(TORCH_NEWEST)/bin/python $(PYTEST) tests -m "not pin_only" $(NOT_TITAN)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# the bytes, collectives and reports the docs print, rewritten from a run of the code (tools/docs_numbers.py);
# tests/docs/test_docs_numbers.py fails when a page differs
docs-numbers: $(STAMP)
	PYTHONPATH=src $(PY) tools/docs_numbers.py

clean:
	rm -rf .venv .venv-torch-*
