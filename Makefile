# Two entry points: `make demo` and `make test`. Each builds .venv when it is missing.
# `make test-compat` runs the suite against the ends of the torch range pyproject.toml declares,
# each in a venv of its own (.venv-torch-<version>); .ci/run calls it after `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.installed
TORCH   := torch==2.13.0
# the ends of the supported range (pyproject.toml: torch>=2.9,<2.16); docs/versions.md says why
TORCH_OLDEST := 2.9.1
TORCH_NEWEST := 2.15.0

.PHONY: demo test test-compat compat-venvs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

# PIP_CONFIG_FILE=/dev/null: from PyPI, past the pip configuration's cap at torch 2.14.1 on these machines
.venv-torch-%/.installed: pyproject.toml
	test -x .venv-torch-$*/bin/python || python3 -m venv .venv-torch-$*
	PIP_CONFIG_FILE=/dev/null .venv-torch-$*/bin/python -m pip install -q "torch==$*"
	PIP_CONFIG_FILE=/dev/null .venv-torch-$*/bin/python -m pip install -q -e ".[dev]"
	touch $@

compat-venvs: .venv-torch-$(TORCH_OLDEST)/.installed .venv-torch-$(TORCH_NEWEST)/.installed

# at the ends, the tests of the library's own process handling stay out (tests/conftest.py, PIN_ONLY)
test-compat: compat-venvs
	.venv-torch-$(TORCH_OLDEST)/bin/python -m pytest -n 2 tests -m "not pin_only"
	.venv-torch-$(TORCH_NEWEST)/bin/python -m pytest -n 2 tests -m "not pin_only"

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf .venv .venv-torch-*
