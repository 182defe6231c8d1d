"""The trainer's per-step metrics, reduced over the step's micro-batches and minibatches as
a3po.metrics declares each name. Values stay on the device as 0-dim tensors until
`result()`, which reads them all in one host transfer (one sync per step on a GPU).

Every value must be on the trainer's device, in every run: across ranks the values are
concatenated into one tensor per collective, which nccl needs on the GPU (a CPU tensor among
them fails the first multi-GPU step, never a CPU test), so `add` refuses one on another device
at its first step, naming it, single-process runs included (tests/test_gpu_path.py stands
'meta' in for a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from a3po.metrics import reduction_of

__all__ = ["StepMetrics"]


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one: the same type and index (`cuda` without an index is the
    current GPU, which a rank's `cuda:<LOCAL_RANK>` is)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_device(name: str, value: torch.Tensor, device: torch.device, whose: str = "the trainer's device") -> None:
    """RuntimeError naming the metric when `value` is not on `device` (`whose`: what it is)."""
    if not same_device(value.device, device):
        raise RuntimeError(
            f"metric {name!r} is on {value.device}, not on {device} ({whose}): every metric of a step must be "
            f"made on the trainer's device (the multi-rank reduction concatenates them all for one collective, "
            f"which needs them on the device the process group communicates from)")


class StepMetrics:
    """Collects one step's values; `result()` reduces them as a3po.metrics declares. `device`:
    the trainer's, which every value must be on; None: the first value's (values on two devices
    are still refused)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)
        self._whose = "the trainer's device"
        self._values: dict[str, list[torch.Tensor]] = {}
        self._tokens: dict[str, list[torch.Tensor]] = {}

    def add(self, values: Mapping[str, torch.Tensor], n_tokens: int | torch.Tensor = 1) -> None:
        """Values of one micro-batch (with its valid-token count) or one minibatch."""
        weight = None  # one tensor per call, shared by its values (not one host copy per value)
        for name, value in values.items():
            reduction_of(name)  # an unknown name fails here, at its first step
            if self.device is None:
                self.device, self._whose = value.device, f"the step's first metric {name!r}'s device"
            check_device(name, value, self.device, self._whose)  # a CPU tensor in a GPU run fails here
            if weight is None:
                weight = torch.as_tensor(n_tokens, dtype=torch.float32, device=value.device).reshape(())
            self._values.setdefault(name, []).append(value.detach().float().reshape(()))
            self._tokens.setdefault(name, []).append(weight)

    def _reduce(self, name: str) -> torch.Tensor:
        values = torch.stack(self._values[name])
        reduction = reduction_of(name)
        if reduction == "max":
            return values.max()
        if reduction == "min":
            return values.min()
        if reduction == "sum":
            return values.sum()
        if reduction in ("mb_mean", "mb_mean_replicated"):
            return values.mean()
        weights = torch.stack(self._tokens[name])
        return (values * weights).sum() / weights.sum().clamp(min=1)

    def _reduce_across_ranks(self) -> dict[str, torch.Tensor]:
        """`_reduce` over every rank's values, in three all-reduces of one flat vector each
        (sum, max, min). Every rank must call it, with the same names."""
        from a3po.distributed import all_reduce_max, all_reduce_min, all_reduce_sum

        names = list(self._values)  # the order they were added in: the same on every rank
        device = self.device  # every value's (`add` refuses one elsewhere)
        sums, maxes, mins = [], [], []
        for name in names:  # what each name contributes, read back below in the same order
            values, reduction = torch.stack(self._values[name]), reduction_of(name)
            if reduction == "max":
                maxes.append(values.max().reshape(1))
            elif reduction == "min":
                mins.append(values.min().reshape(1))
            elif reduction == "sum":
                sums.append(values.sum().reshape(1))
            elif reduction == "mb_mean":  # each rank holds its share of every minibatch's value
                sums.append(values)
            elif reduction == "token_mean":
                weights = torch.stack(self._tokens[name])
                sums.append(torch.stack([(values * weights).sum(), weights.sum()]))
        empty = torch.zeros(0, device=device)
        sums = iter(all_reduce_sum(torch.cat(sums) if sums else empty))
        maxes = iter(all_reduce_max(torch.cat(maxes) if maxes else empty))
        mins = iter(all_reduce_min(torch.cat(mins) if mins else empty))
        out = {}
        for name in names:
            reduction, n = reduction_of(name), len(self._values[name])
            if reduction in ("max", "min", "sum"):
                out[name] = next({"max": maxes, "min": mins, "sum": sums}[reduction])
            elif reduction == "mb_mean":
                out[name] = torch.stack([next(sums) for _ in range(n)]).mean()
            elif reduction == "mb_mean_replicated":
                out[name] = torch.stack(self._values[name]).mean()
            else:
                total, weight = next(sums), next(sums)
                out[name] = total / weight.clamp(min=1)
        return out

    def result(self, across_ranks: bool = False) -> dict[str, float]:
        """Every collected name reduced, plus `actor/clip_ratio` (clipped / valid tokens).
        `across_ranks`: over every rank of a distributed run (each rank calls it)."""
        if across_ranks and self._values:
            out = self._reduce_across_ranks()
        else:
            out = {name: self._reduce(name) for name in self._values}
        if "actor/clipped_tokens" in out and "actor/valid_tokens" in out:
            out["actor/clip_ratio"] = out["actor/clipped_tokens"] / out["actor/valid_tokens"].clamp(min=1)
        if not out:
            return {}
        values = torch.stack([value.to(next(iter(out.values())).device) for value in out.values()]).tolist()
        return dict(zip(out.keys(), values))
