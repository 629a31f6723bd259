"""The user docs match the tool: README.md and docs/incident-config.md are checked against the code.

Every TOML example is an incident file (or part of one) the config loader accepts, unless its fence says
``toml fragment`` or ``toml manifest``; every ``kvforensics <command> --option`` they show exists in the
CLI's ``--help``; every repository path they name exists; the outputs tables list exactly the files a run
writes, and a run of the sample writes them; the rule, preset and source-key tables list what the package
ships and accepts; the README's Python example runs. docs/architecture.md: every import of the package goes
to its own floor or below in the doc's floors table.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import re
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from kvforensics.cli import build_parser
from kvforensics.config import Source, load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.evidence.verify import EVIDENCE, HASHED_OUTPUTS, MANIFEST, SIGNATURE
from kvforensics.report.pdf import find_chromium
from kvforensics.sources.requests.load import load_requests_file

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = ("README.md", "docs/incident-config.md")
ALL_DOCS = (*USER_DOCS, "docs/architecture.md")
# A fenced block, also indented inside a list item: (indent, info string, body).
FENCE = re.compile(r"^( *)```([^\n`]*)\n(.*?)^\1```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
SHELL_INFOS = ("", "sh", "bash", "shell", "console")
# Paths inside the repository start with one of its top-level folders; example paths of an incident
# (gateway/*.jsonl, engine/*.log) and outputs (reports/, out/) do not.
REPO_PATH = re.compile(r"(?<![\w./-])((?:kvforensics|docs|tests|benchmarks|notebooks|data|\.ci)/[\w.*<>{},/-]*)")
BASE_INCIDENT = """\
[incident]
id = "docs-example"
title = "An example of the docs"

[[sources]]
name = "docs-base-gateway"
kind = "requests"
path = "docs-base/*.jsonl"
"""


def read(doc: str) -> str:
    return (ROOT / doc).read_text(encoding="utf-8")


def fences(doc: str) -> list[tuple[str, str, int]]:
    """(info string, body, line of the opening fence) of every fenced block of a doc."""
    text = read(doc)
    return [(m[2].strip(), m[3], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def prose(doc: str) -> str:
    """The doc without its fenced blocks."""
    return FENCE.sub("", read(doc))


def code_texts(doc: str) -> list[str]:
    """Every line of the doc's shell blocks and every inline code span of its prose."""
    lines = [line for info, body, _ in fences(doc) if info in SHELL_INFOS for line in body.splitlines()]
    return lines + INLINE.findall(prose(doc))


def section(doc: str, heading: str) -> str:
    """The text under the first heading that starts with ``heading``, up to the next heading of its level."""
    text = read(doc)
    m = re.search(rf"^(#+) {re.escape(heading)}.*$", text, re.M)
    assert m, f"{doc} has no heading starting with {heading!r}"
    end = re.compile(rf"^#{{1,{len(m[1])}}} ", re.M).search(text, m.end())
    return text[m.end() : end.start() if end else len(text)]


def table_column(text: str, header: str) -> list[str]:
    """The first cells of the first Markdown table in ``text`` whose first header cell is ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and line.split("|")[1].strip() == header)
    cells = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells.append(line.split("|")[1].strip())
    return cells


def names_in(cells: list[str]) -> set[str]:
    return {name for cell in cells for name in INLINE.findall(cell)}


# --- incident-file examples --------------------------------------------------------------------------------

# ```toml blocks are incident files, whole or in part; these words after `toml` mark the others (parsed only)
NOT_INCIDENT_FILES = {
    "fragment": "part of an incident file that does not load alone",
    "manifest": "a deployment manifest (kvforensics audit --manifest)",
}
TOML_BLOCKS = [
    pytest.param(doc, info, body, id=f"{doc}:{line}")
    for doc in USER_DOCS
    for info, body, line in fences(doc)
    if info.split()[:1] == ["toml"]
]


@pytest.mark.parametrize(("doc", "info", "body"), TOML_BLOCKS)
def test_toml_example_is_an_incident_file_the_loader_accepts(doc, info, body, tmp_path):
    data = tomllib.loads(body)  # every block is TOML, fragments and manifests too
    if set(info.split()[1:]) & set(NOT_INCIDENT_FILES):
        return
    # a partial example (a source, [instances], [settings] ...) is completed by a minimal incident file
    text = body if "incident" in data else BASE_INCIDENT + "\n" + body
    (tmp_path / "incident.toml").write_text(text, encoding="utf-8")
    try:
        incident = load_incident(tmp_path / "incident.toml")
    except ConfigError as e:
        pytest.fail(
            f"{doc}: a TOML example the config loader refuses (mark it ```toml fragment if it is part "
            f"of an incident file not meant to load alone, ```toml manifest if it is a deployment "
            f"manifest): {e}"
        )
    names = [s["name"] for s in data.get("sources", [])]
    assert [s.name for s in incident.sources if s.name in names] == names


def test_there_are_incident_examples_to_check():
    incident_files = [p for p in TOML_BLOCKS if not set(p.values[1].split()[1:]) & set(NOT_INCIDENT_FILES)]
    assert len(incident_files) >= 8
    assert len(incident_files) >= 3 * (len(TOML_BLOCKS) - len(incident_files)) / 2, "most examples should load"


# --- commands and options ----------------------------------------------------------------------------------


def cli_help() -> tuple[str, dict[str, str]]:
    """The top-level --help text and each command's --help text."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser.format_help(), {name: sub.format_help() for name, sub in subparsers.choices.items()}


