"""Which headers cross the proxy, and which upstream takes a request."""

from __future__ import annotations

from multidict import CIMultiDict

from cacheproxy.upstreams.pool import UpstreamPool
from cacheproxy.upstreams.relay import client_response_headers, upstream_request_headers

CLIENT_HEADERS = CIMultiDict(
    [
        ("Host", "proxy:8080"),
        ("Connection", "keep-alive, X-Hop"),
        ("Keep-Alive", "timeout=5"),
        ("X-Hop", "named by Connection"),
        ("TE", "trailers"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic eA=="),
        ("Content-Length", "12"),
        ("Accept-Encoding", "gzip"),
        ("X-Conversation-Id", "abc"),
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer client-key"),
        ("X-Request-Id", "r1"),
        ("X-Request-Id", "r2"),
    ]
)


def test_hop_by_hop_and_conversation_headers_are_dropped() -> None:
    headers = upstream_request_headers(CLIENT_HEADERS, upstream_api_key=None)
    assert list(headers.items()) == [
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer client-key"),
        ("X-Request-Id", "r1"),
        ("X-Request-Id", "r2"),
    ]


def test_upstream_key_replaces_whatever_the_client_sent() -> None:
    with_x_api_key = CIMultiDict(CLIENT_HEADERS, **{"X-Api-Key": "client"})
    headers = upstream_request_headers(with_x_api_key, upstream_api_key="secret")
    assert headers.getall("Authorization") == ["Bearer secret"]
    assert "X-Api-Key" not in headers


def test_response_hop_by_hop_headers_are_dropped() -> None:
    upstream = CIMultiDict(
        [
            ("Content-Type", "text/event-stream"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "close"),
            ("Content-Length", "10"),
            ("Content-Encoding", "gzip"),
            ("Server", "llama.cpp"),
            ("Access-Control-Allow-Origin", "*"),
        ]
    )
    assert dict(client_response_headers(upstream)) == {
        "Content-Type": "text/event-stream",
        "Server": "llama.cpp",
        "Access-Control-Allow-Origin": "*",
    }


def test_pool_prefers_the_least_busy_upstream_and_rotates_ties() -> None:
    pool = UpstreamPool(["http://a:1/", "http://b:2", "http://c:3"])
    a, b, c = pool.upstreams
    assert a.base_url == "http://a:1"
    picks = {pool.pick().base_url for _ in range(3)}
    assert picks == {"http://a:1", "http://b:2", "http://c:3"}
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    assert all(pool.pick() is b for _ in range(5))
