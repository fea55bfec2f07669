"""Where a learnt template's prompts are cut for tokenizing, learnt from the server's answers."""

from __future__ import annotations

import asyncio
import dataclasses
import re

from cacheproxy.slots.chat_template import LearntTemplate, learn_template
from cacheproxy.slots.template_cuts import Tokenize, learn_cuts, segment_ids

SPECIAL = {"<|im_start|>": 1000, "<|im_end|>": 1001}
BOS = 1
WORD = re.compile(r"\w+|\s+|[^\w\s]+")  # punctuation runs merge: "<|" across a joint would


def plain_ids(text: str) -> list[int]:
    return [hash(piece) % 997 + 2 for piece in WORD.findall(text)]


def partitioning(strip_before_special: bool = False, specials: bool = True) -> Tokenize:
    """A tokenizer as llama-server's: special tokens split out first (if `specials`), each
    piece of text between them tokenized on its own; `strip_before_special`: whitespace
    before a special token is dropped (a token with lstrip)."""

    async def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
        ids = [BOS] if add_special else []
        if not (parse_special and specials):
            return ids + plain_ids(text)
        for piece in re.split("(" + "|".join(map(re.escape, SPECIAL)) + ")", text):
            if piece in SPECIAL:
                if strip_before_special and ids and ids[-1] == plain_ids(" ")[0]:
                    ids.pop()
                ids.append(SPECIAL[piece])
            elif piece:
                ids += plain_ids(piece)
        return ids

    return tokenize


def chatml_template() -> LearntTemplate:
    async def render(messages: list[dict]) -> str:
        body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return body + "<|im_start|>assistant\n"

    template = asyncio.run(learn_template("'<|im_start|>'", "<s>", "</s>", render))
    assert template is not None
    return template


def test_joints_starting_with_a_special_token_are_cuts_and_segments_give_the_whole_ids() -> None:
    template = chatml_template()
    tokenize = partitioning()
    cuts = asyncio.run(learn_cuts(template, tokenize))
    assert cuts == {
        "<|im_end|>\n<|im_start|>" + role + "\n" for role in ("system", "user", "assistant")
    }
    cut = dataclasses.replace(template, cuts=cuts)
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2? "},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And <|3 + 3?"},
        ]
    }
    segments = cut.segments(body)
    assert segments is not None and "".join(segments) == template.render(body)
    assert segments[0] == "<|im_start|>system\nBe brief."
    assert segments[-1] == "<|im_end|>\n<|im_start|>assistant\n"
    assert len(segments) == 5
    whole = asyncio.run(tokenize("".join(segments), True, True))
    assert asyncio.run(segment_ids(segments, tokenize)) == whole
    # without cuts, one segment: the whole text
    assert template.segments(body) == [template.render(body)]


def test_no_cut_where_the_server_does_not_tokenize_apart() -> None:
    template = chatml_template()
    # the markers are plain text to this vocabulary: "<|" merges with what stands before
    assert asyncio.run(learn_cuts(template, partitioning(specials=False))) == frozenset()
    # a special token that eats the whitespace before it: the text before it is not its own
    assert asyncio.run(learn_cuts(template, partitioning(strip_before_special=True))) == frozenset()
