"""GSM8K grade-school maths, from the hub (`openai/gsm8k`, config `main`) or a local copy.

A local copy is either a directory holding train and test files (the hub's own layout, e.g.
`main/train-00000-of-00001.parquet`) or a single jsonl/parquet file, which is split into
train and held-out problems by a stable hash of the question, as arith does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from a3po.errors import ConfigError
from a3po.tasks.base import Problem, RewardResult
from a3po.tasks.reward import ANSWER_MARKER, numeric_reward
from a3po.tasks.splits import DEFAULT_HELD_OUT_FRACTION, in_eval_order, is_held_out, step_rng

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
DEFAULT_HUB_ID = "openai/gsm8k"
DEFAULT_HUB_CONFIG = "main"


def gold_answer(solution: str) -> str:
    """GSM8K's canonical answer: the text after `####`, thousands separators removed."""
    if ANSWER_MARKER not in solution:
        raise ValueError(
            f"GSM8K solution has no '{ANSWER_MARKER}' final answer: {solution[-80:]!r}"
        )
    final = solution.rsplit(ANSWER_MARKER, 1)[1].strip()
    return re.sub(r"(?<=\d),(?=\d{3})", "", final)


# What one record must hold; `_to_problem` checks each, and every error quotes this.
RECORD_FIELDS = ("question", "answer")
RECORD_FORMAT = (
    "one JSON object a line with string fields question and answer, the answer a worked solution "
    f"ending in '{ANSWER_MARKER} <final answer>' (a .json file may instead hold one JSON list of such "
    "objects; a .parquet file, columns question and answer)"
)


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in words, for an error about a record of the wrong type."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _read_records(path: Path) -> list[tuple[str, Any]]:
    """The records of a local data file, each with where it is in the file (`line 7`,
    `record 3`, `row 3`), so that a bad record is reported at its place. A file that cannot
    be read as that format is a ConfigError naming it, the place and what was expected,
    instead of a parser's traceback."""
    if path.suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(path, columns=list(RECORD_FIELDS))
        except (OSError, ValueError, KeyError) as error:  # pyarrow's errors derive from these
            reason = " ".join(str(error).split())[:300]
            raise ConfigError(f"task.path file {path} cannot be read as parquet ({type(error).__name__}: {reason}); "
                              f"expected {RECORD_FORMAT}") from None
        return [(f"row {index}", record) for index, record in enumerate(frame.to_dict("records"))]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"task.path file {path} is not UTF-8 text (byte {error.start}); expected {RECORD_FORMAT}") \
            from None
    except OSError as error:
        raise ConfigError(f"task.path file {path} cannot be read ({type(error).__name__}: {error.strerror})") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"task.path file {path}, line {error.lineno} is not valid JSON ({error.msg} at column "
                              f"{error.colno}); expected {RECORD_FORMAT}") from None
        return [(f"record {index}", record) for index, record in enumerate(records)]
    records = []
    # split on "\n" only: str.splitlines would also split inside a JSON string holding U+2028
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            raise ConfigError(f"task.path file {path}, line {number} is not valid JSON ({error.msg} at column "
                              f"{error.colno}); expected {RECORD_FORMAT}") from None
    return records


def _to_problem(record: Any, source: str, where: str) -> Problem:
    """One record as a Problem, or a ConfigError naming the source, the record's place and
    what is wrong with it."""
    if not isinstance(record, dict):
        raise ConfigError(f"{source}, {where} is {_json_kind(record)}, not an object; expected {RECORD_FORMAT}")
    missing = [name for name in RECORD_FIELDS if name not in record]
    if missing:
        raise ConfigError(f"{source}, {where} has no field {' or '.join(missing)} (its fields: "
                          f"{', '.join(map(str, record)) or 'none'}); expected {RECORD_FORMAT}")
    for name in RECORD_FIELDS:
        if not isinstance(record[name], str):
            raise ConfigError(f"{source}, {where}: field {name} is {_json_kind(record[name])}, not a string; "
                              f"expected {RECORD_FORMAT}")
    try:
        answer = gold_answer(record["answer"])
    except ValueError as error:
        raise ConfigError(f"{source}, {where}: {error}; expected {RECORD_FORMAT}") from None
    return Problem(question=record["question"], answer=answer)


def _to_problems(records: Iterable[tuple[str, Any]], source: str) -> list[Problem]:
    return [_to_problem(record, source, where) for where, record in records]


def _numbered(records: Iterable[Any]) -> list[tuple[str, Any]]:
    """Records without a place in a file (the hub's) are named by their index."""
    return [(f"record {index}", record) for index, record in enumerate(records)]


def _find_split_file(directory: Path, split: str) -> Path | None:
    matches = sorted(
        p for p in directory.rglob(f"*{split}*") if p.is_file() and p.suffix in DATA_SUFFIXES
    )
    return matches[0] if matches else None


