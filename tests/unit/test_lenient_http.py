"""The terminator llama-server sends after a bodiless answer's head, dropped and nothing else."""

from __future__ import annotations

from cacheproxy.upstreams.lenient_http import drop_bodiless_terminator

HEAD_204 = b"HTTP/1.1 204 No Content\r\nServer: llama.cpp\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_the_terminator_after_a_chunked_204_head_is_dropped() -> None:
    assert drop_bodiless_terminator(HEAD_204 + b"0\r\n\r\n") == (HEAD_204, False)


def test_a_head_that_ends_the_read_leaves_the_terminator_due() -> None:
    assert drop_bodiless_terminator(HEAD_204) == (HEAD_204, True)


def test_other_answers_are_left_as_they_are() -> None:
    chunked_200 = HEAD_204.replace(b"204 No Content", b"200 OK") + b"0\r\n\r\n"
    assert drop_bodiless_terminator(chunked_200) == (chunked_200, False)
    plain_204 = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"
    assert drop_bodiless_terminator(plain_204) == (plain_204, False)
    body = b'{"a": 1}'
    assert drop_bodiless_terminator(body) == (body, False)
