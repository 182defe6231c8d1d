"""`cfg_get`: one config key from an OmegaConf DictConfig or a plain dict, without importing OmegaConf.

Validation runs on both: the composed Hydra config in a run, plain dicts in tests and CLIs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["cfg_get"]


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """`cfg[key]` for a mapping (DictConfig is one), else the attribute; `default` when absent."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)