LOCAL_FORMAT = (
    "one JSON object a line with fields question and answer (the worked solution, ending in "
    f"'{ANSWER_MARKER} <final answer>'), or a directory with train and test jsonl/parquet files "
    "in that format"
)


def _hub_unreachable_errors() -> tuple[type[BaseException], ...]:
    """What loading from the hub raises when the hub cannot be reached (no network, offline
    mode, not cached) or does not serve the dataset: nothing else is turned into a config error."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

        errors += [LocalEntryNotFoundError, OfflineModeIsEnabled]
    except ImportError:  # pragma: no cover - depends on the installed huggingface_hub
        pass
    try:
        from datasets.exceptions import DatasetNotFoundError

        errors.append(DatasetNotFoundError)
    except ImportError:  # pragma: no cover - depends on the installed datasets
        pass
    try:
        import requests

        errors.append(requests.exceptions.RequestException)
    except ImportError:  # pragma: no cover
        pass
    try:
        import httpx

        errors.append(httpx.TransportError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


def _load_from_hub(hub_id: str, hub_config: str):
    """`datasets.load_dataset`, with an unreachable hub reported as a config error that says
    how to give a local copy instead of a traceback from deep inside `datasets`."""
    import datasets

    try:
        return datasets.load_dataset(hub_id, hub_config)
    except _hub_unreachable_errors() as error:
        offline = [name for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
                   if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
        reason = f"{type(error).__name__}: {error}" + (f"; {' and '.join(offline)} set" if offline else "")
        raise ConfigError(
            f"task=gsm8k could not load {hub_id} (config {hub_config}) from the hub ({reason}); "
            f"set task.path=/path/to/gsm8k.jsonl, {LOCAL_FORMAT}"
        ) from error


def load_gsm8k(
    path: str | None,
    hub_id: str = DEFAULT_HUB_ID,
    hub_config: str = DEFAULT_HUB_CONFIG,
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION,
) -> tuple[list[Problem], list[Problem]]:
    """Return (train, held_out) problem lists."""
    if path is None:
        dataset = _load_from_hub(hub_id, hub_config)
        return (
            _to_problems(_numbered(dataset["train"]), f"{hub_id}:train"),
            _to_problems(_numbered(dataset["test"]), f"{hub_id}:test"),
        )
    location = Path(path).expanduser()
    if location.is_dir():
        train_file = _find_split_file(location, "train")
        test_file = _find_split_file(location, "test")
        if train_file is None or test_file is None:
            raise ConfigError(
                f"task.path={path!r}: a directory must hold a train and a test file "
                f"({', '.join(DATA_SUFFIXES)}); found train={train_file}, test={test_file}"
            )
        return (
            _to_problems(_read_records(train_file), f"task.path file {train_file}"),
            _to_problems(_read_records(test_file), f"task.path file {test_file}"),
        )
    problems = _to_problems(_read_records(location), f"task.path file {location}")
    train = [p for p in problems if not is_held_out(p.question, held_out_fraction)]
    held_out = [p for p in problems if is_held_out(p.question, held_out_fraction)]
    return train, held_out


@dataclass
class GSM8KTask:
    seed: int
    path: str | None = None
    hub_id: str = DEFAULT_HUB_ID
    hub_config: str = DEFAULT_HUB_CONFIG
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION
    train: list[Problem] = field(init=False, repr=False)
    held_out: list[Problem] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.train, held_out = load_gsm8k(self.path, self.hub_id, self.hub_config, self.held_out_fraction)
        self.held_out = in_eval_order(held_out)
        if not self.train or not self.held_out:
            raise ConfigError(
                f"task.path={self.path!r} gives {len(self.train)} training and "
                f"{len(self.held_out)} held-out problems; both must be non-empty"
            )

    def train_batch(self, step: int, n_prompts: int) -> list[Problem]:
        """Epochs over the training set, each in its own seeded order, indexed by step.

        Position `step * n_prompts + j` of the infinite sequence of epochs is computed
        directly, so every problem is seen once per epoch and a resumed run continues exactly.
        """
        size = len(self.train)
        batch = []
        for position in range(step * n_prompts, (step + 1) * n_prompts):
            epoch, offset = divmod(position, size)
            order = self._epoch_order(epoch)
            batch.append(self.train[int(order[offset])])
        return batch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        cached = getattr(self, "_cached_order", None)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = step_rng(self.seed, epoch, len(self.train)).permutation(len(self.train))
        self._cached_order = (epoch, order)
        return order

    def eval_problems(self, n: int) -> list[Problem]:
        """The first `n` of the held-out split in its fixed shuffled order, the same for every seed."""
        return self.held_out[:n]

    def reward(self, completion: str, answer: str) -> RewardResult:
        return numeric_reward(completion, answer)


def local_path_missing(path: str | None) -> bool:
    return path is not None and not os.path.exists(os.path.expanduser(path))
