"""Where a learnt chat template's prompts may be cut for tokenizing: before the joints that start
with a special token.

llama-server tokenizes a prompt (special tokens parsed) by first splitting its text at the
special tokens, then tokenizing each piece of plain text between them on its own
(llama-vocab.cpp, tokenizer_st_partition): the ids of `A + J + B`, where `J` starts with a special
token, are the ids of `A` followed by those of `J + B`. A joint is a cut only if the server shows
it so: its first token is one the plain text would not give (a special token, parsed), and put
after texts a message may end with (letters, spaces, newlines, the first characters of a
special token's text, other scripts) it tokenizes apart from them. Then whole conversations of
real text must tokenize to the same ids whole and in segments. What is learnt here is checked
again on every answer (the server's prompt count against the ids made here,
`TemplatesOfUpstreams.forget`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence

from cacheproxy.slots.chat_template import CHECKS, LearntTemplate, conversation

# (text, add_special, parse_special) -> ids, as the server's POST /tokenize gives them
Tokenize = Callable[[str, bool, bool], Awaitable[list[int]]]

# what the text before a joint may end with
ENDINGS = ("Hello", "Hello ", "end.\n", "end.\n\n", " \t", "<", "<|", "日本語", "{x}")


async def learn_cuts(template: LearntTemplate, tokenize: Tokenize) -> frozenset[str]:
    """The joints of `template` before which its prompts tokenize apart (none: tokenized whole)."""
    joints = sorted({text for text in (*template.join.values(), *template.end.values()) if text})
    endings = {text: await tokenize(text, False, True) for text in ENDINGS}
    cuts = set()
    for joint in joints:
        ids = await tokenize(joint, False, True)
        plain = await tokenize(joint, False, False)
        if not ids or (plain and plain[0] == ids[0]):
            continue  # it does not start with a special token the server parses
        for ending, ending_ids in endings.items():
            if await tokenize(ending + joint, False, True) != ending_ids + ids:
                break
        else:
            cuts.add(joint)
    if not cuts:
        return frozenset()
    cut = dataclasses.replace(template, cuts=frozenset(cuts))
    for pairs in CHECKS:
        segments = cut.segments({"messages": conversation(pairs)})
        if segments is None or await tokenize("".join(segments), True, True) != (
            await segment_ids(segments, tokenize)
        ):
            return frozenset()
    return frozenset(cuts)


async def segment_ids(segments: Sequence[str], tokenize: Tokenize) -> list[int]:
    """The ids of a prompt cut in `segments`: the first with BOS (as the whole would have
    it), the others as they are."""
    ids: list[int] = []
    for index, segment in enumerate(segments):
        ids += await tokenize(segment, index == 0, True)
    return ids
