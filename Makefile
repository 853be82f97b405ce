# Two commands: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
# The zoo tests and the benchmarks need torchvision (and timm), whose wheels pair with one torch
# release each: torch and torchvision are installed first, pinned to a pair that imports
# together (on x86_64 the pair lying on this kind of machine, whose torch is a CUDA build that
# also runs on the CPU; on aarch64 a CPU pair). Override with `make TORCH_SPEC="torch torchvision" test`.
ARCH := $(shell uname -m)
ifeq ($(ARCH),aarch64)
TORCH_SPEC ?= torch==2.9.1 torchvision==0.24.1
else
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
endif
BIN := $(VENV)/bin

.PHONY: demo test durations lint venv bench bench-equal-memory bench-peers clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev,zoo]"
	touch $@

venv: $(BIN)/.installed

# The CPU part of benchmarks/RESULTS.md (under 20 minutes on 2 cores; refuses a dirty tree).
bench: venv
	$(BIN)/python benchmarks/run.py --quick

# The equal-memory comparison at full size (ResNet-50, DenseNet-121, U-Net, GPT; every peer,
# every solver at each peer's peak); its duration on 2 cores: docs/benchmarks.md, "Reproduce".
bench-equal-memory: venv
	$(BIN)/python benchmarks/run.py --set equal-memory

# remat at the peak of timm's set_grad_checkpointing and Hugging Face's
# gradient_checkpointing_enable, on the zoo's models (about 10 minutes on 2 cores).
bench-peers: venv
	$(BIN)/python benchmarks/peers_checkpointing.py

demo: venv
	$(BIN)/python examples/quickstart.py

# The suite (the zoo of transformers, timm and torchvision models included) on both cores.
test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests

# The suite as `make test` runs it, then tests/file_seconds.json from its report: the order in
# which the test files go to the workers, longest first (tests/conftest.py).
durations: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests --junitxml=.durations.xml
	$(BIN)/python -m tests.file_seconds .durations.xml

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
