"""Huge id prompts refused from their bytes: only when certain, and then exactly as the full parse
and check refuse them, without a Python object per id."""

from __future__ import annotations

import mmap
import tracemalloc
from pathlib import Path

import orjson
import pytest

from cacheproxy.slots.huge_prompt import refuse_huge_id_prompt
from cacheproxy.slots.prompt_bounds import PromptLimits, RequestRejected, parse_and_check

LIMITS = PromptLimits(n_vocab=32000, n_ctx=4096)
IDS = b",".join(str(i).encode() for i in range(5000))  # over the context, every id valid


def full_verdict(body: bytes, path: str = "/completion") -> tuple | None:
    try:
        parse_and_check(body, path, LIMITS)
    except RequestRejected as rejected:
        return rejected.message, rejected.error_type, rejected.fields
    return None


def fast_verdict(body: bytes, path: str = "/completion") -> tuple | None:
    refusal = refuse_huge_id_prompt(body, path, LIMITS)
    return None if refusal is None else (refusal.message, refusal.error_type, refusal.fields)


# bodies the bytes decide: the refusal is the full check's
DECIDED = {
    "plain": b'{"prompt":[' + IDS + b'],"n_predict":1}',
    "after other members": orjson.dumps(
        {"n_predict": 1, "stop": ["a,b"], "prompt": list(range(5000))}
    ),
    "a space after each comma": b'{"prompt": [ ' + IDS.replace(b",", b", ") + b" ]}",
    "the key escaped": b'{"\\u0070rompt":[' + IDS + b"]}",
    "an id past the vocabulary, last": orjson.dumps({"prompt": [*range(5000), 32000]}),
    "over several blocks": orjson.dumps({"prompt": [7] * 600_000}),
    "an invalid id in a later block": orjson.dumps({"prompt": [*[7] * 600_000, 40000]}),
}
# bodies the bytes do not decide: left to the full parse (whatever it says)
UNDECIDED = {
    "a later prompt wins": orjson.dumps({"prompt": list(range(5000))})[:-1] + b',"prompt":"hi"}',
    "the array in a string": orjson.dumps({"x": str(list(range(5000))), "prompt": "hi"}),
    "not at the top level": orjson.dumps({"a": {"prompt": list(range(5000))}}),
    "a batch": orjson.dumps({"prompt": [list(range(5000)), [1]]}),
    "newlines": b'{"prompt":[\n' + IDS.replace(b",", b",\n") + b"\n]}",
    "a leading zero": b'{"prompt":[01,' + IDS + b"]}",
    "a sign": b'{"prompt":[+1,' + IDS + b"]}",
    "a negative id": b'{"prompt":[-1,' + IDS + b"]}",
    "a float": b'{"prompt":[1.0,' + IDS + b"]}",
    "an empty element": b'{"prompt":[1,,' + IDS + b"]}",
    "a trailing comma": b'{"prompt":[' + IDS + b",]}",
    "invalid JSON after it": b'{"prompt":[' + IDS + b'],"x":}',
    "a short prompt": orjson.dumps({"prompt": list(range(100))}),
    # numpy's parser stops at int64: the digits are not known to be JSON's
    "an id past int64": b'{"prompt":[' + IDS + b",99999999999999999999999]}",
}


@pytest.mark.parametrize("name", DECIDED)
def test_a_huge_id_prompt_is_refused_as_the_full_check_refuses_it(name: str) -> None:
    body = DECIDED[name]
    assert fast_verdict(body) is not None
    assert fast_verdict(body) == full_verdict(body)


@pytest.mark.parametrize("name", UNDECIDED)
def test_what_the_bytes_do_not_decide_is_left_to_the_parse(name: str) -> None:
    assert fast_verdict(UNDECIDED[name]) is None


def test_only_completion_routes_are_bounded_by_the_context() -> None:
    body = DECIDED["plain"]
    assert fast_verdict(body, "/v1/chat/completions") is None
    assert fast_verdict(body, "/embedding") is None
    assert refuse_huge_id_prompt(body, "/completion", PromptLimits(32000, None)) is None


def test_a_spilled_file_is_read_through_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "body"
    path.write_bytes(DECIDED["over several blocks"])
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
        refusal = refuse_huge_id_prompt(m, "/completion", LIMITS)
    assert refusal is not None and refusal.fields["n_prompt_tokens"] == 600_000


def test_the_refusal_holds_no_object_per_id() -> None:
    """2 million ids parsed are some 70 MB of Python ints and list; refused from the bytes,
    what is allocated at once stays within a few blocks."""
    body = orjson.dumps({"prompt": [10000 + i % 20000 for i in range(2_000_000)]})
    refuse_huge_id_prompt(b'{"prompt":[' + IDS + b"]}", "/completion", LIMITS)  # numpy imported
    tracemalloc.start()
    try:
        refusal = refuse_huge_id_prompt(body, "/completion", LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refusal is not None and refusal.fields["n_prompt_tokens"] == 2_000_000
    assert peak < 16 << 20, peak
