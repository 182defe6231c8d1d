"""Print one optional-dependency group of pyproject.toml, one requirement a line, so the
Makefile installs an extra's pins without installing the project (`make setup-rliable`):

    python analysis/checks/extra_requirements.py rliable
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def extra_requirements(extra: str, pyproject: Path = PYPROJECT) -> list[str]:
    """The requirements of `extra` in `pyproject`'s [project.optional-dependencies]."""
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    if extra not in extras:
        raise SystemExit(f"{pyproject}: no optional-dependency group {extra!r}; it has: {', '.join(sorted(extras))}")
    return list(extras[extra])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: extra_requirements.py EXTRA")
    print("\n".join(extra_requirements(sys.argv[1])))
