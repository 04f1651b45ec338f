"""The reference tables of ``docs/``, generated from the code so that they cannot drift.

Each table sits in a docs file between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``.
``scripts/gen_docs.py`` rewrites those blocks; ``scripts/gen_docs.py --check`` (and
``tests/test_docgen.py``) fails when a committed block differs from what the code says, so a new key,
error class or setting cannot ship undocumented.  The sources:

* ``keys``: every method of :class:`~stageferry.broker.control.keys.Keys`, called with placeholder
  names, and what :data:`~stageferry.broker.control.keys.KEY_DOCS` says the key holds;
* ``errors``: every :class:`~stageferry.errors.StageferryError` class, its ``code``, its parent and the
  line the error tree in ``errors.py``'s docstring gives it;
* ``gateway_errors``: the gateway's own codes, :class:`~stageferry.gateway.codes.GatewayCode`, with
  their HTTP statuses and meanings;
* ``settings``, ``pipeline``, ``job``: the JSON Schema of :class:`~stageferry.config.Settings`, of each
  section of :class:`~stageferry.config.PipelineConfig` and of :class:`~stageferry.schemas.JobRequest`:
  defaults, allowed values and ranges from the validators themselves, meanings from the fields'
  docstrings.

The same range text (:func:`allowed`) is what the CLI's help shows for a job option.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from stageferry import errors
from stageferry.broker.control.keys import KEY_DOCS, Keys
from stageferry.config import (
    AggregatedConfig,
    DataPlaneConfig,
    Limits,
    PipelineConfig,
    Retention,
    Security,
    Settings,
    StageConfig,
    Streaming,
    Timeouts,
)
from stageferry.schemas import JobRequest

_PLACEHOLDERS = {"stage": "<stage>", "request_id": "<id>", "attempt": "<attempt>", "name": "<name>",
                 "token": "<token>", "agent": "<agent>"}  # fmt: skip
_BLOCK = re.compile(r"(<!-- generated:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _table(header: tuple[str, ...], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- keys ----------------------------------------------------------------------------------------------------


def key_rows() -> list[tuple[str, str]]:
    """``(pattern, meaning)`` for every key method of :class:`Keys`, in source order."""
    keys = Keys("<p>")
    rows = []
    for name, method in vars(Keys).items():
        if name.startswith("_") or not callable(method):
            continue
        if name not in KEY_DOCS:
            raise KeyError(f"Keys.{name} has no entry in KEY_DOCS (stageferry/broker/control/keys.py)")
        if (meaning := KEY_DOCS[name]) is None:  # a helper that picks one of the keys above, not a key
            continue
        params = [p for p in list(inspect.signature(method).parameters.values())[1:] if p.default is p.empty]
        pattern = getattr(keys, name)(*(_PLACEHOLDERS.get(p.name, f"<{p.name}>") for p in params))
        rows.append((pattern + ("…" if name == "upload_prefix" else ""), meaning))
    return rows


def keys_table() -> str:
    return _table(("key", "what it holds"), [(f"`{k}`", v) for k, v in key_rows()])


# -- errors --------------------------------------------------------------------------------------------------


def _error_classes() -> Iterator[tuple[int, type[errors.StageferryError]]]:
    """Depth-first over the tree, children in definition order."""

    def walk(cls: type[errors.StageferryError], depth: int) -> Iterator[tuple[int, type[errors.StageferryError]]]:
        yield depth, cls
        for sub in cls.__subclasses__():
            if sub.__module__ == errors.__name__:
                yield from walk(sub, depth + 1)

    yield from walk(errors.StageferryError, 0)


def _tree_lines() -> dict[str, str]:
    """Class name → the description the error tree in ``errors.py``'s docstring gives it."""
    found: dict[str, str] = {}
    last = None
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^[\s│├└─]*(?P<name>[A-Z]\w+Error)\b\s*(?P<text>.*)$", line)
        if m and ("──" in line or m["name"] == "StageferryError"):
            last = m["name"]
            found[last] = m["text"].strip()
        elif last and line.strip().startswith("│") and (rest := line.strip(" │")):
            found[last] = f"{found[last]} {rest.strip()}".strip()  # a description continued on the next line
        else:
            last = None if not line.strip() else last
    return found


