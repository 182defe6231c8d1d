"""Every metric a run logs, declared once: its name (a `<...>` part stands for a family), who
logs it, how it is reduced over a step, and what it means. docs/design.md's metric table is
this table (tests/test_metrics.py holds them equal, and every logged key to a declaration).

Sources: `trainer` (reduced over the step's micro-batches and minibatches by
a3po.learner.step_metrics), `rollout` (the producer, per batch), `runtime` (the runtime that
hands the batch over), `loop` (the training loop, once per step). Trainer reductions:
  max / min    extreme over micro-batches (and ranks)
  token_mean   mean weighted by each micro-batch's valid tokens (a token mean over the step)
  sum          total over the step
  mb_mean      plain mean over the step's minibatches (one value each: with N ranks, the sum
               of the ranks' shares, as the loss, a token mean over the whole minibatch)
  mb_mean_replicated  as mb_mean, for a value every rank holds whole (FSDP's grad norm)
  derived      computed from other reduced values
Every other source logs one value per step (`step`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

__all__ = ["Metric", "METRICS", "declaration_of", "reduction_of", "is_machine_figure", "COLLAPSED", "COLLAPSE_STEP",
           "DIVERGED"]


@dataclass(frozen=True)
class Metric:
    name: str
    source: str
    reduction: str
    meaning: str

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, _glob(self.name))


def _glob(name: str) -> str:
    out, depth = [], 0
    for char in name:
        depth += char == "<"
        if depth == 0:
            out.append(char)
        elif char == ">":
            depth -= 1
            out.append("*")
    return "".join(out)


def _family(source: str, reduction: str, meaning: str, *names: str) -> tuple[Metric, ...]:
    return tuple(Metric(name, source, reduction, meaning) for name in names)


COLLAPSED = "health/collapsed"
COLLAPSE_STEP = "health/collapse_step"
DIVERGED = "health/diverged"

METRICS: tuple[Metric, ...] = (
    Metric("step", "loop", "step", "the step index"),
    Metric("version", "loop", "step", "the policy version trained at (equal to step)"),
    Metric("wall_time", "loop", "step", "seconds since the run started, continued across resumes"),
    Metric("actor/importance_weight/max", "trainer", "max", "r = pi_theta / pi_prox on valid tokens"),
    Metric("actor/importance_weight/min", "trainer", "min", "r = pi_theta / pi_prox on valid tokens"),
    Metric("actor/importance_weight/mean", "trainer", "token_mean", "r = pi_theta / pi_prox: mean"),
    Metric("actor/behave_weight/max", "trainer", "max", "w = pi_prox / pi_behave, raw (before the correction)"),
    Metric("actor/behave_weight/min", "trainer", "min", "w = pi_prox / pi_behave, raw (before the correction)"),
    Metric("actor/behave_weight/mean", "trainer", "token_mean", "w = pi_prox / pi_behave, raw: mean"),
    Metric("actor/behave_weight/capped_tokens", "trainer", "sum", "valid tokens the correction dropped"),
    Metric("actor/clipped_tokens", "trainer", "sum", "tokens where the objective's clip is in force (a count)"),
    Metric("actor/clip_low", "trainer", "token_mean", "fraction of valid tokens clipped below 1"),
    Metric("actor/clip_high", "trainer", "token_mean", "fraction of valid tokens clipped above 1"),
    Metric("actor/clip_ratio", "trainer", "derived", "clipped_tokens / valid_tokens, after reduction"),
    Metric("actor/valid_tokens", "trainer", "sum", "tokens in the loss"),
    Metric("actor/approx_kl", "trainer", "token_mean", "mean of logp - prox_logp"),
    Metric("actor/entropy", "trainer", "token_mean", "policy entropy per response token"),
    Metric("actor/grad_norm", "trainer", "mb_mean_replicated", "gradient norm before clipping, one per minibatch"),
    Metric("actor/loss", "trainer", "mb_mean", "token-mean loss of each minibatch"),
    *_family("trainer", "token_mean", "fractions of valid tokens dropped below / above the bounds, or truncated",
             "correction/masked_low", "correction/masked_high", "correction/truncated"),
    *_family("trainer", "token_mean", "off-policy diagnostics of w, per micro-batch (a3po.maths.diagnostics)",
             "offpolicy/ess_token", "offpolicy/ess_seq", "offpolicy/chi2_token", "offpolicy/kl_k1", "offpolicy/kl_k3"),
    Metric("offpolicy/ess_total", "trainer", "token_mean",
           "ESS of r = pi_theta / pi_behave per micro-batch: anchor-free (a3po.maths.diagnostics)"),
    Metric("offpolicy/total_ratio_max", "trainer", "max", "r = pi_theta / pi_behave on valid tokens: anchor-free"),
    Metric("offpolicy/total_ratio_min", "trainer", "min", "r = pi_theta / pi_behave on valid tokens: anchor-free"),
    Metric("prox_error/<label>/<error>/<stratum>", "trainer", "token_mean",
           "train.log_prox_errors: logp_abs, clip_flip and clip_rate of each loglinear anchor (and clip_rate of the "
           "recomputed one, label recompute) over the tokens of minibatch k (k<k>) "
           "and of each entropy tercile of a micro-batch's valid tokens (H1 lowest, H3 highest)"),
    Metric("grad_fidelity/<label>/<stat>", "trainer", "max",
           "train.grad_fidelity_every: cosine (cos) and norm ratio (norm_ratio) of the policy gradient with each loglinear "
           "anchor against the one with the recomputed anchor, on the first micro-batch of a due step's last minibatch"),
    Metric("prox_error/<label>/<error>", "trainer", "token_mean",
           "train.log_prox_errors: abs(approximation - recompute) (logp_abs, iw_abs, bw_abs), the flip rates of the loss's clip and keep decisions (clip_flip, keep_flip) and the share of tokens each anchor would clip or keep on the same batch (clip_rate, keep_rate), per schedule (and -linear; the recomputed anchor's own rates under the label recompute)"),
    Metric("hybrid/recomputed", "trainer", "max", "algo=hybrid: 1 on a step trained against recompute's anchor, else 0"),
    Metric("hybrid/drift_ess", "trainer", "max",
           "algo=hybrid with min_ess: the token ESS of pi_theta / pi_behave on the step's first micro-batch at its start"),
    Metric("drift/logp_abs/k<k>", "trainer", "token_mean",
           "train.log_prox_errors: mean abs(logp - behave_logp) in minibatch k (analysis.anchor.drift fits it against d + k/m)"),
    *_family("trainer", "token_mean", "train.log_prox_errors: mean(delta * (recomputed - behave)) and mean(delta^2), "
             "delta = logp - behave_logp, in minibatch k; their ratio is the least-squares alpha at (d, k/m)",
             "alpha_fit/cross/k<k>", "alpha_fit/delta_sq/k<k>"),
    *_family("rollout", "step", "the batch's rewards and responses", "reward/mean", "reward/malformed",
             "response/length_mean", "response/truncated"),
    Metric("eval/reward", "loop", "step", "held-out mean reward after every train.eval_every-th step and the last "
           "(train.eval_size problems x train.eval_samples samples)"),
    Metric("eval/reward_se", "loop", "step", "its standard error, the problems as units (sd of the per-problem means "
           "/ sqrt(problems))"),
    *_family("runtime", "step", "token-weighted staleness of the batch's response tokens",
             "staleness/mean", "staleness/max", "staleness/min"),
    Metric("rollout/batches_generated", "runtime", "step", "lagged: batches generated this step (D + 1 at step 0)"),
    Metric("staleness/hist/<d>", "runtime", "step", "async: response tokens of staleness d"),
    *_family("runtime", "step", "async: share of in-flight tokens and the mean staleness of in-flight / queued ones",
             "staleness/inflight_frac", "staleness/inflight_mean", "staleness/queued_mean"),
    *_family("runtime", "step", "async: how the batch was made", "rollout/tokens_per_s", "rollout/admitted_at_version",
             "time/wait_data", "time/wait_capacity"),
    *_family("loop", "step", "seconds of the step's phases (docs/design.md, Timing keys)", "time/step", "time/step_cpu",
             "time/rollout", "time/prox_logp", "time/prox_reference", "time/fidelity", "time/train", "time/weight_sync",
             "time/eval",
             "time/checkpoint", "time/warmup"),
    *_family("loop", "step", "GiB of this process's memory after the step (rank 0's; a3po.memory.machine): resident "
             "now and its peak since the process started (VmRSS, VmHWM)", "memory/host_rss", "memory/host_peak"),
    Metric("memory/heap_released", "loop", "step", "1 when the step began by handing the heap's freed pages back "
           "(its resident memory was above the memory check's estimate; a one-process CPU run), else 0"),
    *_family("loop", "step", "GiB on the trainer's CUDA device: the most torch has allocated since the process "
             "started, and what its caching allocator holds now", "memory/cuda_peak", "memory/cuda_reserved"),
    Metric("runtime/shared_device", "runtime", "step", "async: 1 when rollout and training share one CUDA device "
           "(each thread's phase times include the other's kernels; docs/design.md, Timing keys)"),
    Metric("machine/threads", "loop", "step", "torch's intra-op threads the step ran with: the cores a run can use, "
           "which the contention flag holds its CPU time against (analysis.scalars.contended)"),
    Metric(COLLAPSED, "loop", "step", "1 when the policy has collapsed (a3po.run.health), else 0"),
    Metric(COLLAPSE_STEP, "loop", "step", "while collapsed: the first step of the collapse"),
    Metric(DIVERGED, "loop", "step", "1 on the one line a diverged run logs for the step it stopped at"),
)


# Keys that measure the machine (time, memory), not the run's arithmetic: two runs that compute
# the same numbers (one resumed, one not; one rank or two) log different values for them.
MACHINE_PREFIXES = ("time/", "memory/", "machine/")


def is_machine_figure(key: str) -> bool:
    return key == "wall_time" or key.startswith(MACHINE_PREFIXES)


def declaration_of(key: str) -> Metric:
    """The declaration a logged key belongs to; KeyError naming the key otherwise."""
    for metric in METRICS:
        if metric.matches(key):
            return metric
    raise KeyError(f"metric {key!r} is not declared; add it to a3po.metrics.METRICS (and docs/design.md)")


def reduction_of(key: str) -> str:
    """How a trainer metric combines over a step; KeyError for one the trainer does not log."""
    metric = declaration_of(key)
    if metric.source != "trainer":
        raise KeyError(f"metric {key!r} is logged by the {metric.source}, not reduced from the trainer's micro-batches")
    return metric.reduction


def markdown_table() -> str:
    """The table docs/design.md carries (`python -m a3po.metrics` prints it)."""
    rows = [f"| `{m.name}` | {m.source} | {m.reduction} | {m.meaning} |" for m in METRICS]
    return "\n".join(["| name | source | reduction | meaning |", "|---|---|---|---|", *rows])


if __name__ == "__main__":
    print(markdown_table())
