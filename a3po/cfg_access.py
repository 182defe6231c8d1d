"""`cfg_get`: one config key from an OmegaConf DictConfig or a plain dict; `plain`: a config
node as plain Python. Neither imports OmegaConf at module level.

Validation runs on both: the composed Hydra config in a run, plain dicts in tests and CLIs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["cfg_get", "plain"]


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """`cfg[key]` for a mapping (DictConfig is one), else the attribute; `default` when absent."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def plain(node: Any) -> Any:
    """An OmegaConf node as plain, resolved Python (dicts and lists); anything else as is."""
    from omegaconf import Container, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, Container) else node
