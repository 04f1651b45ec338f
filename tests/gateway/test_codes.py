"""The gateway's own error codes: defined once, each with one status, agreeing with stageferry's."""

from __future__ import annotations

import pytest

from stageferry import errors
from stageferry.errors import error_class
from stageferry.gateway.codes import GatewayCode, code_rows
from stageferry.gateway.errors import ApiError, invalid, status_for


def test_codes_are_unique_and_each_answer_has_its_status() -> None:
    assert len({c.code for c in GatewayCode}) == len(GatewayCode)
    for code in GatewayCode:
        if code.status is None:
            answer = ApiError.of(code, "refused", status=418)
            assert answer.status == 418
        else:
            answer = ApiError.of(code, "refused")
            assert answer.status == code.status
        assert answer.body()["error"]["code"] == code.code
        assert answer.body()["error"]["type"] == ("invalid_request_error" if answer.status < 500 else "server_error")


def test_a_status_is_given_exactly_when_the_code_has_none() -> None:
    with pytest.raises(ValueError, match="http_error"):
        ApiError.of(GatewayCode.HTTP_ERROR, "no status")
    with pytest.raises(ValueError, match="not_found"):
        ApiError.of(GatewayCode.NOT_FOUND, "a second status", status=410)


def test_a_code_shared_with_stageferrys_errors_has_the_same_status() -> None:
    known = {
        cls.code for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.StageferryError)
    }
    shared = [c for c in GatewayCode if c.code in known]
    assert {c.code for c in shared} >= {"not_found", "internal"}
    for code in shared:
        assert error_class(code.code).code == code.code
        assert status_for(code.code) == code.status, code


def test_the_helpers_answer_with_the_table() -> None:
    answer = invalid("seconds", "must be a number")
    assert (answer.status, answer.code) == (GatewayCode.INVALID_FORM.status, GatewayCode.INVALID_FORM.code)
    rows = {row[0]: row[1] for row in code_rows()}
    assert rows["`invalid_form`"] == "400" and rows["`http_error`"] == "the framework's"
