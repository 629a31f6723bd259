"""Which keys the records of a JSONL request log have, and the mapped keys that none of them has.

A JSONL file's columns are chosen from the keys of its first records (``SAMPLE_RECORDS``): the
incident file's mapping, else the canonical name, else a known alias
(:func:`kvforensics.sources.requests.staging.choose_columns`). A required field's key that no record of the
file has is a mapping mistake, as a column a CSV header lacks is: exit 2 naming the key and the keys
the records have, not a file whose every record is quarantined (exit 3). A JSON record may leave a
key out, so a key the first records lack is looked for in every record before that is said, and an
optional field's key no record has leaves the field empty, with a note.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from kvforensics.config import Source
from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS, REQUIRED_REQUEST_FIELDS
from kvforensics.core.errors import InputError
from kvforensics.sources.common.textio import CHUNK, LineStream, open_binary
from kvforensics.sources.requests.staging import (
    candidate_names,
    check_expression_columns,
    expression_refs,
    preset_gap,
    preset_optional,
)

SAMPLE_RECORDS = 2000  # records whose keys choose a JSONL file's columns
_SAMPLED_DEPTH = 3  # the sampled keys are paths of up to 4 names (a.b.c.d)


def require_mapped_keys(source: Source, path: Path, keys: set[str], whole: bool) -> list[str]:
    """Every key the mapping names (a column, a path, a key an expression reads) against the keys the
    records have (*keys*: sampled, of every record when *whole*): a required field's key no record
    has, or the keys an expression cannot do without, is an error naming them (InputError; a
    ConfigError for an expression, as for a CSV header), unless a preset reads them for an optional
    field. An optional field's own key no record has leaves the field empty with a note: JSON records
    leave absent values out, and one file of many may have none (a day without a streamed request has
    no TTFT). Returns the notes."""
    if not keys:
        return []  # no record parsed: the loader quarantines each line with its reason
    plain = {canonical: col for canonical, col in source.columns.items() if canonical not in source.expressions}
    absent = {name for name in {*plain.values(), *expression_refs(source)} if name not in keys}
    # what an error would be said of is looked for in every record (an optional field's key only notes)
    decisive = {plain[c] for c in REQUIRED_REQUEST_FIELDS if c in plain} | set(expression_refs(source))
    unsure = {name for name in absent & decisive if not whole or name.count(".") > _SAMPLED_DEPTH}
    maybe = {name for name in unsure if _json_key_in_file(path, name)}
    if maybe:
        absent -= _names_in_records(path, maybe)
    top = sorted({k.split(".")[0] for k in keys})
    shown = f"{top[:30]}{' ...' if len(top) > 30 else ''}"
    where = f"source '{source.name}': {path}"
    notes = []
    for canonical, col in plain.items():
        if col not in absent:
            continue
        if preset_optional(source, canonical):
            notes.append(preset_gap(source, canonical, [col], path))
            continue
        if canonical not in REQUIRED_REQUEST_FIELDS:  # said, not refused: see the docstring
            if whole:
                notes.append(f"{canonical} left empty: no record of {path.name} has key '{col}' (columns.{canonical})")
            continue
        raise InputError(
            f"required field '{canonical}' is missing (mapped to key '{col}'): no record has it; the "
            f"records have keys {shown}. Map it in the incident file: columns = {{ {canonical} = "
            "\"<key>\" }",
            location=where,
        )
    return notes + check_expression_columns(source, path, lambda name: name not in absent, top)


def _json_key_in_file(path: Path, key: str) -> bool:
    """Whether the key's (last) name occurs as a JSON string anywhere in the file (read in chunks;
    an unreadable stream counts as a yes, so the loader reports it in its own words)."""
    needle = json.dumps(key.split(".")[-1]).encode()
    tail = b""
    try:
        with open_binary(path) as fh:
            while chunk := fh.read(CHUNK):
                if needle in tail + chunk:  # the chunk with the last bytes before it: a name cut between chunks
                    return True
                tail = chunk[-len(needle) :]
    except Exception:  # noqa: BLE001 - truncated or corrupt: the line reader says so per record
        return True
    return False


def _has(record: object, name: str) -> bool:
    """Whether a record has the key *name*: itself, or the path of its dotted parts."""
    if not isinstance(record, dict):
        return False
    if name in record:
        return True
    node: object = record
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _names_in_records(path: Path, names: set[str]) -> set[str]:
    """The *names* some record of the file has, each record read (a name found is not looked for again)."""
    found: set[str] = set()
    for _, raw in LineStream(path):
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        found.update(name for name in names - found if _has(record, name))
        if found == names:
            break
    return found


def json_keys(obj: object, prefix: str = "", depth: int = 0) -> Iterator[str]:
    """The keys of a record and the dotted paths into its objects, up to ``_SAMPLED_DEPTH`` levels down."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{prefix}{k}"
            yield key
            if depth < _SAMPLED_DEPTH:
                yield from json_keys(v, key + ".", depth + 1)


def sample_json_keys(path: Path, limit: int | None = SAMPLE_RECORDS) -> tuple[set[str], bool]:
    """The keys (and dotted paths) of the file's first *limit* lines' records (None: every line), and
    whether that was the whole file."""
    keys: set[str] = set()
    stream = LineStream(path)
    for n, raw in stream:
        if limit is not None and n > limit:
            return keys, False
        try:
            keys.update(json_keys(json.loads(raw)))
        except (ValueError, UnicodeDecodeError):
            continue
    return keys, True


def late_needles(source: Source, keys: set[str], chosen: Mapping[str, str | None]) -> dict[str, set[bytes]]:
    """Per optional field the sample left unmapped, its names (the canonical one and known aliases; the
    last part of a path) as JSON strings: found in the rest of the file, the field was logged later (a
    gateway upgraded mid-file). A name some sampled key already ends in proves nothing and is left out."""
    sampled = {k.rsplit(".", 1)[-1] for k in keys}
    needles = {}
    for canonical in CANONICAL_REQUEST_FIELDS:
        if (
            canonical in REQUIRED_REQUEST_FIELDS
            or chosen.get(canonical) is not None
            or canonical in source.columns
            or canonical in source.expressions
        ):
            continue
        names = {n.rsplit(".", 1)[-1] for n in candidate_names(source, canonical)} - sampled
        if names:
            needles[canonical] = {json.dumps(n).encode() for n in names}
    return needles
