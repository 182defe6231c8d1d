"""`python -m a3po.run.fetch [--check] [overrides]`: download what a run of a config reads from
the Hugging Face hub into the caches the run reads, for compute nodes without internet.

The overrides compose the config a run composes (`experiment=paper_gsm8k`). A hub model is a
snapshot of its config, tokenizer and safetensors weights in the hub cache (HF_HUB_CACHE, else
HF_HOME/hub); GSM8K from the hub is `datasets.load_dataset(task.hub_id, task.hub_config)`, prepared
in the datasets cache (HF_DATASETS_CACHE, else HF_HOME/datasets). `--check` downloads nothing and
says what the caches hold: exit 0 all there, 2 something missing. A run with HF_HUB_OFFLINE=1
(HF_DATASETS_OFFLINE=1 for the dataset) makes the same lookup right after config validation
(`check_offline_cache`). docs/gpus.md, "Compute nodes without internet".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from a3po.errors import EXIT_CONFIG_ERROR, ConfigError, composition_error
from a3po.memory.parts import format_bytes
from a3po.run_config import RunConfig

__all__ = ["HubItem", "Lookup", "hub_items", "lookup", "check_offline_cache", "fetch_command", "main"]

FETCH = "python -m a3po.run.fetch"
CONF = Path(__file__).resolve().parents[2] / "conf"
TRUE_VALUES = ("1", "ON", "YES", "TRUE")  # huggingface_hub's and datasets' reading of a flag
# What is fetched of a model repo: config, tokenizer, safetensors weights; no .bin/.pt/.gguf copies.
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model")


@dataclass(frozen=True)
class HubItem:
    """One thing a run reads from the hub: `kind` model or dataset, named by config key `key`."""

    kind: str
    repo_id: str
    key: str
    config: str | None = None  # a dataset's config name

    def __str__(self) -> str:
        return f"{self.kind} {self.repo_id}" + (f" (config {self.config})" if self.config else "")


@dataclass(frozen=True)
class Lookup:
    """Where `item` is in the local cache; or the cache looked in, `missing` saying what is not there."""

    item: HubItem
    where: Path
    missing: str | None = None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in TRUE_VALUES


def offline(kind: str) -> str | None:
    """The variable that makes the library reading `kind` offline, None where it is online:
    huggingface_hub (so transformers) reads HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE; datasets reads
    HF_DATASETS_OFFLINE where it is set (1 or 0), else the same."""
    if kind == "dataset" and os.environ.get("HF_DATASETS_OFFLINE") is not None:
        return "HF_DATASETS_OFFLINE" if _flag("HF_DATASETS_OFFLINE") else None
    return next((name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _flag(name)), None)


def cache_dir(kind: str) -> tuple[Path, str]:
    """The cache `kind` is read from, resolved from the environment as huggingface_hub (model) and
    datasets (dataset) resolve it, and the variable that decided it."""
    names = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE") if kind == "model" else ("HF_DATASETS_CACHE",)
    for name in names:
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser(), name
    sub = "hub" if kind == "model" else "datasets"
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / sub, f"HF_HOME/{sub}"
    base = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface" / sub
    return base, "the default, no HF_HOME set"


def hub_items(cfg: RunConfig) -> list[HubItem]:
    """What a run of `cfg` reads from the hub: nothing for
    the embedded SmolLM2, model=tiny, a local model.path or task.path, and the procedural tasks."""
    items = []
    model, task = cfg.model, cfg.task
    path = model.path
    if model.source == "hub" and isinstance(path, str) and not os.path.isdir(os.path.expanduser(path)):
        items.append(HubItem("model", path, "model.path"))
    if task.name == "gsm8k" and getattr(task, "path", None) is None:
        items.append(HubItem("dataset", str(task.hub_id), "task.hub_id", str(task.hub_config)))
    return items


def _model_files(snapshot: Path) -> list[str]:
    """The files transformers loads a causal LM and its tokenizer from, in a snapshot."""
    tokenizer = next((name for name in TOKENIZER_FILES if (snapshot / name).exists()), TOKENIZER_FILES[0])
    index = snapshot / "model.safetensors.index.json"
    try:
        weights = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    except (OSError, ValueError, KeyError, AttributeError):
        weights = [f"{index.name} (unreadable)"]
    return ["config.json", "tokenizer_config.json", tokenizer, *(weights or ["model.safetensors"])]


def _lookup_model(item: HubItem) -> Lookup:
    from huggingface_hub import try_to_load_from_cache

    cache, how = cache_dir("model")
    try:
        found = try_to_load_from_cache(item.repo_id, "config.json", cache_dir=cache)
    except ValueError as error:  # huggingface_hub's HFValidationError: not a hub id
        return Lookup(item, cache, f"{item.key}={item.repo_id!r} is not a hub id ({error})")
    if not isinstance(found, str):
        return Lookup(item, cache, f"no snapshot of it in {cache} ({how})")
    snapshot = Path(found).parent
    absent = [name for name in _model_files(snapshot) if not (snapshot / name).exists()]
    return Lookup(item, snapshot, f"{snapshot} lacks {', '.join(absent)}" if absent else None)


def _prepared(directory: Path, config: str) -> bool:
    """A dataset directory `datasets` reloads offline: its info names the config, its Arrow files are there."""
    try:
        info = json.loads((directory / "dataset_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("config_name") == config and any(directory.glob("*.arrow"))


def _lookup_dataset(item: HubItem) -> Lookup:
    """Where `datasets` reloads a hub dataset from offline (its cached-module fallback):
    <cache>/<namespace>___<name in snake case>/<config>/<version>/<hash>/, the newest first."""
    from datasets.naming import camelcase_to_snakecase

    cache, how = cache_dir("dataset")
    parts = item.repo_id.split("/")
    base = cache / "___".join([*parts[:-1], camelcase_to_snakecase(parts[-1])]) / str(item.config)
    candidates = sorted((d for d in base.glob("*/*") if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
    found = next((d for d in candidates if _prepared(d, str(item.config))), None)
    if found is None:
        return Lookup(item, cache, f"no prepared copy of config {item.config} in {base} ({how})")
    return Lookup(item, found)


def lookup(item: HubItem) -> Lookup:  # the one lookup of `--check` and of a run's offline check
    return _lookup_model(item) if item.kind == "model" else _lookup_dataset(item)


def _word(key: str, value: Any) -> str:
    return shlex.quote(f"{key}={'null' if value is None else value}")


def _selecting_overrides(cfg: RunConfig) -> list[str]:
    """`cfg`'s model and task groups by name, with the keys naming hub items that differ from the file."""
    from omegaconf import OmegaConf

    words = []
    for group, keys in (("model", ("source", "path")), ("task", ("path", "hub_id", "hub_config"))):
        node = getattr(cfg, group)
        file = CONF / group / f"{node.name}.yaml"
        shipped = OmegaConf.to_container(OmegaConf.load(file)) if file.is_file() else {}
        if shipped:
            words.append(_word(group, node.name))
        words += [_word(f"{group}.{key}", getattr(node, key, None)) for key in keys
                  if key in shipped and shipped[key] != getattr(node, key, None)]
    return words


