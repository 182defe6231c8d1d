"""How a step's phases add up to training time, in the two runtimes.

Lagged (serial, `runtime=lagged`): one process does everything in turn, so a step takes the
sum of its phases.

Asynchronous (`runtime=async`, AReaL's layout): the rollout runs on devices of its own and
the trainer on its own. The trainer's step k trains on batch k and then publishes version
k + 1 (the weight sync pauses the rollout for its duration, as AReaL's `update_weights`
pauses generation). The rollout may start batch j only once the trainer's version v has
reached j - bound (AReaL's admission rule, `max_head_offpolicyness`: no sample trains more
than `bound` versions after the policy that generated it). `simulate_async` plays this out
event by event; in steady state a step takes max(rollout, trainer) + sync when the bound lets
the two overlap (the sync stalls both sides), and rollout + trainer when the bound is 0 (the rollout waits for every
update), which `steady_interval` gives in closed form for the tests to hold the simulation to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["serial_step", "trainer_side", "simulate_async", "steady_interval", "async_step", "bounding_side"]


def serial_step(phases: Mapping[str, float]) -> float:
    """The lagged runtime's step: the sum of its phases."""
    return float(sum(phases.values()))


def trainer_side(phases: Mapping[str, float]) -> float:
    """The trainer's own work a step: everything but the rollout and the weight sync (which
    `async_step` and `simulate_async` add to both sides, since it stalls both)."""
    return float(sum(v for k, v in phases.items() if k not in ("rollout", "weight_sync")))


def _check(rollout_s: float, train_s: float, sync_s: float, bound: int, steps: int) -> None:
    for name, value in (("rollout_s", rollout_s), ("train_s", train_s), ("sync_s", sync_s)):
        if not value >= 0:
            raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    if bound < 0 or steps < 1:
        raise ValueError(f"bound must be >= 0 and steps >= 1, got bound={bound!r}, steps={steps!r}")


def simulate_async(rollout_s: float | Sequence[float], train_s: float, sync_s: float = 0.0, bound: int = 1,
                   steps: int = 200) -> list[float]:
    """The times at which the trainer finishes steps 0..steps-1 (its sync included), with one
    rollout worker producing batches in order and the admission rule above. `train_s` is the
    trainer's compute per step (prox, train, optimizer); `sync_s` stalls both sides;
    `rollout_s` is one duration for every batch, or one per batch (cycled), where the closed
    form, which sees only the mean, is not exact."""
    durations = [float(rollout_s)] if isinstance(rollout_s, (int, float)) else [float(v) for v in rollout_s]
    if not durations:
        raise ValueError("rollout_s must be seconds, or a non-empty sequence of them")
    for value in durations:
        _check(value, train_s, sync_s, bound, steps)
    published = [0.0]          # published[v]: when version v became available (v = 0 at start)
    rollout_free = 0.0         # when the rollout worker can start its next batch
    trainer_free = 0.0
    done = []
    for k in range(steps):
        # batch k may start once version k - bound is published, and the worker is free
        start = max(rollout_free, published[max(0, k - bound)])
        ready = start + durations[k % len(durations)]
        for published_at in published[1:]:  # a sync that begins while this batch generates pauses it
            if start <= published_at - sync_s < ready:
                ready += sync_s
        rollout_free = ready
        finish = max(trainer_free, ready) + train_s + sync_s
        trainer_free = finish
        published.append(finish)
        done.append(finish)
    return done


def steady_interval(done: list[float], tail: int = 50) -> float:
    """Seconds per step once the pipeline has filled: the mean interval over the last `tail`."""
    tail = min(tail, len(done) - 1)
    if tail < 1:
        raise ValueError("steady_interval needs at least two finished steps")
    return (done[-1] - done[-1 - tail]) / tail


def async_step(rollout_s: float, train_s: float, sync_s: float = 0.0, bound: int = 1) -> float:
    """The steady-state step of the async pipeline in closed form: rollout + trainer + sync at
    bound 0, max(rollout, trainer) + sync otherwise (the sync stalls both sides)."""
    _check(rollout_s, train_s, sync_s, bound, 1)
    return rollout_s + train_s + sync_s if bound == 0 else max(rollout_s, train_s) + sync_s


def bounding_side(rollout_s: float, train_s: float, bound: int) -> str:
    """Which side sets the async pipeline's pace: 'rollout', 'trainer', or 'both' (bound 0:
    each waits for the other every step)."""
    if bound == 0:
        return "both"
    return "rollout" if rollout_s > train_s else "trainer"
