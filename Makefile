# Entry points. Each target installs first (idempotent, quiet when already done).
PY := .venv/bin/python

.PHONY: install demo test test-fast clean

install:
	@bash tools/install.sh

demo: install
	@$(PY) -m megatron_vllm_align

test: install
	@$(PY) -m pytest -q

test-fast: install
	@$(PY) -m pytest -q -m "not engine and not distributed"

clean:
	rm -rf .venv accuracy_debug runs
