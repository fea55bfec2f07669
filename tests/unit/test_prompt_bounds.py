"""Prompt bounds: every place a task body may carry token ids is checked, before any work."""

from __future__ import annotations

import pickle

import orjson
import pytest

from cacheproxy.slots.prompt_bounds import (
    EXCEED_CONTEXT,
    INVALID_TOKENS,
    PromptLimits,
    RequestRejected,
    check_task_body,
    parse_and_check,
    text_token_ceiling,
)

LIMITS = PromptLimits(n_vocab=32000, n_ctx=4096)
BAD_IDS = [2**40, 1e300, True, -1, 32000, None, [5], {"a": 1}]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
@pytest.mark.parametrize(
    ("path", "make_body"),
    [
        ("/completion", lambda bad: {"prompt": [1, 2, bad]}),
        ("/completion", lambda bad: {"prompt": [bad, 1]}),
        ("/v1/completions", lambda bad: {"prompt": ["text", 5, bad]}),
        ("/completions", lambda bad: {"prompt": [[1, 2], [3, bad]]}),
        ("/completion", lambda bad: {"prompt": {"prompt_string": ["a", 1, bad]}}),
        ("/infill", lambda bad: {"prompt": [1, bad], "input_prefix": "a", "input_suffix": "b"}),
        ("/infill", lambda bad: {"input_prefix": ["a", 1, bad], "input_suffix": "b"}),
        ("/infill", lambda bad: {"input_prefix": "a", "input_suffix": [7, bad]}),
        ("/embedding", lambda bad: {"content": [1, bad]}),
        ("/v1/embeddings", lambda bad: {"input": [[1, 2], [bad, 3]]}),
    ],
)
def test_an_invalid_id_anywhere_is_refused(path: str, make_body, bad: object) -> None:  # noqa: ANN001
    with pytest.raises(RequestRejected) as caught:
        check_task_body(path, make_body(bad), LIMITS)
    assert caught.value.message == INVALID_TOKENS
    assert caught.value.error_type == "invalid_request_error"


@pytest.mark.parametrize("bad", [2**40, 1e300, True, -3])
def test_a_lone_number_or_a_batch_of_numbers_is_refused(bad: object) -> None:
    for prompt in (bad, [bad], ["text", [bad]]):
        with pytest.raises(RequestRejected):
            check_task_body("/completion", {"prompt": prompt}, LIMITS)


@pytest.mark.parametrize(
    "prompt",
    [
        "plain text",
        [1, 2, 31999],
        [0],
        ["text", 5, "more", 7],
        [12, "text after an id", 34],  # mixed, read as one prompt by llama-server
        [[1, 2], "text", ["a", 3]],
        {"prompt_string": "text"},
    ],
    ids=repr,
)
def test_valid_prompts_pass(prompt: object) -> None:
    check_task_body("/completion", {"prompt": prompt}, LIMITS)
    check_task_body("/embedding", {"content": prompt}, LIMITS)


def test_chat_messages_and_other_routes_are_not_read_for_ids() -> None:
    check_task_body(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "prompt": [2**40]},
        LIMITS,
    )
    check_task_body("/rerank", {"query": "q", "documents": ["a"]}, LIMITS)


def test_infill_extra_context_must_be_text() -> None:
    for extra in ([{"text": 5}], [{"text": "a", "filename": 1}], [3], {"text": "a"}):
        with pytest.raises(RequestRejected):
            check_task_body("/infill", {"input_extra": extra}, LIMITS)
    check_task_body("/infill", {"input_extra": [{"text": "a", "filename": "f.py"}]}, LIMITS)


def test_unknown_vocabulary_still_refuses_what_is_no_int32_id() -> None:
    unknown = PromptLimits()
    check_task_body("/completion", {"prompt": [10**6]}, unknown)
    with pytest.raises(RequestRejected):
        check_task_body("/completion", {"prompt": [2**40]}, unknown)


def test_an_id_prompt_over_the_context_is_refused_as_llama_server_does() -> None:
    check_task_body("/completion", {"prompt": [1] * 4095}, LIMITS)
    for prompt, n in (([1] * 4096, 4096), ([[1, 2], [1] * 5000], 5000)):
        with pytest.raises(RequestRejected) as caught:
            check_task_body("/completion", {"prompt": prompt}, LIMITS)
        rejected = caught.value
        assert rejected.error_type == EXCEED_CONTEXT
        assert rejected.fields == {"n_prompt_tokens": n, "n_ctx": 4096}
        assert rejected.message == (
            f"request ({n} tokens) exceeds the available context size (4096 tokens),"
            " try increasing it"
        )


def test_parse_and_check_refuses_bad_json_without_carrying_the_body() -> None:
    for body in (b"{nope", b"[1, 2]"):
        with pytest.raises(RequestRejected) as caught:
            parse_and_check(body, "/completion", LIMITS)
        # it crosses a process boundary: it must pickle, and small
        assert len(pickle.dumps(caught.value)) < 1000
    assert parse_and_check(orjson.dumps({"prompt": [1, 2]}), "/completion", LIMITS) == {
        "prompt": [1, 2]
    }


def test_rejection_pickles_with_its_fields() -> None:
    rejected = RequestRejected("m", "exceed_context_size_error", {"n_ctx": 3})
    again = pickle.loads(pickle.dumps(rejected))
    assert (again.message, again.fields) == ("m", {"n_ctx": 3})
    assert again.error_type == rejected.error_type


def test_text_token_ceiling_bounds_every_utf8_text() -> None:
    for text in ("", "a", "é" * 10, "漢字", "🙂"):
        assert text_token_ceiling(text) >= len(text.encode()) + 1


def test_a_text_far_over_the_context_is_refused_without_tokenizing() -> None:
    fits = "x" * (1024 * 4095)  # the floor allows it: the mirror tokenizes and counts
    check_task_body("/completion", {"prompt": fits}, LIMITS)
    for prompt in ("x" * (1024 * 4096), ["x" * (1024 * 4000), *range(96)], [["y" * 2**23]]):
        with pytest.raises(RequestRejected) as caught:
            check_task_body("/completion", {"prompt": prompt}, LIMITS)
        floor = caught.value.fields["n_prompt_tokens"]
        assert floor >= 4096
        assert caught.value.message.startswith(f"request (at least {floor} tokens) exceeds")
