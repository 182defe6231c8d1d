"""One typed spec per ablation axis: what a choice computes and the parameters it takes, with
their defaults and ranges (run names and labels are built from them by a3po.identity).

Each axis (alpha schedules, proximal methods, corrections, objectives) keeps its choices in a
`Registry` of `Spec`s beside their functions. Config validation, the trainer, run names,
analysis labels and the benchmark all read that registry, so adding a choice is one Python
definition (its function and its `Spec`) plus its `conf/<axis>/<name>.yaml`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

__all__ = ["Param", "Spec", "Bound", "Registry", "number"]


def number(key: str, value: Any) -> float:
    """`value` as a float; ValueError naming `key` for a bool, a non-number or NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{key}={value!r} is not a number")
    return float(value)


@dataclass(frozen=True)
class Param:
    """A numeric parameter: its default, the predicate its values satisfy and that predicate
    in words (`in (0, 1]`). `nullable`: None is allowed too, meaning `none_means`."""

    default: float | None
    allowed: Callable[[float], bool]
    describe: str
    nullable: bool = False
    none_means: str = ""

    def check(self, key: str, value: Any) -> float | None:
        """The checked value; ValueError naming `key`, the value and what is allowed."""
        if value is None and self.nullable:
            return None
        value = number(key, value)
        if not self.allowed(value):
            allowed = self.describe + (f", or null ({self.none_means})" if self.nullable else "")
            raise ValueError(f"{key}={value:g} is not allowed; it must be {allowed}")
        return value


@dataclass(frozen=True)
class Spec:
    """One choice on one axis. `fn` is what the trainer calls with the checked parameters as
    keyword arguments; `params` are those parameters in order; `check_together` checks a
    relation between them (lo < hi). An axis that needs more (a proximal method's anchor)
    subclasses it with typed fields."""

    name: str
    fn: Callable[..., Any] | None
    summary: str
    params: Mapping[str, Param] = field(default_factory=dict)
    check_together: Callable[[Mapping[str, float | None]], None] | None = None

    def defaults(self) -> dict[str, float | None]:
        return {key: param.default for key, param in self.params.items()}

    def check(self, given: Mapping[str, Any] | None, where: str) -> dict[str, float | None]:
        """Every parameter of this choice: `given` (a whole config group will do: `name` is
        ignored) over the defaults, checked. ValueError naming `<where>.<key>` for a key this
        choice does not take (a typo never passes) or a value out of range."""
        given = {key: value for key, value in (given or {}).items() if key != "name"}
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            raise ValueError(f"{where}={self.name} does not take {unknown}; its parameters: {list(self.params)}")
        values = {key: param.check(f"{where}.{key}", given.get(key, param.default))
                  for key, param in self.params.items()}
        if self.check_together is not None:
            self.check_together(values)
        return values


@dataclass(frozen=True)
class Bound:
    """A choice bound once, at start, to its checked parameters (`Registry.bind`): the hot path
    calls it (`bound(*args)` runs `spec.fn(*args, **params)`) and never checks them again."""

    spec: Spec
    params: Mapping[str, float | None]

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, *args: Any, **extra: Any) -> Any:
        return self.spec.fn(*args, **extra, **self.params)


class Registry(Mapping[str, Spec]):
    """The choices of one axis, in the order they were registered. `lookup` fails with the key
    and the allowed names; `register` adds a choice (a plug-in, or a test's toy one)."""

    def __init__(self, axis: str, specs: tuple[Spec, ...] = ()) -> None:
        self.axis = axis
        self._specs: dict[str, Spec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: Spec) -> Spec:
        if spec.name in self._specs:
            raise ValueError(f"{self.axis} {spec.name!r} is registered already")
        self._specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        del self._specs[name]

    def lookup(self, name: Any, where: str | None = None) -> Spec:
        """The spec of `name`; ValueError naming the axis (and `where`, the config key that chose
        it, when that is not the axis itself) and what is allowed."""
        if name not in self._specs:
            place = f"{where}: " if where and where != self.axis else ""
            raise ValueError(f"{place}{self.axis}={name!r} is not allowed; allowed: {sorted(self._specs)}")
        return self._specs[name]

    def bind(self, group: "Bound | Mapping[str, Any]", where: str | None = None) -> Bound:
        """`group` (`name` and parameters: a config group) looked up, checked and bound; a Bound
        as it is. ValueError naming the key, as `lookup` and `Spec.check`."""
        if isinstance(group, Bound):
            return group
        where = where or self.axis
        spec = self.lookup(group.get("name"), where)
        return Bound(spec, spec.check(group, where))

    def __getitem__(self, name: str) -> Spec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)
