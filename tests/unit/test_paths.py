"""The canonical path: one form per path llama-server would serve, or a refusal."""

from __future__ import annotations

import pytest

from cacheproxy.http.paths import UnsafePath, canonical_path, canonical_target

CANONICAL = [
    ("/slots", "/slots"),
    ("/", "/"),
    ("/./slots", "/slots"),
    ("/v1/../slots", "/slots"),
    ("/../../slots", "/slots"),  # above the root stays at the root (RFC 3986 5.2.4)
    ("/a/b/../../slots/.", "/slots"),
    ("//slots", "/slots"),
    ("/slots//", "/slots"),
    ("/slots/", "/slots"),
    ("/slots/0/", "/slots/0"),
    ("/slots/0//", "/slots/0"),
    ("/slots/%30", "/slots/0"),
    ("/%73lots", "/slots"),
    ("/%73%6C%6F%74%73", "/slots"),
    ("/%73%6c%6f%74%73", "/slots"),
    ("/v1/chat%2Dcompletions", "/v1/chat-completions"),
    ("/%7e", "/~"),
    ("/a%3ab", "/a%3Ab"),  # reserved: stays encoded, in upper case
    ("/a:b@c;d=e", "/a:b@c;d=e"),
    ("/caf\u00e9", "/caf%C3%A9"),
    ("/a%20b", "/a%20b"),
    ("/...", "/..."),  # not a dot segment
    ("/.a/..b", "/.a/..b"),
]


@pytest.mark.parametrize(("path", "expected"), CANONICAL)
def test_canonical_form(path: str, expected: str) -> None:
    assert canonical_path(path) == expected


@pytest.mark.parametrize(("path", "expected"), CANONICAL)
def test_canonical_form_is_a_fixed_point(path: str, expected: str) -> None:
    assert canonical_path(expected) == expected


REFUSED = [
    "/slots%2F",
    "/slots%2f0",
    "/%2Fslots",
    "/slots%5C0",
    "/slots\\0",
    "/slots/%2530",  # llama-server decodes path parameters twice
    "/slots%00",
    "/slots\x00",
    "/slots%0A",
    "/slots%7F",
    "/%2e/slots",
    "/%2E/slots",
    "/v1/%2e%2e/slots",
    "/v1/.%2E/slots",
    "/v1/%2E./slots",
    "/%u0073lots",  # httplib's %uXXXX
    "/slots%",
    "/slots%3",
    "/slots%zz",
    "slots",
    "*",
    "http://127.0.0.1/slots",
]


@pytest.mark.parametrize("path", REFUSED)
def test_refused(path: str) -> None:
    with pytest.raises(UnsafePath):
        canonical_path(path)


def test_query_kept_as_is_and_not_read_as_path() -> None:
    assert canonical_target("/./slots/0?action=save&x=/../%2F") == "/slots/0?action=save&x=/../%2F"
    assert canonical_target("/slots?") == "/slots?"
    assert canonical_target("/slots%3Faction=save") == "/slots%3Faction=save"


def test_fragment_refused() -> None:
    with pytest.raises(UnsafePath):
        canonical_target("/completion#/../slots")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/slots/0", "/%2e%2e/slots"])
def test_long_and_short_paths_get_the_same_answer_every_time(path: str) -> None:
    # short paths' canonical forms are remembered; a refusal is never remembered as an answer
    for candidate in (path, path + "/x" * 200):
        outcomes = []
        for _ in range(3):
            try:
                outcomes.append(canonical_path(candidate))
            except UnsafePath:
                outcomes.append("refused")
        assert len(set(outcomes)) == 1
    assert canonical_path("/v1/./chat//completions/") == "/v1/chat/completions"
