"""The proximal methods (`algo=`): one typed registry that config validation, the trainer,
run names and the analysis labels all read. Adding a method is one entry here plus its
`conf/algo/<name>.yaml` (and, for a new approximation, its formula in a3po.maths.proximal).

`prox` says how the proximal log-probs of decoupled PPO are obtained:
- `behave`: the behaviour policy itself; the behaviour weight is exactly 1 and the loss is
  standard (coupled) PPO/GRPO;
- `recompute`: a no-grad forward of the weights at the start of the step (the extra
  forward pass that A-3PO removes);
- `loglinear` / `linear`: A-3PO's per-token interpolation between behaviour and current
  log-probs (a3po.maths.proximal.approximate_prox_logp), weighted by the alpha `schedule`.

Whether the approximation errors of every schedule are logged is not a method but a flag,
`train.log_prox_errors`, usable with any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from a3po.errors import ConfigError


@dataclass(frozen=True)
class Algo:
    name: str
    prox: str            # behave | recompute | loglinear | linear
    uses_schedule: bool  # whether the alpha schedule (and its parameters) changes the method
    summary: str


ALGOS: dict[str, Algo] = {algo.name: algo for algo in (
    Algo("coupled", "behave", False, "standard PPO/GRPO: the ratio is taken against the behaviour policy"),
    Algo("recompute", "recompute", False, "decoupled PPO with the proximal forward pass"),
    Algo("loglinear", "loglinear", True, "A-3PO: interpolation in log-prob space"),
    Algo("linear", "linear", True, "A-3PO variant: interpolation in probability space"),
)}
# Methods whose proximal log-probs need no forward pass (their cost is elementwise).
APPROXIMATE = tuple(name for name, algo in ALGOS.items() if algo.uses_schedule)


def get_algo(name: str) -> Algo:
    """The registry entry; a ConfigError naming `algo.name` and the allowed values otherwise."""
    if name not in ALGOS:
        hint = " (algo=metrics is now the flag train.log_prox_errors=true with algo=recompute)" if name == "metrics" else ""
        raise ConfigError(f"algo.name={name!r} is not allowed; allowed: {sorted(ALGOS)}{hint}")
    return ALGOS[name]
