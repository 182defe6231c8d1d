"""Compute nodes without internet (a3po/run/fetch.py, docs/gpus.md): `python -m a3po.run.fetch
[--check]` and a run's offline check at start. Every cache here is a temporary directory, populated
by hand in the layouts huggingface_hub and datasets write; no test downloads anything."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose_config

from a3po.errors import ConfigError
from a3po.run import fetch
from a3po.run.fetch import HubItem, check_offline_cache, fetch_command, hub_items, lookup
from a3po.config import parse_config

QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
COMMAND = "python -m a3po.run.fetch experiment=paper_gsm8k"
# A Qwen2.5-Instruct snapshot's files as snapshot_download(allow_patterns=MODEL_PATTERNS) leaves them
QWEN_FILES = {name: "{}" for name in ("config.json", "generation_config.json", "tokenizer_config.json",
                                      "tokenizer.json", "vocab.json")} | {"merges.txt": "", "model.safetensors": "w"}


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Empty caches under tmp_path, named the three ways a run's environment may name them, and
    HF_HUB_OFFLINE=1 (a test going online unsets it)."""
    home = tmp_path / "hf"
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", home / "hub"), ("HF_DATASETS_CACHE", home / "datasets")):
        monkeypatch.setenv(name, str(value))
    for name in ("HUGGINGFACE_HUB_CACHE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def fake_snapshot(hub: Path, repo_id: str, files: dict[str, str | Path], commit: str = "a" * 40) -> Path:
    """huggingface_hub's cache layout: models--<org>--<name>/{refs/main, snapshots/<commit>/<file>
    linked to blobs/<hash>}; a Path value is linked to as is."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, content in files.items():
        if isinstance(content, Path):
            (snapshot / name).symlink_to(content)
            continue
        blob = repo / "blobs" / hashlib.sha256(f"{name}{content}".encode()).hexdigest()
        blob.write_text(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def fake_gsm8k(cache: Path, config: str = "main", n: int = 4) -> Path:
    """A prepared openai/gsm8k in datasets' layout: <cache>/openai___gsm8k/<config>/0.0.0/<hash>/
    with dataset_info.json and gsm8k-<split>.arrow, the directory `datasets` reloads offline."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    directory = cache / "openai___gsm8k" / config / "0.0.0" / ("f" * 16)
    directory.mkdir(parents=True)
    splits = datasets.SplitDict()
    for split in ("train", "test"):
        with ArrowWriter(path=str(directory / f"gsm8k-{split}.arrow")) as writer:
            for i in range(n):
                writer.write({"question": f"{split} question {i}?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"})
            count, size = writer.finalize()
        splits.add(datasets.SplitInfo(name=split, num_bytes=size, num_examples=count, dataset_name="gsm8k"))
    features = datasets.Features({"question": datasets.Value("string"), "answer": datasets.Value("string")})
    datasets.DatasetInfo(config_name=config, dataset_name="gsm8k", splits=splits,
                         features=features).write_to_directory(str(directory))
    return directory


def paper_gsm8k(tmp_path: Path, *overrides: str):
    return compose_config(["experiment=paper_gsm8k", *overrides], output_root=tmp_path / "outputs")


def test_check_reports_both_items_missing_and_exits_2(hf_cache, capsys):
    with pytest.raises(SystemExit) as exit_:
        fetch.main(["--check", "experiment=paper_gsm8k"])
    assert exit_.value.code == 2
    out = capsys.readouterr().out
    assert f"missing  model {QWEN} (model.path): no snapshot of it in {hf_cache / 'hub'} (HF_HUB_CACHE)" in out
    assert f"missing  dataset openai/gsm8k (config main) (task.hub_id): no prepared copy of config main in " \
           f"{hf_cache / 'datasets' / 'openai___gsm8k' / 'main'} (HF_DATASETS_CACHE)" in out
    assert f"2 of 2 hub items missing; on a node with internet run: {COMMAND}" in out


def test_an_offline_run_is_refused_naming_each_item_its_cache_and_the_command(hf_cache, tmp_path):
    with pytest.raises(ConfigError) as error:
        check_offline_cache(parse_config(paper_gsm8k(tmp_path)), overrides=["experiment=paper_gsm8k"])
    message = str(error.value)
    assert message.startswith("HF_HUB_OFFLINE set (offline)")
    assert f"model {QWEN} (model.path): no snapshot of it in {hf_cache / 'hub'}" in message
    assert f"dataset openai/gsm8k (config main) (task.hub_id): no prepared copy" in message
    assert f"`{COMMAND}`" in message
    # without a Hydra job's overrides, the command selects the run's model and task groups
    with pytest.raises(ConfigError, match="`python -m a3po.run.fetch model=qwen2.5_1.5b task=gsm8k`"):
        check_offline_cache(parse_config(paper_gsm8k(tmp_path)))


def test_each_library_is_offline_by_its_own_variables(hf_cache, tmp_path, monkeypatch):
    cfg = paper_gsm8k(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # datasets online: only the model is checked
    with pytest.raises(ConfigError) as error:
        check_offline_cache(parse_config(cfg))
    assert QWEN in str(error.value) and "openai/gsm8k" not in str(error.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # datasets alone offline: only the dataset
    with pytest.raises(ConfigError, match="^HF_DATASETS_OFFLINE set") as error:
        check_offline_cache(parse_config(cfg))
    assert "openai/gsm8k" in str(error.value) and QWEN not in str(error.value)
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    check_offline_cache(parse_config(cfg))  # online: nothing is checked, the run downloads as it always did


def test_the_run_stops_at_start_through_train_py(hf_cache, tmp_path):
    """experiments/train.py on an offline node: exit 2 and the message, before any model loads
    (the check comes right after config validation, before the memory check reads model configs)."""
    command = [sys.executable, "experiments/train.py", "experiment=paper_gsm8k", f"output_root={tmp_path / 'out'}"]
    done = subprocess.run(command, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "config error: HF_HUB_OFFLINE set (offline)" in done.stderr
    assert f"model {QWEN}" in done.stderr and "dataset openai/gsm8k (config main)" in done.stderr
    assert f"`{COMMAND} output_root={tmp_path / 'out'}`" in done.stderr  # the job's own overrides


def test_a_cache_populated_by_hand_is_present(hf_cache, tmp_path, capsys):
    snapshot = fake_snapshot(hf_cache / "hub", QWEN, QWEN_FILES)
    prepared = fake_gsm8k(hf_cache / "datasets")
    assert lookup(HubItem("model", QWEN, "model.path")).where == snapshot
    assert lookup(HubItem("dataset", "openai/gsm8k", "task.hub_id", "main")).where == prepared
    check_offline_cache(parse_config(paper_gsm8k(tmp_path)))  # no error: the run goes on
    fetch.main(["--check", "experiment=paper_gsm8k"])  # exit 0: no SystemExit
    out = capsys.readouterr().out
    assert f"present  model {QWEN} (model.path) at {snapshot} (" in out
    assert f"present  dataset openai/gsm8k (config main) (task.hub_id) at {prepared} (" in out
    assert "all there" in out


def test_a_snapshot_without_weights_or_with_another_config_cached_is_missing(hf_cache, tmp_path):
    index = '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    files = {**QWEN_FILES, "model.safetensors.index.json": index, "model-00001-of-00002.safetensors": "w"}
    del files["model.safetensors"]
    snapshot = fake_snapshot(hf_cache / "hub", QWEN, files)
    fake_gsm8k(hf_cache / "datasets", config="socratic")
    with pytest.raises(ConfigError) as error:
        check_offline_cache(parse_config(paper_gsm8k(tmp_path)))
    assert f"{snapshot} lacks model-00002-of-00002.safetensors" in str(error.value)
    assert "no prepared copy of config main" in str(error.value)


@pytest.mark.slow  # loads SmolLM2-135M's weights in a subprocess (half a minute on 2 busy cores)
def test_the_lookup_agrees_with_what_transformers_and_datasets_read_offline(hf_cache, tmp_path):
    """A snapshot holding real weights (the embedded SmolLM2, under Qwen's hub id) and a prepared
    GSM8K that the lookup calls present are what a3po's own loaders read with HF_HUB_OFFLINE=1."""
    from a3po.models.smollm2 import ensure_smollm2_converted

    converted = ensure_smollm2_converted()
    fake_snapshot(hf_cache / "hub", QWEN, {path.name: path for path in converted.iterdir()})
    fake_gsm8k(hf_cache / "datasets", n=3)
    check_offline_cache(parse_config(paper_gsm8k(tmp_path)))
    script = ("from a3po.models import load_policy; from a3po.tasks.gsm8k import load_gsm8k; "
              f"model, _ = load_policy({{'source': 'hub', 'path': '{QWEN}', 'dtype': 'float32'}}); "
              "train, test = load_gsm8k(None); print(type(model).__name__, len(train), len(test))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["LlamaForCausalLM", "3", "3"]


@pytest.mark.parametrize("overrides", [[], ["model=tiny"], ["task=words"], ["model=tiny", "task=reasoning_gym"],
                                       ["model=qwen2.5_1.5b", "model.path=LOCAL"], ["task=gsm8k", "task.path=LOCAL"]])
def test_configs_reading_nothing_from_the_hub_need_nothing(hf_cache, tmp_path, capsys, overrides):
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "gsm8k.jsonl").write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    local = tmp_path / "local" / ("gsm8k.jsonl" if "task.path=LOCAL" in overrides else "")
    overrides = [word.replace("LOCAL", str(local)) for word in overrides]
    assert hub_items(parse_config(compose_config(overrides))) == []
    check_offline_cache(parse_config(compose_config(overrides)))
    fetch.main(["--check", *overrides])
    assert capsys.readouterr().out.startswith("nothing to fetch: ")


def test_fetch_puts_each_item_where_the_check_finds_it(hf_cache, tmp_path, monkeypatch, capsys):
    """The fetch's own path, its downloads replaced by hand-made copies (no network in tests)."""
    def download(item):
        fake_snapshot(fetch.cache_dir("model")[0], item.repo_id, QWEN_FILES) if item.kind == "model" \
            else fake_gsm8k(fetch.cache_dir("dataset")[0], item.config)

    monkeypatch.setattr(fetch, "_download", download)
    with pytest.raises(SystemExit) as exit_:  # offline: nothing can be downloaded
        fetch.main(["experiment=paper_gsm8k"])
    assert exit_.value.code == 2 and "HF_HUB_OFFLINE set: nothing can be downloaded" in capsys.readouterr().err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fetch.main(["experiment=paper_gsm8k"])
    out = capsys.readouterr().out
    assert f"fetched  model {QWEN} (model.path) at {hf_cache / 'hub'}" in out
    assert "fetched  dataset openai/gsm8k (config main) (task.hub_id) at " in out and out.rstrip().endswith(
        "a run of this config now starts with HF_HUB_OFFLINE=1 on a node reading these caches")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_offline_cache(parse_config(paper_gsm8k(tmp_path)))


def test_a_failed_download_names_the_item_and_exits_1(hf_cache, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(item):
        raise ConnectionError("the hub cannot be reached")

    monkeypatch.setattr(fetch, "_download", unreachable)
    with pytest.raises(SystemExit) as exit_:
        fetch.main(["model=qwen2.5_1.5b", "task=gsm8k"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1
    assert f"error: could not fetch model {QWEN}: ConnectionError: the hub cannot be reached" in err
    assert f"not fetched: model {QWEN}, dataset openai/gsm8k (config main)" in err


def test_fetch_command_and_bad_flags(hf_cache, tmp_path, capsys):
    cfg = paper_gsm8k(tmp_path, "task.hub_config=socratic")
    assert fetch_command(parse_config(cfg)) == "python -m a3po.run.fetch model=qwen2.5_1.5b task=gsm8k task.hub_config=socratic"
    with pytest.raises(SystemExit) as exit_:
        fetch.main(["--chek", "experiment=paper_gsm8k"])
    assert exit_.value.code == 2 and "--chek is not a flag of python -m a3po.run.fetch" in capsys.readouterr().err
