"""The payload contract published: as JSON (``stageferry schema payload``) and as the Markdown tables of
``docs/payload-contract.md``.

Both are rendered from :data:`stageferry.schemas.payload_contract.CONDITIONING` and the layout's
:data:`~stageferry.schemas.payload_layout.FIELDS`, so the published contract cannot drift from the one
the consumer enforces: a test compares the doc's generated block with :func:`contract_markdown`.
"""

from __future__ import annotations

from typing import Any

from stageferry.schemas.job import Task
from stageferry.schemas.payload_contract import ALL_TASKS, FLOATS, PayloadContract, TensorEntry
from stageferry.schemas.payload_layout import (
    AUDIO_BANDS,
    AUDIO_HOP,
    AUDIO_SAMPLE_RATE,
    FIELDS,
    LATENT_CHANNELS,
    LAYOUT_VERSION,
    SPATIAL,
    TEMPORAL,
)

#: The generated block of ``docs/payload-contract.md`` sits between these two lines.
BEGIN = "<!-- generated: stageferry schema payload --format markdown -->"
END = "<!-- end of generated block -->"


def _required(entry: TensorEntry) -> str:
    if entry.required == ALL_TASKS:
        return "always"
    if not entry.required:
        return "optional"
    return "for " + ", ".join(t.value for t in Task if t in entry.required)


def contract_json(contract: PayloadContract) -> dict[str, Any]:
    """The contract as plain JSON: entries, dimension rules, layout fields and the latent geometry."""
    dims: dict[str, dict[str, str]] = {}
    for entry in contract.tensors:
        for dim in entry.shape:
            dims.setdefault(dim.symbol, {"kind": dim.kind.value, "rule": dim.rule})
    return {
        "contract": contract.name,
        "version": contract.version,
        "layout_version": LAYOUT_VERSION,
        "tensors": [
            {
                "name": e.name,
                "dtypes": [d.value for d in e.dtypes],
                "shape": [d.symbol for d in e.shape],
                "required_for": [t.value for t in Task if t in e.required],
                "values": list(e.values) if e.values is not None else None,
                "finite": set(e.dtypes) <= set(FLOATS),
                "doc": e.doc,
            }
            for e in contract.tensors
        ],
        "plain": [{"name": p.name, "type": p.kind.__name__, "doc": p.doc} for p in contract.plain],
        "dimensions": dims,
        "layout_fields": [{"index": i, "name": n, "value": v} for i, (n, v) in enumerate(FIELDS)],
        "geometry": {
            "latent_channels": LATENT_CHANNELS,
            "spatial": SPATIAL,
            "temporal": TEMPORAL,
            "audio_sample_rate": AUDIO_SAMPLE_RATE,
            "audio_hop": AUDIO_HOP,
            "audio_bands": AUDIO_BANDS,
        },
        "extra_entries": "allowed; passed to the model untouched",
    }


def contract_markdown(contract: PayloadContract) -> str:
    """The tables of ``docs/payload-contract.md`` (between :data:`BEGIN` and :data:`END`)."""
    doc = contract_json(contract)
    lines = [
        f"Contract `{contract.id}`, layout version {LAYOUT_VERSION}.",
        "",
        "| entry | dtype | shape | required | what |",
        "| --- | --- | --- | --- | --- |",
    ]
    for e in contract.tensors:
        dtypes = ", ".join(d.value for d in e.dtypes)
        shape = "[" + ", ".join(d.symbol for d in e.shape) + "]"
        what = e.doc + (f"; values {e.values[0]}..{e.values[1]}" if e.values is not None else "")
        lines.append(f"| `{e.name}` | {dtypes} | `{shape}` | {_required(e)} | {what} |")
    for p in contract.plain:
        lines.append(f"| `{p.name}` | {p.kind.__name__} | — | optional | {p.doc} |")
    lines += ["", "| dimension | kind | rule |", "| --- | --- | --- |"]
    lines += [f"| `{sym}` | {d['kind']} | {d['rule']} |" for sym, d in doc["dimensions"].items()]
    lines += ["", "| layout index | field | value |", "| --- | --- | --- |"]
    lines += [f"| {f['index']} | `{f['name']}` | {f['value']} |" for f in doc["layout_fields"]]
    return "\n".join([BEGIN, *lines, END]) + "\n"


def generated_block(text: str) -> str:
    """The generated block of a document (markers included), or ``""`` if it has none."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return ""
    return text[start : end + len(END)] + "\n"
