"""What of a big body the proxy keeps: every small member, and the big ones it reads."""

from __future__ import annotations

from cacheproxy.slots.read_fields import LEFT_IN_FILE_BYTES, leave_in_file

BIG = "x" * LEFT_IN_FILE_BYTES
BIG_LIST = [BIG]


def test_a_big_member_the_completion_route_never_reads_stays_in_the_file() -> None:
    document = {"prompt": BIG, "n_predict": 1, "padding": BIG, "grammar": BIG, "stop": ["a"]}
    kept, left = leave_in_file("/completion", document)
    assert kept == {"prompt": BIG, "n_predict": 1, "stop": ["a"]}
    assert left == {"padding", "grammar"}


def test_small_members_are_kept_whatever_their_name() -> None:
    document = {"padding": "x" * (LEFT_IN_FILE_BYTES - 1), "id_slot": 3, "n": 2}
    assert leave_in_file("/completion", document) == (document, frozenset())


def test_chat_keeps_what_its_template_reads() -> None:
    document = {"messages": BIG_LIST, "tools": BIG_LIST, "json_schema": {"a": BIG}, "pad": BIG}
    kept, left = leave_in_file("/v1/chat/completions", document)
    assert set(kept) == {"messages", "tools", "json_schema"} and left == {"pad"}


def test_infill_and_embeddings_keep_their_prompt_fields() -> None:
    infill = {"input_prefix": BIG, "input_suffix": BIG, "input_extra": BIG_LIST, "prompt": BIG}
    assert leave_in_file("/infill", infill)[1] == frozenset()
    assert leave_in_file("/v1/embeddings", {"input": BIG, "x": BIG})[1] == {"x"}


def test_a_body_converted_whole_keeps_everything() -> None:
    document = {"messages": BIG_LIST, "pad": BIG}
    for path in ("/v1/messages", "/v1/responses", "/responses"):
        assert leave_in_file(path, document) == (document, frozenset())
