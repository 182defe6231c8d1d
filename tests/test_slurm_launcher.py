"""Every SLURM launcher profile in conf/hydra/launcher/ composes and renders a valid sbatch script.

No cluster needed, so this runs in the fast suite, on a laptop without SLURM too: a key that
hydra-submitit-launcher 1.2.0's schema does not know, a value of the wrong type, or a broken
interpolation fails here instead of at submission time on a cluster. .ci/run runs this file once
with SLURM's commands absent from PATH, before it installs SLURM.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

submitit = pytest.importorskip("submitit")  # a bare GPU image has no submitit: skip, not a collection error
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
PROFILES = sorted(path.stem for path in (CONF_DIR / "hydra" / "launcher").glob("*.yaml"))
SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
SITE_ENV_VARS = [
    "A3PO_SLURM_PARTITION",
    "A3PO_SLURM_ACCOUNT",
    "A3PO_SLURM_QOS",
    "A3PO_SLURM_CONSTRAINT",
    "A3PO_SLURM_GPUS_PER_NODE",
    "A3PO_SLURM_CPUS_PER_TASK",
    "A3PO_SLURM_MEM_GB",
    "A3PO_SLURM_TIMEOUT_MIN",
    "A3PO_SLURM_MAX_NUM_TIMEOUT",
    "A3PO_SLURM_SIGNAL_DELAY_S",
    "A3PO_SLURM_ARRAY_PARALLELISM",
    "A3PO_SLURM_SETUP",
    "A3PO_LOCAL_PARTITION",
]


@pytest.fixture(autouse=True)
def _site_defaults(monkeypatch: pytest.MonkeyPatch):
    """The profiles' own defaults, whatever the developer's shell exports."""
    for name in SITE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _answer_the_srun_probe(monkeypatch: pytest.MonkeyPatch):
    """submitit's SlurmExecutor refuses to be built where `srun` is not on PATH (its `affinity`
    probe: 'Could not detect "srun"'). Rendering the sbatch script runs nothing, so the probe is
    answered as a cluster's login node answers it (`affinity` 2 where srun exists); nothing else
    of submitit is replaced, and no command is run."""
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))


@pytest.fixture
def probe_config_dir(tmp_path: Path) -> Path:
    """A primary config with nothing but the repository's conf/ on the search path, so the
    launcher profiles are checked on their own, whatever state the root config is in."""
    (tmp_path / "probe.yaml").write_text(
        "defaults:\n  - _self_\nhydra:\n  searchpath:\n    - file://" + str(CONF_DIR) + "\n"
        "  sweep:\n    dir: outputs/probe_sweep\n    subdir: ${hydra.job.num}\n"
    )
    return tmp_path


def compose_launcher(config_dir: Path, config_name: str, overrides: list[str]) -> dict:
    """The launcher node as the launcher receives it: composed, then resolved with the
    Hydra config in place (`${hydra.sweep.dir}` and `${now:...}` need it)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        launcher["__sweep_dir__"] = cfg.hydra.sweep.dir
    finally:
        # A HydraConfig left set would make later tests believe they run inside a Hydra job.
        HydraConfig.instance().cfg = None
    launcher["__schema__"] = OmegaConf.get_type(cfg.hydra.launcher)
    return launcher


def sbatch_script(launcher: dict, folder: Path) -> str:
    """The sbatch script submitit would write for these parameters.

    Maps the keys exactly as hydra-submitit-launcher 1.2.0's BaseSubmititLauncher.launch
    does (queue-wide keys as they are, the rest prefixed `slurm_`), so submitit validates
    every name and value the real launch would pass it.
    """
    params = {key: value for key, value in launcher.items() if not key.startswith("__") and key != "_target_"}
    params.pop("submitit_folder")
    executor = submitit.AutoExecutor(
        folder=folder / "%j", cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    base_keys = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{key if key in base_keys else f"slurm_{key}": value for key, value in params.items()})
    return executor._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")


def sbatch_flags(script: str) -> dict[str, str]:
    flags = {}
    for match in re.finditer(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, flags=re.MULTILINE):
        flags[match.group(1)] = match.group(2) if match.group(2) is not None else ""
    return flags


