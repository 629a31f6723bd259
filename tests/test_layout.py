"""The house keeps a shape a newcomer can find their way in.

* No import cycle anywhere in ``kvforensics``: every ``import`` counts, at the top of a module,
  inside a function or under ``TYPE_CHECKING`` (shared types go down a floor instead).
* No module outside ``simulate/`` grows past 600 lines unless its docstring has a line starting
  ``Size:`` that says why it stays whole.
* ``docs/architecture.md`` names every package and module of ``kvforensics`` (``simulate/`` as one
  package), and every module it names exists.
* No folder of ``kvforensics`` (``simulate/`` included) holds more than 15 modules directly: a group of
  modules that share a prefix is a folder that was never made.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import kvforensics

PACKAGE = Path(kvforensics.__file__).parent
ROOT = PACKAGE.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 600
MAX_MODULES_PER_FOLDER = 15


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, source: str, known: set[str], *, is_package: bool = False) -> dict[str, int]:
    """The modules of ``known`` that module ``name`` (its text ``source``) imports anywhere in it, each
    with the line of its first import."""
    package = name if is_package else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(module: str, line: int) -> None:
        if module in known and module != name:
            found.setdefault(module, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    files = modules()
    return {
        name: imported(name, path.read_text(encoding="utf-8"), set(files), is_package=path.name == "__init__.py")
        for name, path in files.items()
    }


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of two or more modules that import each other, directly or through others (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def one_cycle(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    """A shortest import cycle through the group's first module, as ``a (line n) -> b ... -> a``."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = paths[v] + [start]
                return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(path)) + f" -> {start}"
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(f"no cycle through {start}")


def test_the_import_graph_sees_every_kind_of_import() -> None:
    known = {
        "kvforensics",
        "kvforensics.a",
        "kvforensics.b",
        "kvforensics.sub",
        "kvforensics.sub.c",
        "kvforensics.sub.d",
    }
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvforensics.b import B\n"
    assert imported("kvforensics.a", typing_only, known) == {"kvforensics.b": 3}
    in_function = "import json\n\ndef f():\n    from kvforensics.sub import c\n"
    assert imported("kvforensics.b", in_function, known) == {"kvforensics.sub.c": 4}
    relative = "from .. import a\nfrom . import d\nimport kvforensics.sub.d\nfrom .d import name\n"
    assert imported("kvforensics.sub.c", relative, known) == {"kvforensics.a": 1, "kvforensics.sub.d": 2}
    assert imported("kvforensics.sub", "from .c import x\nfrom ..b import f\n", known, is_package=True) == {
        "kvforensics.sub.c": 1,
        "kvforensics.b": 2,
    }
    graph = {
        "kvforensics.a": {"kvforensics.b": 3},
        "kvforensics.b": {"kvforensics.sub.c": 4},
        "kvforensics.sub.c": {"kvforensics.a": 1, "kvforensics.sub.d": 2},
        "kvforensics.sub.d": {},
    }
    (group,) = strongly_connected(graph)
    assert group == ["kvforensics.a", "kvforensics.b", "kvforensics.sub.c"]
    assert one_cycle(graph, group) == (
        "kvforensics.a (line 3) -> kvforensics.b (line 4) -> kvforensics.sub.c (line 1) -> kvforensics.a"
    )


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "kvforensics.sources.common.load_report" in graph["kvforensics.stages.ingest"]
    cycles = [one_cycle(graph, group) for group in strongly_connected(graph)]
    assert not cycles, "import cycles (move what both sides need down into a module of its own):\n" + "\n".join(cycles)


