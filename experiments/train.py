"""Train one run, or a sweep with -m. All logic lives in a3po.run.main.run.

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
from a3po.run.health import EXIT_CONFIG_ERROR, EXIT_DIVERGED, RunDiverged  # noqa: E402
from a3po.run.main import run  # noqa: E402
from a3po.run.rundir import remove_refused_job_dir  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Exit status: 0 done (or stopped by a signal, to be resumed), 1 a crash, 2 a config error,
    3 the run diverged (a single run; in a sweep the job returns and the others go on)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        # The run directory is Hydra's output directory for this job: hydra.run.dir, or
        # hydra.sweep.dir/hydra.sweep.subdir in a sweep (conf/config.yaml sets the defaults).
        run(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    except ConfigError as err:
        # A config mistake is the user's to fix: say what, not where in our code. A refused run
        # leaves no directory: the one Hydra made for it goes, where it holds only Hydra's files.
        print(f"config error: {err}", file=sys.stderr)
        job = HydraConfig.get()
        remove_refused_job_dir(Path(job.runtime.output_dir), f"{job.job.name}.log", stop_at=Path(cfg.output_root))
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except RunDiverged as err:
        # An outcome, recorded in the run directory (diverged.json), not a crash. A sweep's jobs
        # run one after another in this process (or as SLURM jobs): exiting would drop the rest,
        # so a job returns and the analysis counts and excludes the run; one run says it in its status.
        print(f"diverged: {err}", file=sys.stderr)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise SystemExit(EXIT_DIVERGED) from None


if __name__ == "__main__":
    main()
