"""The README stays a front door and docs/README.md indexes every page (issue "A codebase a
newcomer can carry on"): each docs page is linked from the index, every relative link in the
README and the docs pages resolves, and the README is at most 250 lines."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)")


def _links(page: Path) -> set[Path]:
    return {(page.parent / target).resolve() for target in LINK.findall(page.read_text())
            if not target.startswith(("http://", "https://"))}


def test_the_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_every_docs_page_is_indexed():
    linked = _links(REPO / "docs" / "README.md")
    pages = {p.resolve() for p in (REPO / "docs").rglob("*.md") if p != REPO / "docs" / "README.md"}
    assert not sorted(p.name for p in pages - linked)


def test_every_relative_link_resolves():
    """In the README and every docs page (a link in docs/maths.md once pointed at docs/docs/)."""
    for page in (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))):
        missing = sorted(str(p) for p in _links(page) if not p.exists())
        assert not missing, f"{page.name}: {missing}"
