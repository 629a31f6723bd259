"""The audit package keeps its shape: small modules named after the stages, and no import cycle through it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvforensics

PACKAGE = Path(kvforensics.__file__).parent
AUDIT = PACKAGE / "audit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Every kvforensics module *path* imports, at the top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(files)) for name, path in files.items()}


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return False


def test_no_import_cycle_runs_through_the_audit_package() -> None:
    graph = import_graph()
    audit = sorted(m for m in graph if m == "kvforensics.audit" or m.startswith("kvforensics.audit."))
    assert len(audit) >= 10  # the package, its stages and one module per check
    assert [m for m in audit if reaches(graph, m, m)] == []


def test_the_import_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    # kvforensics.report.render imports the audit inside a function; the graph must see it
    assert "kvforensics.audit" in graph["kvforensics.report.render"]
    assert "kvforensics.audit.checks.common" in graph["kvforensics.audit.checks.pool_vs_context"]


def test_every_audit_module_stays_small_and_says_what_it_holds() -> None:
    for path in sorted(AUDIT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 600, f"{path.name} has grown past 600 lines: split it by stage"
        assert ast.get_docstring(ast.parse(text)), f"{path.name} has no module docstring"


def test_one_module_per_check() -> None:
    from kvforensics.audit import CHECKS

    checks = sorted(p.stem for p in (AUDIT / "checks").glob("*.py") if p.stem not in ("__init__", "common"))
    assert len(checks) == len(CHECKS) == 6
