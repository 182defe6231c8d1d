"""The paper's setting (Qwen2.5-1.5B, AReaL's 4 + 4 GPU split), the speedups reported for it
as data, and what each would need to be true. Where each figure and setting comes from, and
what the efficiencies below stand on: docs/cost_model.md, "Sources"."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from a3po.memory.parts import SMOLLM2_135M, Architecture, architecture_from
from analysis.cost_model.devices import device
from analysis.cost_model.phases import Efficiency, Hardware, StepShape, forward_flops, phase_seconds, train_flops
from analysis.cost_model.pipeline import async_step, bounding_side, serial_step, trainer_side

__all__ = ["ARCHITECTURES", "architecture", "Reported", "REPORTED", "required_forward_ratio", "SUITE_H200",
           "paper_shape", "paper_hardware", "implied_by_areal", "predictions", "requirements"]

# config.json's fields (Hugging Face hub), each as its model card gives it
ARCHITECTURES = {
    "smollm2-135m": (SMOLLM2_135M, "the converted GGUF's config.json (a3po.memory.parts.SMOLLM2_135M)"),
    "qwen2.5-1.5b": ({"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                      "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
                      "tie_word_embeddings": True, "model_type": "qwen2"},
                     "Qwen/Qwen2.5-1.5B-Instruct config.json: 1.54 B parameters, 1.31 B non-embedding (model card)"),
    "qwen3-8b": ({"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "tie_word_embeddings": False, "attention_bias": False},
                 "Qwen/Qwen3-8B config.json: 8.2 B parameters (model card)"),
}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(ARCHITECTURES))}")
    return architecture_from(ARCHITECTURES[name][0])


class Reported(NamedTuple):
    source: str
    what: str
    baseline_s: float   # the slower run's training time (seconds), whatever its unit was
    a3po_s: float
    baseline: str       # what the speedup is against

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.a3po_s


REPORTED = (
    Reported("paper v1", "3.46 h vs 2.72 h (22% less)", 3.46 * 3600, 2.72 * 3600, "recompute"),
    Reported("AReaL prox_approx docs", "207 vs 163 min, 300 steps", 207 * 60, 163 * 60, "recompute"),
    Reported("paper v3 / blog, Qwen3-8B", "26.15 h vs 14.54 h", 26.15 * 3600, 14.54 * 3600, "synchronous GRPO"),
    Reported("blog, Qwen3-8B", "16.10 h vs 14.54 h", 16.10 * 3600, 14.54 * 3600, "recompute"),
    Reported("blog, Qwen2.5-1.5B", "1.82 h vs 1.53 h", 1.82 * 3600, 1.53 * 3600, "recompute"),
)


def required_forward_ratio(speedup: float, forward_flops: float, rest_flops_equivalent: float) -> float:
    """The recompute forward's efficiency relative to the rest of the bounding side's work
    that a speedup needs: with the forward taking F / e_f and the rest R / e_r on the side that
    sets the pace, speedup = 1 + (F / e_f) / (R / e_r), so e_f / e_r = (F / R) / (speedup - 1).
    Above 1 the forward must run more efficiently than the rest; far below 1, much less."""
    if speedup <= 1:
        raise ValueError(f"a speedup above 1 is needed, got {speedup!r}")
    return (forward_flops / rest_flops_equivalent) / (speedup - 1)


# this suite's trainer on an H200 at the paper's shape (docs/gpu_runs.md); the rollout as a
# continuous-batching engine would run it (an assumption: docs/cost_model.md, "Sources")
SUITE_H200 = Efficiency(prefill=0.3, decode=0.5, decode_step_s=0.005, forward=130 / 989, train=170 / 989,
                        optimizer=0.5)
# AReaL's prox_approx page: 207 and 163 min for 300 steps
AREAL_STEP_S = {"recompute": 207 * 60 / 300, "loglinear": 163 * 60 / 300}


def paper_shape(response_len: float = 300, prompt_len: int = 120) -> StepShape:
    """256 prompts x 4 samples, up to 1,024 new tokens, 1 minibatch, bf16, no checkpointing."""
    return StepShape(prompts=256, samples=4, prompt_len=prompt_len, response_len=response_len, response_max=1024,
                     minibatches=1, precision="bf16", checkpointing=False)


def paper_hardware(name: str = "H800 SXM") -> tuple[Hardware, Hardware]:
    """(trainer, rollout): 4 GPUs each; the weights broadcast over NVLink at 400 GB/s (H800)."""
    gpu = device(name)
    trainer = Hardware(gpu.flops("bf16"), gpu.bandwidth, devices=4, link=400e9)
    return trainer, Hardware(gpu.flops("bf16"), gpu.bandwidth, devices=4)


def implied_by_areal(shape: StepShape, gpu: str = "H800 SXM") -> Efficiency:
    """The forward's and the training pass's MFU that make the trainer side take AReaL's
    reported step times (the optimizer and sync at SUITE_H200's figures)."""
    arch, (trainer, rollout) = architecture("qwen2.5-1.5b"), paper_hardware(gpu)
    base = phase_seconds(arch, shape, trainer, rollout, SUITE_H200, "loglinear")
    peak = trainer.flops * trainer.devices
    prox_s = AREAL_STEP_S["recompute"] - AREAL_STEP_S["loglinear"]
    train_s = AREAL_STEP_S["loglinear"] - base["optimizer"] - base["weight_sync"]
    return replace(SUITE_H200, forward=forward_flops(arch, shape) / (peak * prox_s),
                   train=train_flops(arch, shape) / (peak * train_s))


def predictions(eff: Efficiency, shape: StepShape, gpu: str = "H800 SXM", bound: int = 2) -> dict[str, float | str]:
    """Recompute's and loglinear's step (async at `bound`, and lagged on the same 8 GPUs in
    turn), the speedups, and the side that bounds the async pipeline."""
    arch, (trainer, rollout) = architecture("qwen2.5-1.5b"), paper_hardware(gpu)
    out: dict[str, float | str] = {}
    for algo in ("recompute", "loglinear"):
        phases = phase_seconds(arch, shape, trainer, rollout, eff, algo)
        side = trainer_side(phases)
        out[f"async_{algo}_s"] = async_step(phases["rollout"], side, phases["weight_sync"], bound)
        # lagged: all 8 GPUs do each phase in turn (twice the devices for each)
        doubled = phase_seconds(arch, shape, replace(trainer, devices=8, link=float("inf")),
                                replace(rollout, devices=8), eff, algo)
        out[f"lagged_{algo}_s"] = serial_step(doubled)
        out[f"{algo}_rollout_s"], out[f"{algo}_trainer_s"] = phases["rollout"], side
        out[f"{algo}_side"] = bounding_side(phases["rollout"], side, bound)
    out["async_speedup"] = out["async_recompute_s"] / out["async_loglinear_s"]
    out["lagged_speedup"] = out["lagged_recompute_s"] / out["lagged_loglinear_s"]
    return out


def requirements(shape: StepShape) -> list[dict[str, float | str]]:
    """Per reported speedup against recompute: the recompute forward's efficiency relative to
    the training pass's that it needs on a trainer-bound pipeline (the optimizer aside)."""
    arch = architecture("qwen2.5-1.5b")
    ratio_flops = (forward_flops(arch, shape), train_flops(arch, shape))
    rows = [{"source": r.source, "what": r.what, "against": r.baseline, "speedup": r.speedup,
             "forward_over_train_efficiency": required_forward_ratio(r.speedup, *ratio_flops)
             if r.baseline == "recompute" else float("nan")} for r in REPORTED]
    # the 1.8x as a reader of the abstract takes it: against recompute
    return rows + [{"source": "paper v3 abstract, read as against recompute", "what": "1.8x", "against": "recompute",
                    "speedup": 1.8, "forward_over_train_efficiency": required_forward_ratio(1.8, *ratio_flops)}]
