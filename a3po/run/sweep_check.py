"""Every job of a sweep checked before any job starts.

A Hydra multirun launches its jobs one after another (the basic launcher) or as a SLURM array;
each job validates its own config at start (a3po.config.parse_config). A bad value in the
sweep's last job would then stop the sweep only after the jobs before it had trained: hours on
a CPU, a queue's wait on SLURM. `CheckSweepConfigs`, a Hydra callback (conf/config.yaml's
`hydra.callbacks`), composes and validates every job's config when the multirun starts, so the
sweep stops in seconds, with exit 2, naming the job and the key, before anything is launched.

Hydra's own sweeper already composes each batch before launching it, so an unknown group option
or key fails there; this adds the suite's value rules. The jobs are expanded as the basic
sweeper does (`hydra.sweeper.params`, then the command line's overrides); a sweeper of another
kind is left to its own expansion.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback

__all__ = ["CheckSweepConfigs", "sweep_jobs"]

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(params: dict[str, str], overrides: list[str]) -> list[list[str]]:
    """Each job's overrides, in launch order: the basic sweeper's product of the sweep
    parameters (`params` first, as the sweeper reads them, then `overrides`)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [f"{key}={value}" for key, value in params.items()] + list(overrides)
    parsed = OverridesParser.create().parse_overrides(given)
    return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


class CheckSweepConfigs(Callback):
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from hydra import compose
        from omegaconf import OmegaConf

        from a3po.config import parse_config
        from a3po.errors import EXIT_CONFIG_ERROR, ConfigError

        if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
            return
        params = config.hydra.sweeper.get("params")
        params = OmegaConf.to_container(params) if params else {}
        jobs = sweep_jobs({key: str(value) for key, value in params.items()}, list(config.hydra.overrides.task))
        for index, overrides in enumerate(jobs):
            own = [item for item in overrides if not item.lstrip("+~").startswith("hydra")]
            try:
                parse_config(compose(config_name=config.hydra.job.config_name, overrides=own))
            except ConfigError as err:
                print(f"config error: job #{index} of {len(jobs)} ({' '.join(own)}): {err}; "
                      "nothing was launched", file=sys.stderr)
                raise SystemExit(EXIT_CONFIG_ERROR) from None