def error_rows() -> list[tuple[str, str, str, str]]:
    """``(code, class, parent, meaning)`` for every error class."""
    described = _tree_lines()
    rows = []
    for depth, cls in _error_classes():
        if depth == 0:
            continue
        if cls.__name__ not in described:
            raise KeyError(f"{cls.__name__} is missing from the error tree in stageferry/errors.py's docstring")
        parent = cls.__mro__[1].__name__
        rows.append((cls.code, cls.__name__, parent, described[cls.__name__]))
    return rows


def errors_table() -> str:
    return _table(
        ("code", "class", "subclass of", "meaning"),
        [(f"`{code}`", f"`{cls}`", f"`{parent}`", text) for code, cls, parent, text in error_rows()],
    )


def gateway_errors_table() -> str:
    # Imported here: the CLI imports this module, and the gateway package needs the gateway extra.
    from stageferry.gateway.codes import code_rows

    return _table(("code", "HTTP status", "meaning"), code_rows())


# -- settings, pipeline, job: from the JSON Schema -----------------------------------------------------------


def _resolve(schema: Mapping[str, Any], prop: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The alternatives a property allows (``anyOf`` flattened, ``$ref`` followed, ``null`` dropped)."""
    if "$ref" in prop:
        return _resolve(schema, schema["$defs"][prop["$ref"].rsplit("/", 1)[-1]])
    if "anyOf" in prop:
        return [alt for sub in prop["anyOf"] for alt in _resolve(schema, sub) if alt.get("type") != "null"]
    if "allOf" in prop and len(prop["allOf"]) == 1:
        return _resolve(schema, prop["allOf"][0])
    return [prop]


def _number(value: float, *, as_bytes: bool) -> str:
    if as_bytes and isinstance(value, int) and value >= 1024:
        for unit, size in _UNITS:
            if value % size == 0:
                return f"{value // size} {unit}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and abs(value) >= 2**53:
        exp = value.bit_length() - 1
        return f"2^{exp}" if value == 2**exp else f"2^{exp + 1}-1" if value == 2 ** (exp + 1) - 1 else str(value)
    return str(value)


def allowed_text(alt: Mapping[str, Any], *, as_bytes: bool = False) -> str:
    """One alternative of a schema property as readable constraints: ``1–200``, ``> 0, ≤ 30``, choices."""
    if "enum" in alt:
        return " | ".join(str(v) for v in alt["enum"])
    if "const" in alt:
        return str(alt["const"])
    low = alt.get("minimum", alt.get("exclusiveMinimum"))
    high = alt.get("maximum", alt.get("exclusiveMaximum"))
    parts = []
    if "minimum" in alt and "maximum" in alt:
        parts.append(f"{_number(low, as_bytes=as_bytes)}–{_number(high, as_bytes=as_bytes)}")
    else:
        if low is not None:
            parts.append(f"{'>' if 'exclusiveMinimum' in alt else '≥'} {_number(low, as_bytes=as_bytes)}")
        if high is not None:
            parts.append(f"{'<' if 'exclusiveMaximum' in alt else '≤'} {_number(high, as_bytes=as_bytes)}")
    if "pattern" in alt:
        parts.append(f"`{alt['pattern']}`")
    elif "minLength" in alt or "maxLength" in alt:
        parts.append(f"{alt.get('minLength', 0)}–{alt['maxLength']} chars" if "maxLength" in alt else "non-empty")
    if alt.get("type") == "array" and "items" in alt:
        parts.append(f"list of {allowed_text(alt['items'], as_bytes=as_bytes) or alt['items'].get('type', '?')}")
    if not parts and alt.get("type") == "boolean":
        parts.append("true | false")
    return ", ".join(parts)


def _properties(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The model's own properties (a recursive model's schema is a ``$ref`` into ``$defs``)."""
    return _resolve(schema, schema)[0]["properties"] if "$ref" in schema else schema["properties"]


def allowed(schema: Mapping[str, Any], name: str) -> str:
    """What field ``name`` of ``schema`` accepts, as one short line (e.g. ``64–2048``)."""
    alts = _resolve(schema, _properties(schema)[name])
    return " or ".join(text for alt in alts if (text := allowed_text(alt, as_bytes=name.endswith("_bytes"))))


def _default(prop: Mapping[str, Any], name: str) -> str:
    if "default" not in prop:
        return "—"
    value = prop["default"]
    if value is None:
        return "unset"
    if isinstance(value, dict):  # a nested model's default: only what it sets
        value = {k: v for k, v in value.items() if v is not None}
    if name.endswith("_bytes") and isinstance(value, int) and value:
        return f"{value} ({_number(value, as_bytes=True)})"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def field_rows(
    model: type[BaseModel], *, skip: tuple[str, ...] = (), name_of: Callable[[str], str] = lambda n: f"`{n}`"
) -> list[tuple[str, str, str, str]]:
    """``(name, default, allowed, meaning)`` for each field of ``model``; a field without a docstring is an error."""
    schema = model.model_json_schema()
    rows = []
    for name, prop in _properties(schema).items():
        if name in skip:
            continue
        meaning = prop.get("description") or (model.model_fields[name].description or "")
        if not meaning:
            raise KeyError(f"{model.__name__}.{name} has no docstring: say what it means below the field")
        rows.append((name_of(name), _default(prop, name), allowed(schema, name) or "—", " ".join(meaning.split())))
    return rows


def settings_table() -> str:
    rows = field_rows(Settings, name_of=lambda n: f"`STAGEFERRY_{n.upper()}`")
    rows = [(n, "hostname" if n == "`STAGEFERRY_REPLICA`" else d, a, m) for n, d, a, m in rows]
    return _table(("variable", "default", "allowed", "meaning"), rows)


#: The pipeline file's sections, in the order the docs list them.
PIPELINE_SECTIONS: tuple[tuple[str, type[BaseModel], tuple[str, ...]], ...] = (
    (
        "top level",
        PipelineConfig,
        ("stages", "aggregated", "data_plane", "timeouts", "streaming", "limits", "retention", "security"),
    ),
    ("[[stages]]", StageConfig, ("parts",)),
    ("[aggregated]", AggregatedConfig, ()),
    ("[data_plane]", DataPlaneConfig, ()),
    ("[timeouts]", Timeouts, ()),
    ("[streaming]", Streaming, ()),
    ("[limits]", Limits, ()),
    ("[retention]", Retention, ()),
    ("[security]", Security, ()),
)


def pipeline_tables() -> str:
    out = []
    for title, model, skip in PIPELINE_SECTIONS:
        out.append(f"**{title}**\n\n" + _table(("key", "default", "allowed", "meaning"), field_rows(model, skip=skip)))
    return "\n".join(out)


def job_table() -> str:
    return _table(("field", "default", "allowed", "meaning"), field_rows(JobRequest))


GENERATORS: dict[str, Callable[[], str]] = {
    "keys": keys_table,
    "errors": errors_table,
    "gateway_errors": gateway_errors_table,
    "settings": settings_table,
    "pipeline": pipeline_tables,
    "job": job_table,
}


# -- the docs files ------------------------------------------------------------------------------------------


def render(text: str) -> str:
    """``text`` with every generated block replaced by what the code says now."""

    def fill(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in GENERATORS:
            raise KeyError(f"unknown generated block {name!r}; known: {', '.join(GENERATORS)}")
        return f"{m.group(1)}{GENERATORS[name]()}{m.group(4)}"

    return _BLOCK.sub(fill, text)


def blocks(text: str) -> list[str]:
    """The names of the generated blocks in ``text``."""
    return [m["name"] for m in _BLOCK.finditer(text)]


def stale_files(docs_dir: Path, *, write: bool) -> list[Path]:
    """Docs files whose generated blocks differ from the code (rewritten when ``write``)."""
    stale = []
    for path in sorted(docs_dir.glob("*.md")):
        text = path.read_text()
        if not blocks(text):
            continue
        fresh = render(text)
        if fresh != text:
            stale.append(path)
            if write:
                path.write_text(fresh)
    return stale


__all__ = ["GENERATORS", "allowed", "blocks", "error_rows", "field_rows", "key_rows", "render", "stale_files"]
