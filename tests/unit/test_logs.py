"""Secrets are masked in every log line, whatever put them there."""

from __future__ import annotations

import logging

import pytest

from cacheproxy.ops.logs import JsonFormatter, TextFormatter, redact_secrets

SECRET = "Zr81xKq77zXw"


@pytest.mark.parametrize(
    "text",
    [
        f"GET /admin/dashboard?key={SECRET} HTTP/1.1",
        f"GET /x?a=1&api_key={SECRET}&b=2",
        f"url http://127.0.0.1:8080/v1?access_token={SECRET}",
        f"headers {{'Authorization': 'Bearer {SECRET}'}}",
        f"X-Api-Key: {SECRET}",
        f"starting llama-server: /bin/llama-server --port 1 --api-key {SECRET} --metrics",
        f"starting llama-server: /bin/llama-server --api-key={SECRET}",
        f"upstream http://admin:{SECRET}@10.0.0.1:8081 is down",
    ],
)
def test_secrets_are_masked(text: str) -> None:
    masked = redact_secrets(text)
    assert SECRET not in masked
    assert "***" in masked


@pytest.mark.parametrize(
    "text",
    [
        "request tenant=t_1 upstream=http://127.0.0.1:8081 slot=0 action=hit prompt=600",
        "refused POST /completion 400: request body is not valid JSON: unexpected end of data",
        "drain: 1 slot(s) worth keeping not archived: slot 0 of http://127.0.0.1:1: 603 tokens",
        "GET /tokenize?min_tokens=4",
    ],
)
def test_ordinary_lines_are_left_alone(text: str) -> None:
    assert redact_secrets(text) == text


def test_both_formatters_mask_the_message_and_the_traceback() -> None:
    try:
        raise ValueError(f"bad url http://x/?key={SECRET}")
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "t", logging.ERROR, __file__, 1, "calling %s", (f"http://u:{SECRET}@h/",), exc_info
    )
    for formatter in (TextFormatter(), JsonFormatter()):
        line = formatter.format(record)
        assert "ValueError" in line
        assert SECRET not in line
