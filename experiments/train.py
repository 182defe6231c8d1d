"""Train one run, or a sweep with -m. All logic lives in a3po.train.run.

    python experiments/train.py algo=loglinear staleness=4
    python experiments/train.py -m experiment=staleness_sweep
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import a3po.config  # noqa: E402,F401  (registers the run-name resolver used by conf/config.yaml)
from a3po.errors import ConfigError  # noqa: E402
from a3po.train import run  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        # The run directory is Hydra's output directory for this job: hydra.run.dir, or
        # hydra.sweep.dir/hydra.sweep.subdir in a sweep (conf/config.yaml sets the defaults).
        run(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    except ConfigError as err:
        # A config mistake is the user's to fix: say what, not where in our code.
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
