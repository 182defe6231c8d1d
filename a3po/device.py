"""The one place a `device=` config value becomes a torch device."""

from __future__ import annotations

import torch

from a3po.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when visible, else cpu; `cuda` without a visible GPU is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' is not allowed on this machine: no CUDA device is visible; use device=auto or cpu")
    if name not in DEVICES and not name.startswith("cuda:"):
        raise ConfigError(f"device={name!r} is not allowed; allowed: {list(DEVICES)} or cuda:<index>")
    return torch.device(name)


def autocast_dtype(device: torch.device, model: torch.nn.Module) -> torch.dtype | None:
    """bf16 for a float32 model on a GPU (the standard mixed precision: float32 master
    weights, bf16 matmuls), else None (no autocast; CPU runs keep exact float32). The trainer
    and the HF engine both follow this, so behaviour and current log-probs match at d = 0."""
    first = next(model.parameters(), None)
    if torch.device(device).type == "cuda" and first is not None and first.dtype == torch.float32:
        return torch.bfloat16
    return None