def options(help_text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z0-9-]*", help_text))


def command_mentions(doc: str) -> list[tuple[list[str], list[str]]]:
    """(commands, options) of every ``kvforensics <command> ...`` in the doc's code, and of inline spans
    such as ``run --sign-key KEY`` that name a command and its options."""
    _, commands = cli_help()
    found = []
    for line in code_texts(doc):
        for text in re.split(r" \| |;|&&", line.split(" # ")[0]):  # each command of a pipeline or list
            for m in re.finditer(r"(?<![\w./-])kvforensics((?: +[^ >]+)*)", text):
                words = m[1].split()
                cmds = words[0].split("|") if words and not words[0].startswith("-") else []
                found.append((cmds, re.findall(r"--[a-z][a-z0-9-]*", m[1])))
            first = text.split()[:1]
            if first and first[0] in commands and "--" in text and "kvforensics" not in text:
                found.append(([first[0]], re.findall(r"--[a-z][a-z0-9-]*", text)))
    return found


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_command_and_option_shown_exists(doc):
    top, commands = cli_help()
    mentions = command_mentions(doc)
    assert mentions, f"{doc} shows no kvforensics command"
    problems = []
    for cmds, opts in mentions:
        for cmd in cmds:
            if cmd not in commands:
                problems.append(f"kvforensics {cmd}: no such command (commands: {', '.join(commands)})")
                continue
            problems += [f"kvforensics {cmd} {o}: not in its --help" for o in opts if o not in options(commands[cmd])]
        if not cmds:
            problems += [f"kvforensics {o}: not in kvforensics --help" for o in opts if o not in options(top)]
    assert problems == []


def test_the_readme_shows_every_command():
    _, commands = cli_help()
    shown = {cmd for cmds, _ in command_mentions("README.md") for cmd in cmds}
    assert set(commands) - shown == set()


def test_quick_start_is_the_makefile_and_ci():
    makefile = read("Makefile")
    ci = read(".ci/run")
    quick = section("README.md", "Quick start")
    targets = re.findall(r"^make (\w+)", "\n".join(b for i, b, _ in fences("README.md") if i == "sh"), re.M)
    assert targets[:2] == ["sample", "test"]
    for target in targets:
        assert re.search(rf"^{target}:", makefile, re.M), f"make {target}: no such Makefile target"
    assert "make test" in ci
    sample = re.search(r"^sample:.*\n\t\$\(BIN\)/(kvforensics .*)$", makefile, re.M)
    assert sample and f"`{sample[1]}`" in quick


# --- paths -------------------------------------------------------------------------------------------------


def repo_paths(doc: str) -> set[str]:
    """Repository paths the doc names (from the root) and the targets of its relative links."""
    text = read(doc)
    links = {
        (Path(doc).parent / m).as_posix() for m in re.findall(r"\]\(([^)#\s]+)\)", text) if not re.match(r"[a-z]+:", m)
    }
    return {p.rstrip(".,:;") for p in set(REPO_PATH.findall(text)) | links}


def expand(path: str) -> list[str]:
    """A doc path as globs: ``<id>`` is any name, ``{sql,yml}`` either."""
    path = re.sub(r"<[^>]+>", "*", path)
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if m:
        return [g for alt in m[1].split(",") for g in expand(path[: m.start()] + alt + path[m.end() :])]
    return [path]


@pytest.mark.parametrize("doc", ALL_DOCS)
def test_every_repository_path_named_exists(doc):
    paths = repo_paths(doc)
    assert paths, f"{doc} names no repository path"
    missing = sorted(p for p in paths if not all(glob.glob(str(ROOT / g)) for g in expand(p)))
    assert missing == []


# --- outputs -----------------------------------------------------------------------------------------------

OUTPUT_TABLES = {"README.md": "Outputs", "docs/incident-config.md": "Out: "}
CONDITIONS = {"report.pdf": "--no-pdf", "manifest.json.sig": "--sign-key"}