def fetch_command(cfg: RunConfig, overrides: Sequence[str] | None = None) -> str:
    """The fetch command for `cfg`: with `overrides`, else this Hydra job's (experiments/train.py), else
    overrides selecting its model and task."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    words = [shlex.quote(word) for word in overrides] if overrides is not None else _selecting_overrides(cfg)
    return " ".join([FETCH, *words])


def check_offline_cache(cfg: RunConfig, overrides: Sequence[str] | None = None) -> None:
    """At a run's start: with HF_HUB_OFFLINE=1 (HF_DATASETS_OFFLINE=1 for a dataset), every hub
    item the run reads must be in the local cache, else a ConfigError names each missing one,
    the cache looked in, and the fetch command. Without the offline variables, nothing is checked."""
    missing = [found for found in (lookup(item) for item in hub_items(cfg) if offline(item.kind)) if found.missing]
    if not missing:
        return
    variables = " and ".join(sorted({offline(found.item.kind) for found in missing}))
    what = "; ".join(f"{found.item} ({found.item.key}): {found.missing}" for found in missing)
    raise ConfigError(
        f"{variables} set (offline) but this run reads from the hub what the local cache lacks: {what}. "
        f"On a node with internet, with the same HF_HOME / HF_HUB_CACHE / HF_DATASETS_CACHE, run "
        f"`{fetch_command(cfg, overrides)}` (`--check` says what is there); or give local copies "
        "(model.path=/dir/of/model, task.path=/path/to/gsm8k)")


def _compose(overrides: Sequence[str]):
    """The config a run of these overrides composes, validated as the run's start validates it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from a3po.config import parse_config

    flags = [word for word in overrides if word.startswith("-")]
    if flags:
        raise ConfigError(f"{flags[0]} is not a flag of {FETCH}; its flag: --check (the other arguments are "
                          "Hydra overrides, key=value, as a run takes them)")
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return parse_config(compose(config_name="config", overrides=list(overrides)))
    except (HydraException, OmegaConfBaseException) as err:
        raise composition_error(err, overrides) from None


