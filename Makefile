# Entry points. Each target installs first (idempotent, quiet when already done).
PY := .venv/bin/python

.PHONY: install demo test test-fast lint bench clean

install:
	@bash tools/install.sh

demo: install
	@$(PY) -m megatron_vllm_align

test: install
	@$(PY) -m pytest -q

bench: install
	@$(PY) benchmarks/run_all.py --json runs/bench/figures.json

lint: install
	@$(PY) -m ruff check .

test-fast: install
	@$(PY) -m pytest -q -m "not engine and not distributed"

clean:
	rm -rf .venv accuracy_debug runs
