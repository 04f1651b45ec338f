"""JSON text from outside parses with every failure a ``ValueError`` (``json.JSONDecodeError``)."""

from __future__ import annotations

import json

import pytest

from stageferry.schemas import json_text


def test_json_parses_as_the_standard_library_does() -> None:
    for raw in ('{"a": [1, 2.5, "x", null]}', b'[{"b": {"c": []}}]', bytearray(b'"s"')):
        assert json_text.loads(raw) == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    ["[" * 5000 + "]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000, "[" * 100_000],
    ids=["array", "object", "open"],
)
def test_nesting_past_the_recursion_limit_is_a_decode_error(raw: str | bytes) -> None:
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        json_text.loads(raw)


def test_text_that_is_not_json_is_a_decode_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        json_text.loads("{not json")