def _download(item: HubItem) -> None:
    if item.kind == "model":
        from huggingface_hub import snapshot_download

        snapshot_download(item.repo_id, allow_patterns=MODEL_PATTERNS, cache_dir=cache_dir("model")[0])
    else:
        import datasets

        datasets.load_dataset(item.repo_id, item.config, cache_dir=str(cache_dir("dataset")[0]))


def _report(found: Lookup, verb: str) -> str:
    if found.missing:
        return f"missing  {found.item} ({found.item.key}): {found.missing}"
    size = sum(file.stat().st_size for file in found.where.rglob("*") if file.is_file())  # links followed: blobs
    return f"{verb}  {found.item} ({found.item.key}) at {found.where} ({format_bytes(size)})"


def _check(items: list[HubItem], command: str) -> int:
    found = [lookup(item) for item in items]
    for entry in found:
        print(_report(entry, "present"))
    missing = [entry for entry in found if entry.missing]
    if missing:
        print(f"{len(missing)} of {len(found)} hub items missing; on a node with internet run: {command}")
        return EXIT_CONFIG_ERROR
    print("all there: a run of this config starts with HF_HUB_OFFLINE=1 on a node reading these caches")
    return 0


def _fetch(items: list[HubItem]) -> int:
    variables = sorted({offline(item.kind) for item in items} - {None})
    if variables:
        print(f"error: {' and '.join(variables)} set: nothing can be downloaded; fetch on a node with internet "
              "without it (--check says what the cache holds)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    failed = []
    for item in items:
        print(f"fetching {item} ({item.key}) ...", flush=True)
        try:
            _download(item)
        except Exception as error:  # the hub unreachable, a gated or unknown repo: say which item, go on
            print(f"error: could not fetch {item}: {type(error).__name__}: {error}", file=sys.stderr)
            failed.append(item)
            continue
        found = lookup(item)
        print(_report(found, "fetched"))
        failed += [item] if found.missing else []
    if failed:
        print(f"not fetched: {', '.join(map(str, failed))}", file=sys.stderr)
        return 1
    print("done: a run of this config now starts with HF_HUB_OFFLINE=1 on a node reading these caches")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=FETCH, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="download nothing; report what the cache holds "
                        "(exit 0 all there, 2 something missing)")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:  # a bad override or flag: exit 2, one line
        cfg = _compose(overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    items = hub_items(cfg)
    if not items:
        print(f"nothing to fetch: model.source={cfg.model.source} (model.path={cfg.model.path}) and "
              f"task={cfg.task.name} (task.path={getattr(cfg.task, 'path', None)}) read nothing from the hub")
        return
    for kind in sorted({item.kind for item in items}, reverse=True):
        print(f"{'hub' if kind == 'model' else 'datasets'} cache: {' ('.join(map(str, cache_dir(kind)))})")
    code = _check(items, fetch_command(cfg, overrides)) if args.check else _fetch(items)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
