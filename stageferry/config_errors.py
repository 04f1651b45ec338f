"""A pipeline file's validation errors as one readable line: the key path, what is wrong, and for a
typo'd key the known key it is closest to (``stages.0.modle: unknown key; did you mean `model`?``),
instead of pydantic's multi-line dump."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

#: Errors named in the line at most (the rest are counted).
MAX_ERRORS = 5


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``StageConfig``, ``list[StageConfig]``, ``X | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _model_at(root: type[BaseModel], path: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model whose fields the key at ``path`` sits among (list indices skipped)."""
    model: type[BaseModel] | None = root
    for part in path:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
    return model


def _known_keys(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def describe(exc: ValidationError, root: type[BaseModel]) -> str:
    """``exc``'s errors in one line, each as ``a.b.c: message``, typos with a suggestion."""
    parts = []
    errors = exc.errors(include_url=False, include_input=False)
    locs = [tuple(e.get("loc", ())) for e in errors]
    errors = [  # "stages: at least 1 item" only follows from a stage that failed: not news
        e for e, loc in zip(errors, locs, strict=True)
        if not (e.get("type") == "too_short" and any(o[: len(loc)] == loc and o != loc for o in locs))
    ]  # fmt: skip
    for err in errors[:MAX_ERRORS]:
        loc = tuple(err.get("loc", ()))
        where = ".".join(str(p) for p in loc) or "(top level)"
        message = str(err.get("msg", ""))
        if err.get("type") == "extra_forbidden" and loc:
            model = _model_at(root, loc[:-1])
            known = _known_keys(model) if model is not None else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            message = (
                f"unknown key; did you mean `{close[0]}`?" if close else f"unknown key (known: {', '.join(known)})"
            )
        parts.append(f"{where}: {message}")
    if len(errors) > MAX_ERRORS:
        parts.append(f"and {len(errors) - MAX_ERRORS} more")
    return "; ".join(parts)


__all__ = ["describe"]
