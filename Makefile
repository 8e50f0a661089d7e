# Two entry points: `make demo` and `make test`. Each builds .venv when it is missing.
PY      := .venv/bin/python
STAMP   := .venv/.installed
TORCH   := torch==2.13.0

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf .venv
