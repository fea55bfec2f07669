"""One error shape for the proxy and the engine, one validation formatter, and store errors
that no generic `except ValueError` catches by accident."""

from __future__ import annotations

import pydantic
import pytest

from cacheproxy.disk.archive_types import ArchiveError, ArchiveRefused
from cacheproxy.errors import ApiError, describe_validation_error


class Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str
    count: int = pydantic.Field(ge=1)


def invalid(document: object) -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as caught:
        Body.model_validate(document)
    return caught.value


def test_proxy_errors_are_api_errors_in_llama_servers_envelope() -> None:
    error = ApiError(503, "no slot free", headers={"Retry-After": "1"})
    assert isinstance(error, ApiError)
    assert error.envelope() == {
        "error": {"code": 503, "message": "no slot free", "type": "unavailable_error"}
    }
    assert ApiError(501, "no").error_type == "not_supported_error"
    assert ApiError(400, "too long", "exceed_context_size_error").error_type == (
        "exceed_context_size_error"
    )


def test_one_line_without_values_for_a_client() -> None:
    error = invalid({"name": "secret-key-123", "count": 0, "a": 1, "b": 2})
    text = describe_validation_error(error, "invalid request body", limit=2)
    assert text == (
        "invalid request body: count: Input should be greater than or equal to 1; "
        "a: Extra inputs are not permitted (and 1 more)"
    )
    assert "secret" not in describe_validation_error(invalid({"name": 5, "count": 1}), "x")
    assert describe_validation_error(invalid([]), "invalid body", top_level="body") == (
        "invalid body: body: Input should be a valid dictionary or instance of Body"
    )


def test_one_per_line_with_values_for_an_operator() -> None:
    text = describe_validation_error(
        invalid({"name": "n", "count": 0}), "invalid settings", show_input=True, one_per_line=True
    )
    assert text == (
        "invalid settings (1 problem(s)):\n"
        "  count: Input should be greater than or equal to 1 (got 0)"
    )


def test_a_refused_archive_is_no_value_error() -> None:
    """The disk tier catches ValueError for a server's unusable answer: a refusal must not
    depend on being caught before it."""
    assert issubclass(ArchiveRefused, ArchiveError)
    assert not issubclass(ArchiveRefused, ValueError)
