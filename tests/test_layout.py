"""The layout keeps its shape: no module over 300 lines, no function over 50, and the package
dependencies docs/design.md draws are the ones the code has."""

from __future__ import annotations

import ast
import re

from conftest import REPO

SOURCES = sorted([*REPO.glob("a3po/**/*.py"), *REPO.glob("analysis/**/*.py")])


def _package(module: str) -> str:
    """a3po.maths.proximal -> maths; a3po.config -> config."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_edges() -> dict[str, tuple[set[str], set[str]]]:
    """Package -> (packages it imports at module level, packages it imports only inside a function)."""
    edges: dict[str, tuple[set[str], set[str]]] = {}
    for path in REPO.glob("a3po/**/*.py"):
        source = _package(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"))
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            for target in map(_package, _a3po_modules(node)):
                if target != source:
                    module_level, lazy = edges.setdefault(source, (set(), set()))
                    (module_level if id(node) in top_level else lazy).add(target)
    return edges


def _a3po_modules(node: ast.AST) -> list[str]:
    """The a3po modules an import statement names: `from a3po.x import y` and `import a3po.x`."""
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.module and node.module.startswith("a3po.") else []
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith("a3po.")]
    return []


def edges_table() -> str:
    rows = [f"| `{source}` | {', '.join(sorted(module_level)) or '-'} | {', '.join(sorted(lazy - module_level)) or '-'} |"
            for source, (module_level, lazy) in sorted(package_edges().items())]
    return "\n".join(["| package | imports (module level) | lazy (inside a function) |", "|---|---|---|", *rows])


def test_no_module_over_300_lines():
    long = {str(p.relative_to(REPO)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 300}
    assert not long


def test_no_function_over_50_lines():
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not long


def test_design_doc_draws_the_package_dependencies_the_code_has():
    assert edges_table() in (REPO / "docs" / "design.md").read_text()


def test_the_lifecycle_is_on_top_and_the_maths_at_the_bottom():
    edges = package_edges()
    importers_of_run = sorted(source for source, (module_level, _) in edges.items() if "run" in module_level)
    assert importers_of_run == []  # nothing below the run's lifecycle imports it at module level
    maths = edges.get("maths", (set(), set()))
    assert maths[0] <= {"errors"} and not maths[1]  # pure functions: nothing outside the maths


def test_analysis_never_parses_a_run_name():
    code = "\n".join(path.read_text() for path in REPO.glob("analysis/**/*.py"))
    assert not re.search(r"run_name\.split|name\.split\(\"-\"\)|-d\(\?P<d>", code)
