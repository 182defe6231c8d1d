"""The one place a `device=` config value becomes a torch device."""

from __future__ import annotations

import torch

from a3po.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, key: str = "device") -> torch.device:
    """`auto` -> cuda when visible, else cpu; `cuda`/`cuda:<k>` must name a visible GPU.
    Anything else is a ConfigError naming `key` (the config key the value came from)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return torch.device("cuda" if visible else "cpu")
    if name not in DEVICES and not str(name).startswith("cuda:"):
        raise ConfigError(f"{key}={name!r} is not allowed; allowed: {list(DEVICES)} or cuda:<index>")
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= visible:
        allowed = f"cuda, cuda:0..cuda:{visible - 1}, auto or cpu" if visible else "auto or cpu (no CUDA device is visible)"
        raise ConfigError(f"{key}={name!r} is not allowed on this machine; allowed: {allowed}")
    return device


def autocast_dtype(device: torch.device, model: torch.nn.Module) -> torch.dtype | None:
    """bf16 for a float32 model on a GPU (the standard mixed precision: float32 master
    weights, bf16 matmuls), else None (no autocast; CPU runs keep exact float32). The trainer
    and the HF engine both follow this, so behaviour and current log-probs match at d = 0."""
    first = next(model.parameters(), None)
    if torch.device(device).type == "cuda" and first is not None and first.dtype == torch.float32:
        return torch.bfloat16
    return None
