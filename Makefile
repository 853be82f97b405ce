# Two commands: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and pinned so pip takes the CPU build lying on this kind of machine
# (and an ordinary wheel elsewhere); override with `make TORCH_SPEC=torch test`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The benchmarks and the zoo tests need torchvision (and timm), whose wheels pair with one
# torch release each: a venv of their own (the pair lying on this kind of machine; override
# for another platform).
BENCH_VENV ?= .venv-bench
BENCH_TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
BENCH_BIN := $(BENCH_VENV)/bin

.PHONY: demo test test-zoo lint venv bench bench-equal-memory bench-peers clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,hf]"
	touch $@

venv: $(BIN)/.installed

$(BENCH_BIN)/.installed: pyproject.toml
	test -x $(BENCH_BIN)/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install -q --upgrade pip
	$(BENCH_BIN)/python -m pip install -q $(BENCH_TORCH_SPEC)
	$(BENCH_BIN)/python -m pip install -q -e ".[dev,vision,zoo]"
	touch $@

# The CPU part of benchmarks/RESULTS.md (under 20 minutes on 2 cores; refuses a dirty tree).
bench: $(BENCH_BIN)/.installed
	$(BENCH_BIN)/python benchmarks/run.py --quick

# The equal-memory comparison at full size (ResNet-50, DenseNet-121, U-Net, GPT; every peer,
# every solver at each peer's peak); its duration on 2 cores: docs/benchmarks.md, "Reproduce".
bench-equal-memory: $(BENCH_BIN)/.installed
	$(BENCH_BIN)/python benchmarks/run.py --set equal-memory

# remat at the peak of timm's set_grad_checkpointing and Hugging Face's
# gradient_checkpointing_enable, on the zoo's models (about 10 minutes on 2 cores).
bench-peers: $(BENCH_BIN)/.installed
	$(BENCH_BIN)/python benchmarks/peers_checkpointing.py

demo: venv
	$(BIN)/python examples/quickstart.py

# The suite (the transformers zoo included) on both cores.
test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 tests

# The timm and torchvision zoo, in the bench venv where they import beside their torch
# (not yet part of make test: not yet run to the end on an idle machine).
test-zoo: $(BENCH_BIN)/.installed
	$(BENCH_BIN)/python -m pytest -q -p no:cacheprovider tests/test_zoo_vision.py

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(BENCH_VENV) lightning_logs .pytest_cache