def test_profiles_exist():
    assert {"slurm_gpu", "slurm_local"} <= set(PROFILES)


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_composes_against_the_submitit_schema(profile: str, probe_config_dir: Path, tmp_path: Path):
    launcher = compose_launcher(probe_config_dir, "probe", [f"hydra/launcher={profile}"])

    # Extending `submitit_slurm` is what makes Hydra reject keys the plugin does not know.
    # By name: Hydra's plugin discovery may import the plugin module a second time.
    schema = launcher["__schema__"]
    assert (schema.__module__, schema.__qualname__) == (SlurmQueueConf.__module__, SlurmQueueConf.__qualname__)
    assert launcher["_target_"] == SLURM_LAUNCHER
    # `--gres` and `--gpus-per-node` both request GPUs; SLURM refuses or double-counts the pair.
    assert launcher["gres"] is None or launcher["gpus_per_node"] is None
    assert launcher["partition"]
    # Per-sweep folder: the pickles and logs of one sweep never mix with another's.
    assert launcher["submitit_folder"].startswith(launcher["__sweep_dir__"] + "/.submitit/")
    assert launcher["submitit_folder"].endswith("%j")
    # submitit treats a USR2 as a timeout, not a preemption, once the job has run
    # min(0.8 T, T - 10 min): below 30 minutes that is most of the run.
    assert launcher["timeout_min"] >= 30
    assert 0 < launcher["signal_delay_s"] < launcher["timeout_min"] * 60
    assert launcher["max_num_timeout"] >= 1, "a timed-out run must be able to resume from last.pt"
    assert launcher["additional_parameters"].get("requeue") is True
    assert all(isinstance(line, str) for line in launcher["setup"] or [])

    flags = sbatch_flags(sbatch_script(launcher, tmp_path))
    assert flags["partition"] == launcher["partition"]
    assert flags["time"] == str(launcher["timeout_min"])
    assert flags["signal"] == f"USR2@{launcher['signal_delay_s']}"
    assert "requeue" in flags


def test_gpu_profile_defaults(probe_config_dir: Path, tmp_path: Path):
    launcher = compose_launcher(probe_config_dir, "probe", ["hydra/launcher=slurm_gpu"])
    assert launcher["partition"] == "gpu"
    assert launcher["gpus_per_node"] == 1
    assert launcher["account"] is None and launcher["qos"] is None
    flags = sbatch_flags(sbatch_script(launcher, tmp_path))
    assert flags["gpus-per-node"] == "1"
    assert "account" not in flags and "gres" not in flags


def test_gpu_profile_takes_site_values_from_the_environment(
    probe_config_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("A3PO_SLURM_PARTITION", "a100")
    monkeypatch.setenv("A3PO_SLURM_ACCOUNT", "rl-lab")
    monkeypatch.setenv("A3PO_SLURM_GPUS_PER_NODE", "4")
    monkeypatch.setenv("A3PO_SLURM_MEM_GB", "200")
    monkeypatch.setenv("A3PO_SLURM_TIMEOUT_MIN", "240")
    monkeypatch.setenv("A3PO_SLURM_SETUP", "module load cuda/12.4")
    launcher = compose_launcher(probe_config_dir, "probe", ["hydra/launcher=slurm_gpu"])
    assert (launcher["partition"], launcher["account"], launcher["gpus_per_node"]) == ("a100", "rl-lab", 4)
    assert (launcher["mem_gb"], launcher["timeout_min"]) == (200, 240)
    script = sbatch_script(launcher, tmp_path)
    flags = sbatch_flags(script)
    assert flags["account"] == "rl-lab" and flags["gpus-per-node"] == "4" and flags["mem"] == "200GB"
    assert "\nmodule load cuda/12.4\n" in script


def test_gpu_profile_switches_to_gres_from_the_command_line(probe_config_dir: Path, tmp_path: Path):
    launcher = compose_launcher(
        probe_config_dir,
        "probe",
        ["hydra/launcher=slurm_gpu", "hydra.launcher.gpus_per_node=null", "hydra.launcher.gres=gpu:a100:2"],
    )
    flags = sbatch_flags(sbatch_script(launcher, tmp_path))
    assert flags["gres"] == "gpu:a100:2" and "gpus-per-node" not in flags


def test_local_profile_fits_the_local_cluster(probe_config_dir: Path):
    launcher = compose_launcher(probe_config_dir, "probe", ["hydra/launcher=slurm_local"])
    assert launcher["partition"] == "local"  # PartitionName in slurm/local_cluster.sh
    assert launcher["gpus_per_node"] is None and launcher["cpus_per_task"] == 1
    # Job ids restart with a fresh local cluster, so the folder carries the launch time too.
    assert re.search(r"/\.submitit/\d{8}-\d{6}-\d{6}/%j$", launcher["submitit_folder"])


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_composes_with_the_root_config(profile: str):
    overrides = [f"hydra/launcher={profile}", "model=tiny", "logger=none"]
    try:
        launcher = compose_launcher(CONF_DIR, "config", overrides)
    except MissingConfigException as error:
        # Only a gap elsewhere in conf/ is tolerated; a missing launcher profile fails.
        if "hydra/launcher" in str(error):
            raise
        pytest.skip(f"root config does not compose yet (not a launcher problem): {str(error).splitlines()[0]}")
    assert launcher["_target_"] == SLURM_LAUNCHER
    assert launcher["submitit_folder"].startswith(launcher["__sweep_dir__"] + "/.submitit/")
