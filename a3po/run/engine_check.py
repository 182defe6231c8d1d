"""At start, before the first step: does the rollout engine sample with the policy the trainer trains?

The engine samples a few tokens of the warm-up's prompt and the trainer computes their log-probs
with the same weights (the engine was just synced: a3po.run.main). Their gap is what every
importance weight of the run would carry beside the policy's own change: a wrong `rollout.dtype`,
a vLLM runner whose kernels differ from the ones tested (`rollout.model_runner`), weights the
sync did not reach. A gap past `rollout.logprob_check` stops the run with the gap measured.
Result-neutral: the engine samples with an explicit seed and the trainer's forward is no-grad in
eval mode, so no RNG stream, weight or optimizer state moves.
"""

from __future__ import annotations

import logging
import time

import torch

from a3po.distributed import broadcast_object
from a3po.errors import ConfigError
from a3po.run.parts import WARMUP_QUESTION, RunParts

__all__ = ["TOLERANCE", "logprob_gap", "check_engine_logprobs"]

log = logging.getLogger(__name__)

# The gap allowed where `rollout.logprob_check` is null, by the run's resolved precision. fp32:
# the two forwards' float rounding, with room for vLLM's CPU kernels (measured within 1e-3:
# tests/test_vllm.py; the HF engine within 1e-6: docs/gpu_runs.md). bf16: the bf16 runs'
# tolerance (tests/test_decode.py, tests/test_precision.py).
TOLERANCE = {"fp32": 1e-3, "bf16": 0.1}
SAMPLES = 2  # of the warm-up's one prompt


def logprob_gap(engine_logp: torch.Tensor, trainer_logp: torch.Tensor) -> float:
    """The largest |engine - trainer| log-prob over the tokens, in float32 on the host."""
    return float((engine_logp.float().cpu() - trainer_logp.float().cpu()).abs().max())


def check_engine_logprobs(parts: RunParts) -> float | None:
    """The start check (every rank: rank 0 samples, every rank computes the same forward, as
    FSDP needs); returns the gap, None where `rollout.logprob_check=0` skips it. ConfigError
    naming the gap, the tolerance and the key where the gap is past it."""
    cfg = parts.cfg
    tolerance = TOLERANCE[cfg.precision] if cfg.rollout.logprob_check is None else float(cfg.rollout.logprob_check)
    if tolerance == 0:
        return None
    from a3po.tasks import encode_prompt

    started = time.perf_counter()
    samples = None
    if parts.dist.is_main:
        prompt = encode_prompt(parts.tokenizer, WARMUP_QUESTION)
        samples = [sample for group in parts.engine.generate([prompt], SAMPLES, seed=0) for sample in group]
    samples = broadcast_object(samples, parts.dist)
    parts.policy.eval()
    with torch.no_grad():
        trainer_logp, _ = parts.trainer.response_logp(samples, with_entropy=False)
    gap = logprob_gap(torch.cat([sample.behave_logp for sample in samples]), trainer_logp)
    if not gap <= tolerance:  # NaN fails too
        raise ConfigError(
            f"rollout.logprob_check: the {cfg.rollout.name} engine's log-probs of {trainer_logp.numel()} sampled tokens "
            f"differ from the trainer's by up to {gap:.3g}, past the {tolerance:g} allowed at precision={cfg.precision}: "
            "the engine does not sample with the policy the trainer trains (rollout.dtype, rollout.model_runner, or "
            "the weight sync), and every importance weight would carry the gap. Fix the engine's setting, or raise "
            "rollout.logprob_check (0 skips the check)")
    log.info("engine check: %s's log-probs of %d tokens within %.3g of the trainer's (allowed %g), %.1f s",
             cfg.rollout.name, trainer_logp.numel(), gap, tolerance, time.perf_counter() - started)
    return gap