def documented_outputs(doc: str) -> dict[str, str]:
    """Output name (a folder without its /) -> its row, from the doc's outputs table."""
    text = section(doc, OUTPUT_TABLES[doc])
    rows = {}
    for cell in table_column(text, "file"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {cell} |"))
        rows.update({name.rstrip("/"): row for name in INLINE.findall(cell)})
    return rows


@pytest.mark.parametrize("doc", USER_DOCS)
def test_outputs_table_lists_every_output_the_code_writes(doc):
    documented = documented_outputs(doc)
    assert set(documented) == {*HASHED_OUTPUTS, EVIDENCE, MANIFEST, SIGNATURE}
    for name, flag in CONDITIONS.items():
        assert flag in documented[name], f"{doc}: the row of {name} should say when it is written ({flag})"


@pytest.mark.parametrize("doc", USER_DOCS)
def test_a_run_of_the_sample_writes_what_the_outputs_table_lists(doc, sample_run):
    documented = documented_outputs(doc)
    written = {p.name for p in sample_run.iterdir() if not p.name.startswith(".")}
    assert written - set(documented) == set(), "files a run writes that the table does not list"
    expected = set(documented) - set(CONDITIONS) | ({"report.pdf"} if find_chromium() else set())
    assert expected - written == set()
    assert {p.name for p in (sample_run / "notices").iterdir()} <= {
        "customers",
        "internal",
        "reporter",
        "trust-and-safety",
    }


def test_the_readme_python_example_runs_on_the_sample(sample_run):
    (code,) = [body for info, body, _ in fences("README.md") if info == "python"]
    assert '"reports/sample"' in code
    names: dict = {}
    shown = []  # what each line that is an expression shows in a notebook
    for statement in ast.parse(code.replace('"reports/sample"', repr(str(sample_run)))).body:
        if isinstance(statement, ast.Expr):
            shown.append(eval(compile(ast.Expression(statement.value), "README.md", "eval"), names))
        else:
            exec(compile(ast.Module([statement], []), "README.md", "exec"), names)
    try:
        assert Path(names["inv"].out_dir) == sample_run and len(shown) == 4
        assert all(len(getattr(value, "frame", value)) > 0 for value in shown)
    finally:
        names["inv"].close()


# --- tables of what the package ships -----------------------------------------------------------------------


def test_readme_rules_table_is_the_rule_set():
    rules = {}
    for path in sorted((ROOT / "kvforensics" / "mechanisms").glob("*/rules/*.yml")):
        meta = yaml.safe_load(path.read_text(encoding="utf-8"))
        rules[meta["id"]] = meta["severity"]
    text = section("README.md", "Detection rules")
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| `")]
    assert {r[1].strip().strip("`"): r[2].strip() for r in rows} == rules


def test_readme_rule_example_uses_the_keys_of_a_real_rule():
    example = next(yaml.safe_load(body) for info, body, _ in fences("README.md") if info == "yaml")
    real = yaml.safe_load(
        (ROOT / "kvforensics" / "mechanisms" / "stale_pages" / "rules" / "prompt_exceeds_kv_pool.yml").read_text()
    )
    assert set(example) <= set(real) | {"version"}
    assert {"id", "title", "severity", "description", "tests"} <= set(example)


@pytest.mark.parametrize(
    ("doc", "heading"), [("README.md", "Inputs understood"), ("docs/incident-config.md", "Mapping real exports")]
)
def test_preset_table_is_the_preset_set(doc, heading):
    shipped = {p.stem for p in (ROOT / "kvforensics" / "sources" / "requests" / "presets").glob("*.toml")}
    assert names_in(table_column(section(doc, heading), "preset")) == shipped


def test_source_keys_table_is_what_the_loader_accepts(tmp_path):
    (tmp_path / "incident.toml").write_text(BASE_INCIDENT + 'not_a_source_key = "x"\n')
    with pytest.raises(ConfigError) as refused:
        load_incident(tmp_path / "incident.toml")
    valid = set(re.search(r"valid keys: (.*)$", str(refused.value))[1].split(", "))
    documented = names_in(table_column(section("docs/incident-config.md", "Keys of a `[[sources]]` entry"), "key"))
    assert documented == valid
    assert "role" not in valid  # the doc says a source has no role key: a start-up's role is read from its log


# --- the import floors of docs/architecture.md ---------------------------------------------------------------

PACKAGE = ROOT / "kvforensics"


def package_imports() -> dict[str, set[str]]:
    """Each module of the package (its path under ``kvforensics/``) -> the modules of the package it imports,
    anywhere in it (inside functions and under ``TYPE_CHECKING`` too)."""
    paths = {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}
    by_name = {
        ".".join(["kvforensics", *Path(rel).with_suffix("").parts]).removesuffix(".__init__"): rel for rel in paths
    }
    graph = {}
    for name, rel in by_name.items():
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(paths[rel].read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in by_name else base for a in node.names]
            else:
                continue
            found |= {by_name[t] for t in targets if t in by_name and by_name[t] != rel}
        graph[rel] = found
    return graph


def floors(doc: str = "docs/architecture.md") -> dict[str, int]:
    """Path under ``kvforensics/`` (a file, or a folder ending in /) -> its floor, from the doc's floors table."""
    text = section(doc, "Import floors")
    table = {}
    for cell in table_column(text, "floor"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {cell} |"))
        table.update({path: int(cell) for path in INLINE.findall(row.split("|")[2])})
    return table


def floor_of(module: str, table: dict[str, int]) -> int | None:
    """The floor of the most specific row naming the module or a folder holding it."""
    rows = [path for path in table if module == path or (path.endswith("/") and module.startswith(path))]
    return table[max(rows, key=len)] if rows else None


def test_floor_lookup_prefers_the_module_row():
    table = {"engines/": 1, "engines/spark.py": 3, "sources/": 2}
    assert [floor_of(m, table) for m in ("engines/__init__.py", "engines/spark.py", "sources/x.py", "cli.py")] == [
        1,
        3,
        2,
        None,
    ]


def test_every_import_goes_to_the_same_floor_or_below():
    table = floors()
    graph = package_imports()
    assert len(graph) > 50 and "sources/common/load_report.py" in graph["stages/ingest.py"]
    unplaced = sorted(m for m in graph if floor_of(m, table) is None)
    assert unplaced == [], "modules docs/architecture.md's floors table does not place"
    upward = sorted(
        f"{m} (floor {floor_of(m, table)}) imports {d} (floor {floor_of(d, table)})"
        for m, deps in graph.items()
        for d in deps
        if floor_of(d, table) > floor_of(m, table)
    )
    assert upward == []


# --- timestamps ----------------------------------------------------------------------------------------------

INSTANT = datetime(2026, 8, 28, 10, 0, 0, 123456, tzinfo=UTC)
EPOCH_UNITS = {"seconds": 1, "milliseconds": 1_000, "microseconds": 1_000_000, "nanoseconds": 1_000_000_000}


@pytest.mark.parametrize("unit", EPOCH_UNITS)
def test_each_documented_epoch_unit_is_read(unit, tmp_path):
    for doc in USER_DOCS:
        assert unit in " ".join(prose(doc).split()), f"{doc} should name epoch {unit}"
    value = round(INSTANT.timestamp() * EPOCH_UNITS[unit]) if unit != "seconds" else int(INSTANT.timestamp())
    record = {
        "rid": "r1",
        "received_at": value,
        "account_id": "a",
        "model": "m",
        "http_status": 200,
        "prompt_tokens": 1,
    }
    (tmp_path / "gw.jsonl").write_text(json.dumps(record) + "\n")
    source = Source(
        name="gw",
        kind="requests",
        path="*.jsonl",
        format="jsonl",
        timezone="UTC",
        base_dir=tmp_path,
        columns={"request_id": "rid", "ts": "received_at", "status": "http_status"},
    )
    con = connect()
    load_requests_file(con, source, tmp_path / "gw.jsonl")
    (ts,) = con.execute("SELECT ts FROM requests").fetchone()
    precision = {"seconds": 1_000_000, "milliseconds": 1_000}.get(unit, 1)
    assert ts.astimezone(UTC) == INSTANT.replace(microsecond=INSTANT.microsecond // precision * precision)


def test_the_import_contracts_are_the_floors_table():
    """pyproject.toml's layers contract (``lint-imports``) lists the floors of the table, top floor first: each
    package or module of a layer stands on that layer's floor."""
    table = floors()
    contracts = tomllib.loads(read("pyproject.toml"))["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    layer_floors = []
    for layer in layers:
        found = set()
        for module in re.split(r"\s*[:|]\s*", layer):
            rel = module.removeprefix("kvforensics.").replace(".", "/")
            is_package = (PACKAGE / rel).is_dir()
            assert is_package or (PACKAGE / f"{rel}.py").is_file(), f"{module}: no such module"
            found.add(floor_of(f"{rel}/" if is_package else f"{rel}.py", table))
        assert len(found) == 1, f"one layer, one floor: {layer} stands on floors {sorted(found)}"
        layer_floors.append(found.pop())
    assert layer_floors == sorted(layer_floors, reverse=True), layer_floors
    assert set(layer_floors) == set(table.values()), "every floor is a layer"
