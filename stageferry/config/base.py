"""Common pieces of the configuration: the strict base of the pipeline file's sections, byte units."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class Strict(BaseModel):
    """Base of the pipeline file's sections; each field's docstring is its documentation (docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
