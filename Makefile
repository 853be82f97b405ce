# Two commands: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and pinned so pip takes the CPU build lying on this kind of machine
# (and an ordinary wheel elsewhere); override with `make TORCH_SPEC=torch test`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test lint venv bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python examples/quickstart.py

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
