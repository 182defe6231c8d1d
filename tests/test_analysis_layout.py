"""analysis/ is shaped by role (issue "A codebase a newcomer can carry on"): a small core, the
paper's figures (figures/), the claims rule (claims/), the anchor's models (anchor/) and one
module per study (studies/). Studies never import each other, nothing imports in a cycle, no
module shares a name with one in a3po/ (and a3po has no import cycle either), and a study has one
name across its experiment file, its pre-registration and its report."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

ANALYSIS = REPO / "analysis"
STUDIES = sorted(p.stem for p in (ANALYSIS / "studies").glob("*.py") if p.stem != "__init__")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def analysis_imports(package: str = "analysis") -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, at module level or inside a function."""
    modules = {_module(p): p for p in (REPO / package).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith(package)}
        edges[name] = {t for t in targets if t in modules and t != name}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules on it, or [] where there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_analysis_has_no_import_cycle():
    assert _cycle(analysis_imports()) == []


def test_a3po_has_no_import_cycle():
    # lazy imports count too: a cycle through a function's import is still a cycle to a reader
    assert _cycle(analysis_imports("a3po")) == []


def test_studies_never_import_each_other():
    crossing = sorted(f"{source} -> {target}" for source, targets in analysis_imports().items()
                      for target in targets
                      if source.startswith("analysis.studies.") and target.startswith("analysis.studies."))
    assert crossing == []


def test_no_module_shares_a_name_with_one_in_a3po():
    # a study is named after what it studies (S4: corrections), one name from its experiment
    # file to its report, so studies/ alone may repeat an a3po module's name; every other
    # analysis module has a name of its own
    stems = lambda paths: {p.stem for p in paths} - {"__init__", "__main__"}  # noqa: E731
    outside_studies = [p for p in ANALYSIS.rglob("*.py") if p.parent.name != "studies"]
    assert sorted(stems(outside_studies) & stems((REPO / "a3po").rglob("*.py"))) == []


def test_a_study_has_one_name_across_experiment_preregistration_and_module():
    preregistered = sorted(p.stem for p in (REPO / "docs" / "studies").glob("*.md"))
    assert preregistered, "no pre-registration under docs/studies/"
    # a study whose grid a registered pilot decides (S8) has only its pilot's experiment file until then
    experiment = lambda name: any((REPO / "conf" / "experiment" / f"{name}{tail}.yaml").exists()  # noqa: E731
                                  for tail in ("", "_pilot"))
    for name in preregistered:
        assert experiment(name), f"{name}: no conf/experiment/{name}.yaml (nor {name}_pilot.yaml)"
        # the claims study's analysis is the claims report itself (python -m analysis.report)
        assert name == "claims" or name in STUDIES, f"{name}: no analysis/studies/{name}.py"
    for name in STUDIES:
        assert experiment(name), f"{name}: no conf/experiment/{name}.yaml (nor {name}_pilot.yaml)"


def test_one_place_asks_git_for_the_commit_a_report_names():
    asking = sorted(str(p.relative_to(REPO)) for p in ANALYSIS.rglob("*.py") if "rev-parse" in p.read_text())
    assert asking == ["analysis/provenance.py"]


def test_every_hypothesis_a_report_decides_is_registered_on_its_page():
    from analysis.hypotheses import HYPOTHESES, titled

    for label, hypothesis in HYPOTHESES.items():
        assert label in (REPO / "docs" / "studies" / hypothesis.page).read_text(), f"{label} not on {hypothesis.page}"
    assert titled("H-S3c") == "H-S3c (step_start clips no more than recompute at every m)"


def test_every_declared_study_has_its_module_and_its_tests_on_its_page():
    from analysis.hypotheses import STUDIES as DECLARED

    for name, tests in DECLARED.items():
        assert name in STUDIES, f"{name}: declared in analysis/hypotheses.py, no analysis/studies/{name}.py"
        page = (REPO / "docs" / "studies" / f"{name}.md").read_text()
        assert [t.label for t in tests if t.label not in page] == [], f"{name}: a label not on its page"


def test_no_report_spells_a_hypothesis_out_itself():
    import re

    from analysis.hypotheses import HYPOTHESES

    spelled = sorted(f"{p.relative_to(REPO)}: {label}" for p in ANALYSIS.rglob("*.py") if p.name != "hypotheses.py"
                     for label, h in HYPOTHESES.items() if re.search(re.escape(h.text), p.read_text()))
    assert spelled == []


def _role(module: str) -> str:
    """analysis.claims.rule -> claims; analysis.load -> core; analysis.report (the claims
    report of any sweep, S1's among them) -> report."""
    if module == "analysis.report":
        return "report"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (ANALYSIS / parts[-1]).is_dir() else "core"


def roles_table() -> str:
    """The roles of analysis/ and which roles each imports: the table docs/design.md draws."""
    edges: dict[str, set[str]] = {}
    for source, targets in analysis_imports().items():
        edges.setdefault(_role(source), set()).update(_role(t) for t in targets if _role(t) != _role(source))
    rows = [f"| `{role}` | {', '.join(sorted(targets)) or '-'} |" for role, targets in sorted(edges.items())]
    return "\n".join(["| role | imports |", "|---|---|", *rows])


def test_design_doc_draws_the_roles_the_analysis_has():
    assert roles_table() in (REPO / "docs" / "design.md").read_text()


def test_the_core_imports_no_role_above_it():
    edges = analysis_imports()
    assert sorted(f"{s} -> {t}" for s, ts in edges.items() for t in ts if _role(s) == "core" and _role(t) != "core") == []
