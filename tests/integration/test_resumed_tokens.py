"""Prompts tokenized from a remembered head (resumed_tokens.py) differentially against whole
tokenization, with every vocabulary of the pinned llama.cpp tree (`models/ggml-vocab-*.gguf`,
loaded vocabulary-only as the proxy loads an upstream's model file): conversations of the tree's
own tokenizer test strings and of random text, joined by joints of every kind (none, spaces,
newlines, letters, markup), turn after turn. Every prompt must be the whole text's ids; most
later turns must be taken up from the turn before."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from cacheproxy.slots.local_tokenizer import Vocabulary, load_vocabulary
from cacheproxy.slots.resumed_tokens import ResumedTokens, head_keys
from cacheproxy.slots.token_memo import MemoOfTokens
from tests.support.vocab_cases import tokenizer_cases, vocabularies_with_expected_ids

pytestmark = pytest.mark.integration

VOCABULARIES = vocabularies_with_expected_ids()
CASES = [case for case in tokenizer_cases() if case.strip()]
# random text: letters, digits, punctuation, runs of whitespace, other scripts, emoji
ALPHABET = [
    *"aaabcdeeefghiiklmnoopqrstuuvwxyz   \n\n\t0123456789.,;:!?'\"()[]{}<>-_=+*/\\",
    *("é", "日本", "🦙", "ñ", "\u00a0", "  ", "   ", "Ελληνικά"),
]
JOINTS = ("", " ", "\n", "x", ":", "##", "a b", "é", "  ", "\n### User:\n", "<|im_end|>\n")
CONVERSATIONS = 60
TURNS = 4


def conversations(seed: int) -> list[list[list[str]]]:
    """Each conversation's prompts, turn after turn, as parts (joint, content, ..., joint)."""
    rng = random.Random(seed)

    def content() -> str:
        if rng.random() < 0.3:
            return rng.choice(CASES)
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))

    made = []
    for _ in range(CONVERSATIONS):
        joints = [rng.choice(JOINTS) for _ in range(TURNS + 4)]
        contents = [content() for _ in range(2)]
        prompts = []
        for _ in range(TURNS):
            parts = []
            for index, text in enumerate(contents):
                parts += [joints[index], text]
            prompts.append([*parts, joints[len(contents)]])
            contents.append(content())
        made.append(prompts)
    return made


async def tokenized(
    resumed: ResumedTokens, vocabulary: Vocabulary, tenant: str, parts: list[str]
) -> tuple[list[int], list[int]]:
    """(the prompt's ids made from a remembered head where one is known, the whole text's)."""
    whole = vocabulary.tokenize("".join(parts), True, True)

    async def again(text: str) -> list[int]:
        return vocabulary.tokenize(text, False, True)

    async def tokenize_whole() -> list[int]:
        return whole

    return await resumed.tokens(vocabulary, tenant.encode(), parts, again, tokenize_whole), whole


@pytest.mark.parametrize("vocabulary_file", VOCABULARIES, ids=lambda path: path.stem)
def test_resumed_prompts_are_the_whole_texts_ids(vocabulary_file: Path) -> None:
    vocabulary = load_vocabulary(vocabulary_file)
    if vocabulary is None:
        pytest.fail(f"{vocabulary_file.name} does not load: the in-process tokenizer refuses it")
    resumed = ResumedTokens(MemoOfTokens(1 << 26))

    async def run() -> None:
        for prompts in conversations(seed=len(vocabulary_file.name)):
            for parts in prompts:
                ids, whole = await tokenized(resumed, vocabulary, "t", parts)
                assert ids == whole, "".join(parts)[-120:]

    asyncio.run(run())
    later_turns = CONVERSATIONS * (TURNS - 1)
    print(f"{vocabulary_file.stem}: {resumed.resumed} of {later_turns} later turns resumed")
    if vocabulary_file.stem == "ggml-vocab-bert-bge":
        # WordPiece writes no spaces back: nothing is remembered, every text tokenized whole
        assert resumed.resumed == 0
    else:
        assert resumed.resumed >= 0.9 * later_turns


def spm_vocabulary() -> Vocabulary:
    path = next(path for path in VOCABULARIES if path.stem == "ggml-vocab-llama-spm")
    vocabulary = load_vocabulary(path)
    assert vocabulary is not None
    return vocabulary


def test_a_remembered_head_that_disagrees_is_not_used() -> None:
    """A head remembered with ids the text tokenized again does not give (as if what followed
    it had changed them) is declined: the whole text is tokenized."""
    vocabulary = spm_vocabulary()
    memo = MemoOfTokens(1 << 26)
    resumed = ResumedTokens(memo)
    first = ["Q: ", "what do the words of a long question tell us about it", "\nA: "]
    second = [*first, "they tell a lot", "\nQ: "]

    async def run() -> None:
        await tokenized(resumed, vocabulary, "t", first)
        # the whole first prompt is remembered as the second one's head: alter its ids there
        _, heads = head_keys(b"t", second)
        key = heads[0][1]
        entry = memo.get(key)
        assert entry is not None
        half = len(entry) // 2
        entry[half - 3] += 1  # a remembered id the text tokenized again must agree with
        memo.put(key, entry)
        ids, whole = await tokenized(resumed, vocabulary, "t", second)
        assert ids == whole

    asyncio.run(run())
    assert (resumed.resumed, resumed.declined) == (0, 1)


def test_a_text_its_ids_do_not_spell_back_is_tokenized_whole() -> None:
    """SentencePiece puts a space after a special token parsed in the text: its ids no longer
    spell the text, so nothing of it is remembered, and every turn is tokenized whole."""
    vocabulary = spm_vocabulary()
    resumed = ResumedTokens(MemoOfTokens(1 << 26))
    contents = ["a system prompt of some words", "<s> a question after a BOS text"]

    async def run() -> None:
        for turn in range(3):
            parts = ["### "]
            for text in contents:
                parts += [text, "\n### "]
            ids, whole = await tokenized(resumed, vocabulary, "t", parts)
            assert ids == whole
            contents.append(f"the answer of turn {turn}")

    asyncio.run(run())
    assert resumed.resumed == 0


def test_heads_are_remembered_per_scope() -> None:
    """A tenant finds nothing another one's prompts left (the scope is in every key)."""
    vocabulary = spm_vocabulary()
    resumed = ResumedTokens(MemoOfTokens(1 << 26))
    parts = ["System: ", "the same long system prompt for every tenant here", "\nUser: "]

    async def run() -> None:
        await tokenized(resumed, vocabulary, "a", [*parts, "first", "\nAssistant: "])
        await tokenized(resumed, vocabulary, "b", [*parts, "second", "\nAssistant: "])
        assert resumed.resumed == 0
        await tokenized(resumed, vocabulary, "a", [*parts, "third", "\nAssistant: "])
        assert resumed.resumed == 1

    asyncio.run(run())
