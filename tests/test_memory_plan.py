"""The memory estimate on GPUs this machine does not have (a3po.run.memory_plan): the paper's
setting in its shipped layouts fits 80 GB GPUs, the one-GPU configuration it had before (eager
attention, no checkpointing, half the GPU to vLLM) is refused naming its keys, the parts match
hand computations for Qwen2.5-1.5B, and every GPU command the docs give is accepted."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from a3po.config import parse_config
from a3po.run.memory_check import architecture_of
from a3po.memory.parts import GIB
from a3po.run.memory_plan import plan
from conftest import REPO, compose_config

H100 = int(79.6 * GIB)  # what an H100 80GB exposes (81,559 MiB)
QWEN_1P5B_PARAMS = 1_543_714_304  # the model card's 1.54B, counted from config.json's shapes
WORLD = {"gpu1": 1, "gpu2": 1, "gpu8": 7}


def _plan(*overrides: str, world: int = 1):
    cfg = compose_config(["experiment=paper_gsm8k", *overrides])
    parse_config(cfg)  # the start's first check, before the memory's
    arch, source = architecture_of(cfg.model)
    assert arch is not None, source
    return plan(parse_config(cfg), arch, gpu_bytes=H100, world=world)


@pytest.mark.parametrize("layout", sorted(WORLD))
def test_every_shipped_layout_of_the_paper_setting_fits_80gb_gpus(layout):
    estimate, level, message = _plan(f"layout={layout}", world=WORLD[layout])
    assert level == "ok", message
    gpus = [d for d in estimate.devices() if d.startswith("cuda")]
    assert gpus == {"gpu1": ["cuda:0"], "gpu2": ["cuda:0", "cuda:1"], "gpu8": ["cuda:0", "cuda:7"]}[layout]
    assert all(estimate.peak(d) <= 0.8 * H100 for d in gpus)


def test_the_paper_setting_defaults_to_the_one_gpu_layout():
    cfg = compose_config(["experiment=paper_gsm8k"])
    assert (cfg.device, cfg.rollout.device, cfg.train.activation_checkpointing) == ("cuda", None, True)
    assert cfg.model.attn_implementation == "sdpa"


def test_the_one_gpu_configuration_before_the_layouts_is_refused_naming_its_keys():
    _, level, message = _plan("model.attn_implementation=eager", "train.activation_checkpointing=false",
                              "rollout.gpu_memory_utilization=0.5")
    assert level == "error"
    assert "on cuda:0" in message and "79.60 GiB is available" in message
    for key in ("model.attn_implementation", "train.activation_checkpointing", "train.token_budget",
                "rollout.gpu_memory_utilization"):
        assert key in message


def test_the_qwen_parts_match_hand_computations():
    """Qwen2.5-1.5B: h 1,536, 28 layers, I 8,960, 12 heads, 2 KV heads of 128, vocab 151,936, tied."""
    estimate, _, _ = _plan("layout=gpu1")
    parts = {p.name: p.nbytes for p in estimate.parts if p.device == "cuda:0"}
    layer = 2 * 1536 * 1536 + 2 * 1536 * 256 + (1536 + 2 * 256) + 3 * 1536 * 8960 + 2 * 1536
    assert QWEN_1P5B_PARAMS == 151936 * 1536 + 28 * layer + 1536
    assert parts["weights"] == parts["gradients"] == 4 * QWEN_1P5B_PARAMS
    assert parts["AdamW state"] == 8 * QWEN_1P5B_PARAMS
    assert parts["vLLM weights and KV cache"] == int(0.3 * H100)
    # staged update: the state dict in bf16, the tied embedding under both of its names
    assert parts["vLLM staged weight update (async)"] == 2 * (QWEN_1P5B_PARAMS + 151936 * 1536)
    # the largest micro-batch: 10,240-token budget, rows of (longest prompt + 1,024) tokens
    cfg = parse_config(compose_config(["experiment=paper_gsm8k"]))
    from a3po.run.memory_check import longest_prompt_tokens

    sequence = longest_prompt_tokens(cfg.task, cfg.model)[0] + 1024
    rows = 10240 // sequence
    tokens = rows * sequence
    one_layer = tokens * (34 * 1536 + 8 * 8960)  # bf16: 34 h + 8 I bytes a token a layer, no s^2 term (sdpa)
    inputs = 28 * tokens * 1536 * 4  # each layer's float32 residual input (autocast over float32 weights)
    assert parts["training activations (checkpointed)"] == inputs + one_layer + tokens * 16 * 1536
    assert parts["training autocast weight casts"] == 2 * (28 * (layer - 2 * 1536) + 151936 * 1536)


def test_the_cli_plans_a_layout_and_exits_2_where_the_start_would_refuse():
    ok = subprocess.run([sys.executable, "-m", "a3po.run.memory_plan", "--gpu-memory-gib", "79.6", "--world", "7",
                         "experiment=paper_gsm8k", "layout=gpu8"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "[cuda:0]" in ok.stdout and "[cuda:7]" in ok.stdout and "FSDP2 gathered weights" in ok.stdout
    refused = subprocess.run([sys.executable, "-m", "a3po.run.memory_plan", "--gpu-memory-gib", "40",
                              "experiment=paper_gsm8k"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "error: memory check: this run needs an estimated" in refused.stdout


def _documented_gpu_commands() -> list[tuple[str, str]]:
    """(file, command) for every command in the README, docs/ and slurm/README.md that trains the
    paper's setting (a line naming experiment=paper_gsm8k and its continuation lines)."""
    found = []
    for path in [REPO / "README.md", REPO / "slurm" / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "experiments/train.py" in line and "experiment=paper_gsm8k" in line and not line.lstrip().startswith("|"):
                command = line
                while command.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command.rstrip()[:-1] + " " + lines[i].strip()
                quoted = [span for span in re.findall(r"`([^`]+)`", command) if "experiments/train.py" in span]
                found.append((str(path.relative_to(REPO)), quoted[0] if quoted else command.strip()))
    return found


def test_the_docs_give_gpu_commands():
    assert len(_documented_gpu_commands()) >= 4


@pytest.mark.parametrize("where, command", _documented_gpu_commands())
def test_every_documented_gpu_command_is_accepted_by_the_memory_check(where, command):
    words = command.split()
    overrides = [w for w in words if "=" in w and not w.startswith(("hydra", "--", "A3PO_"))
                 and re.match(r"^[\w.+/~-]+=", w) and w != "experiment=paper_gsm8k"]
    nproc = next((int(w.split("=")[1]) for w in words if w.startswith("--nproc-per-node=")), None)
    if "--nproc-per-node" in words:
        nproc = int(words[words.index("--nproc-per-node") + 1])
    tasks = next((int(w.split("=")[1]) for w in words if w.startswith("hydra.launcher.tasks_per_node=")), None)
    _, level, message = _plan(*overrides, world=nproc or tasks or 1)
    assert level == "ok", (where, command, message)


def test_a_rank_other_than_0_checks_its_own_gpu_and_never_asks_the_rollout_gpu(tiny_cfg, monkeypatch):
    """Asking a GPU for its free memory opens a CUDA context on it (~0.5 GiB): seven trainer ranks
    asking the rollout GPU would take 3.5 GiB of vLLM's share before it starts."""
    import a3po.run.memory_check as check
    from a3po.memory.parts import Estimate, Part

    estimate = Estimate((Part("weights", GIB, ("model",), "always", "cuda:3"),
                         Part("vLLM weights and KV cache", 60 * GIB, (), "always", "cuda:7"),
                         Part("process baseline", GIB, (), "always", "cpu")))
    asked = []
    monkeypatch.setattr(check, "estimate_run", lambda *args, **kwargs: estimate)
    monkeypatch.setattr(check, "available_memory", lambda device: asked.append(device) or (H100, "mocked"))
    check.check_memory(parse_config(tiny_cfg()), "cuda:3", world=7, is_main=False)
    assert sorted(asked) == ["cpu", "cuda:3"]
    asked.clear()
    check.check_memory(parse_config(tiny_cfg()), "cuda:0", world=7, is_main=True)
    assert sorted(asked) == ["cpu", "cuda:3", "cuda:7"]


def test_the_old_command_names_the_new_one():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "a3po.run.memory_check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "python -m a3po.run.memory_plan" in done.stderr