def size_reason(source: str) -> str | None:
    """The line of the module docstring that starts with ``Size:``, if there is one."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    return next((line for line in doc.splitlines() if line.strip().startswith("Size:")), None)


def test_size_reason_is_read_from_the_docstring_only() -> None:
    assert (
        size_reason('"""Readers.\n\nSize: one state machine, clearer whole.\n"""\nx = 1\n')
        == "Size: one state machine, clearer whole."
    )
    assert size_reason('"""Readers."""\n# Size: a comment does not count\n') is None
    assert size_reason("x = 'Size: nor does a string'\n") is None


def test_no_module_outside_the_simulator_above_600_lines_without_a_reason() -> None:
    problems = []
    for name, path in modules().items():
        source = path.read_text(encoding="utf-8")
        lines = len(source.splitlines())
        if not name.startswith("kvforensics.simulate") and lines > MAX_LINES and size_reason(source) is None:
            problems.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not problems, (
        f"modules above {MAX_LINES} lines (split them where that makes them easier to follow, "
        "or say why not in a docstring line starting 'Size:'):\n" + "\n".join(problems)
    )


PATH_TOKEN = re.compile(r"`([A-Za-z0-9_./-]+(?:\.py|/))`")
BULLET = re.compile(r"^(\s*)[*-] ")


def named_paths(markdown: str) -> Iterator[tuple[str, list[str]]]:
    """Each file or folder a Markdown text names in backticks (``x.py``, ``dir/``), with the folders
    it may be relative to: those that open the bullets it stands in, innermost first (a nested bullet
    of ``kvforensics/sources/`` names ``requests.py``). Fenced code is skipped."""
    open_bullets: list[tuple[int, str | None]] = []  # (indent, the folder the bullet opens with)
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        bullet = BULLET.match(line)
        if bullet or not line.strip() or not line.startswith(" "):
            indent = len(bullet.group(1)) if bullet else -1
            open_bullets = [b for b in open_bullets if b[0] < indent]
        tokens = PATH_TOKEN.findall(line)
        if bullet:
            first = tokens[0] if tokens and line.index(f"`{tokens[0]}`") == bullet.end() else None
            open_bullets.append((len(bullet.group(1)), first if first and first.endswith("/") else None))
        bases = [d for _, d in reversed(open_bullets) if d]
        for token in tokens:
            yield token, [b for b in bases if b != token]


def resolve(token: str, bases: list[str]) -> list[Path]:
    """Where a named path may be: under the folders of its bullets, the repository, or the package."""
    tops = [*(ROOT / b for b in bases), ROOT, PACKAGE]
    return [(top / token).resolve() for top in tops]


def test_named_paths_follow_the_bullets() -> None:
    text = (
        "* `kvforensics/sources/` one module per format.\n  * `requests.py` gateway logs; see `textio.py`.\n"
        "  * `sglang.py`, `vllm.py` engine logs\n* `kvforensics/config/__init__.py` the incident file\n"
        "```\nnot/`named.py`\n```\nThe `tests/test_x.py` file.\n"
    )
    assert list(named_paths(text)) == [
        ("kvforensics/sources/", []),
        ("requests.py", ["kvforensics/sources/"]),
        ("textio.py", ["kvforensics/sources/"]),
        ("sglang.py", ["kvforensics/sources/"]),
        ("vllm.py", ["kvforensics/sources/"]),
        ("kvforensics/config/__init__.py", []),
        ("tests/test_x.py", []),
    ]


def test_architecture_doc_names_every_module_and_only_modules_that_exist() -> None:
    named: set[Path] = set()
    missing = []
    for token, bases in named_paths(ARCHITECTURE.read_text(encoding="utf-8")):
        places = [p for p in resolve(token, bases) if p.exists()]
        if not places:
            missing.append(token)
        named.update(places)
    expected = set()
    for name, path in modules().items():
        if name.startswith("kvforensics.simulate."):
            continue
        expected.add(path.parent.resolve() if path.name == "__init__.py" else path.resolve())
    expected.discard(PACKAGE.resolve())
    expected.discard((PACKAGE / "__main__.py").resolve())
    unnamed = sorted(str(p.relative_to(ROOT)) for p in expected - named)
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"


def crowded_folders(package: Path, limit: int = MAX_MODULES_PER_FOLDER) -> list[str]:
    """The folders under *package* (itself included) holding more than *limit* ``*.py`` files directly
    (``__init__.py`` counts), each as ``path: count``."""
    found = []
    for folder in sorted({package, *(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")}):
        count = len(list(folder.glob("*.py")))
        if count > limit:
            found.append(f"{folder.relative_to(package.parent)}: {count}")
    return found


def test_crowded_folders_counts_modules_directly_inside(tmp_path) -> None:
    package = tmp_path / "pkg"
    (package / "sub" / "deeper").mkdir(parents=True)
    for i in range(3):
        (package / f"m{i}.py").write_text("")
        (package / "sub" / f"s{i}.py").write_text("")
    (package / "sub" / "data.toml").write_text("")
    (package / "sub" / "deeper" / "d.py").write_text("")
    assert crowded_folders(package, limit=2) == ["pkg: 3", "pkg/sub: 3"]
    assert crowded_folders(package, limit=3) == []


def test_no_folder_holds_more_than_15_modules() -> None:
    crowded = crowded_folders(PACKAGE)
    assert not crowded, (
        f"folders with more than {MAX_MODULES_PER_FOLDER} modules (group them into sub-folders by "
        "what they read or do, and name each in docs/architecture.md):\n" + "\n".join(crowded)
    )
