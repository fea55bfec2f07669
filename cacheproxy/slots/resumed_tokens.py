"""A chat prompt tokenized from where an earlier prompt with the same head left off.

A template whose joints start with no special token (a vocabulary without the chat's markers)
has no cut where its text tokenizes apart (template_cuts.py), so each request's whole text
would be tokenized again, although only its end is new: a conversation's next turn repeats the
last one, a chat product's requests share a system prompt. llama.cpp's tokenizers are local in
practice (what a text ends with changes the ids of its last few tokens, not of its start), so:

- once a prompt's ids are known, they are remembered with where each token's text ends, under
  two heads: the text up to the joint before its last message (a system prompt, say) and the
  whole prompt (the next turn's head). Per tenant and model, in the mirror's memo;
- a later prompt that starts with a remembered head is tokenized again only from a few tokens
  before the head's end, at a token whose text starts with a space (where the tokenizer can
  take the text up again: llama.cpp puts a space before a SentencePiece text itself), and the
  remembered ids are kept before it only if the tokens given again agree with the remembered
  ones there (`AGREE` of them, the last one excepted: what follows may change it) and their
  texts spell the prompt's. Otherwise the whole text is tokenized.

Token texts come from the vocabulary (`token_to_piece`, memoised per id). A vocabulary whose
token texts do not spell the prompt back (special tokens in the text, a text normalised before
it is tokenized) has nothing remembered, and tokenizes whole. The proof of the rule is
empirical (the pinned tree's vocabularies and test strings, `test_resumed_tokens.py`); each
answer's prompt count is still checked against the ids made here (`TokenMirror.answered`).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import operator
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cacheproxy.slots.local_tokenizer import Vocabulary

AGREE = 3  # remembered tokens a resumed tokenization must give again (the head's last excepted)
BACK = 64  # how many tokens further back a start (a text beginning with a space) is looked for
# a scope's latest text prompts whose ends a later one is looked up at: a tenant's agents or
# users take turns between each other's (one hash of the text, a digest copy a length)
TEXT_ENDS = 32
TEXT_SCOPES = 4096  # scopes (tenant and model) whose text prompts' ends are kept


class Memo(Protocol):
    def get(self, key: bytes) -> list[int] | None: ...

    def put(self, key: bytes, tokens: list[int]) -> None: ...

    def __contains__(self, key: bytes) -> bool: ...


@dataclass(frozen=True)
class Layout:
    """How a vocabulary's prompt ids line up with the prompt's text."""

    lead: int  # ids a prompt starts with that stand for no text (BOS)
    space: int  # 1: the text is tokenized with a space put before it (SentencePiece)


@dataclass(frozen=True)
class Resume:
    start: int  # index of the first remembered id tokenized again
    offset: int  # where that id's text starts, in the spelled text (the space counted)
    text: str  # the prompt's text from there, as it is tokenized again


class Pieces:
    """Each token's text as llama.cpp writes it back (special tokens as their text)."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        # weakly: kept beside its vocabulary in a WeakKeyDictionary, it must not keep it alive
        self._piece = weakref.WeakMethod(vocabulary.token_piece)
        self._texts: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        text = self._texts.get(token)
        if text is None:
            piece = self._piece()
            assert piece is not None, "asked only while its vocabulary is in use"
            text = self._texts[token] = piece(token)
        return text

    def spell(self, ids: Sequence[int]) -> tuple[bytes, list[int]]:
        """The text of `ids` and where each id's text ends in it."""
        texts = list(map(self._texts.get, ids))
        if None in texts:  # ids not seen yet: only theirs are asked for, then all looked up again
            for token in set(ids).difference(self._texts):
                self(token)
            texts = list(map(self._texts.get, ids))
        return b"".join(texts), list(itertools.accumulate(map(len, texts)))


def layout_of(vocabulary: Vocabulary, pieces: Pieces) -> Layout | None:
    """What a prompt's ids add to its text (None: something this module does not follow, an
    EOS after the text say)."""
    whole = vocabulary.tokenize("x", True, True)
    plain = vocabulary.tokenize("x", False, True)
    lead = len(whole) - len(plain)
    if lead < 0 or whole[lead:] != plain:
        return None
    spelled, _ = pieces.spell(plain)
    if spelled not in (b"x", b" x"):
        return None
    return Layout(lead, len(spelled) - 1)


def spelled_ends(
    ids: Sequence[int], text: bytes, layout: Layout, pieces: Pieces
) -> list[int] | None:
    """Where each of a whole prompt's ids ends in its text (with the space the tokenizer put
    before it; 0 for the lead), or None if their texts do not spell the prompt's."""
    spelled, ends = pieces.spell(ids[layout.lead :])
    if spelled != b" " * layout.space + text:
        return None
    return [0] * layout.lead + ends


def plan_resume(
    ids: Sequence[int], ends: Sequence[int], text: bytes, layout: Layout, pieces: Pieces
) -> Resume | None:
    """Where to tokenize `text` again from, given the remembered ids of its head: the latest
    token leaving `AGREE` to agree before the last, whose text starts with a space."""
    latest = len(ids) - 1 - AGREE
    for start in range(latest, max(layout.lead, latest - BACK), -1):
        if not pieces(ids[start]).startswith(b" "):
            continue
        # its text starts `offset` into the spelled text, at the space; with a space put
        # before every text (layout.space), the text is taken up after it
        offset = ends[start - 1]
        try:
            return Resume(start, offset, text[offset:].decode())
        except UnicodeDecodeError:
            continue
    return None


def resumed(
    ids: Sequence[int],
    ends: Sequence[int],
    resume: Resume,
    again: Sequence[int],
    text: bytes,
    layout: Layout,
    pieces: Pieces,
) -> tuple[list[int], list[int]] | None:
    """The prompt's ids and ends: the remembered ones before `resume.start`, then `again` (the
    text tokenized from there), if `again` agrees with the remembered ones and spells the rest."""
    agree = len(ids) - 1 - resume.start
    if list(again[:agree]) != list(ids[resume.start : resume.start + agree]):
        return None
    spelled, again_ends = pieces.spell(again)
    if spelled != text[resume.offset - layout.space :]:
        return None
    # the ends shifted by a C-level map: a generator would run a Python step an id
    shifted = map(functools.partial(operator.add, resume.offset), again_ends)
    return [*ids[: resume.start], *again], [*ends[: resume.start], *shifted]


def head_keys(scope: bytes, parts: Sequence[str]) -> tuple[bytes, list[tuple[int, bytes]]]:
    """The prompt's text and, for each head (the text up to each joint after a message, the
    whole prompt last), its length and memo key. `parts`: joint, content, joint, ..., joint."""
    digest = hashlib.blake2b(scope)
    encoded = [part.encode() for part in parts]
    heads = []
    length = 0
    for index, part in enumerate(encoded):
        digest.update(part)
        length += len(part)
        if index % 2 == 0 and index > 0:
            heads.append((length, digest.copy().digest()))
    return b"".join(encoded), heads


def remembered(ids: Sequence[int], ends: Sequence[int], length: int) -> list[int]:
    """The ids whose texts end within the first `length` bytes of the spelled text, and their
    ends, as one list (ids, then ends) for the memo."""
    count = bisect.bisect_right(ends, length)
    return [*ids[:count], *ends[:count]]


TokenizeText = Callable[[str], Awaitable[list[int] | None]]  # a text after the first (None: no)


class ResumedTokens:
    """Chat prompts tokenized from their remembered heads (module doc). `memo`: where heads are
    remembered (bounded; keys carry the tenant and model in `scope`)."""

    def __init__(self, memo: Memo) -> None:
        self.memo = memo
        self._layouts: weakref.WeakKeyDictionary[Vocabulary, tuple[Layout | None, Pieces]] = (
            weakref.WeakKeyDictionary()
        )
        self.resumed = 0  # prompts tokenized from a remembered head
        self.declined = 0  # remembered heads the text tokenized again disagreed with
        # by scope, the lengths (characters) of its latest text prompts, least recent scope first
        self._text_ends: OrderedDict[bytes, deque[int]] = OrderedDict()

    def text_parts(self, scope: bytes, text: str) -> list[str]:
        """A text prompt (no template) as `tokens` takes it: cut after the longest of the
        scope's latest text prompts it starts with whose ids are remembered, so that it is
        taken up from there. Its joints are empty: the head's key is that prompt's own."""
        lengths = sorted({n for n in self._text_ends.get(scope, ()) if 0 < n < len(text)})
        digest, done, keys = hashlib.blake2b(scope), 0, []
        for length in lengths:  # one pass over the text, a key at each end
            digest.update(text[done:length].encode())
            done = length
            keys.append(digest.copy().digest())
        for length, key in zip(reversed(lengths), reversed(keys), strict=True):
            if key in self.memo:
                return ["", text[:length], "", text[length:], ""]
        return ["", text, ""]

    def text_seen(self, scope: bytes, text: str) -> None:
        """`text` was tokenized as a text prompt of `scope` (`text_parts` looks at its end)."""
        ends = self._text_ends.pop(scope, None) or deque(maxlen=TEXT_ENDS)
        if len(text) not in ends:
            ends.append(len(text))
        self._text_ends[scope] = ends
        while len(self._text_ends) > TEXT_SCOPES:
            self._text_ends.popitem(last=False)

    async def tokens(
        self,
        vocabulary: Vocabulary,
        scope: bytes,
        parts: Sequence[str],
        tokenize_again: TokenizeText,
        tokenize_whole: Callable[[], Awaitable[list[int]]],
        keep_below: int | None = None,
    ) -> list[int]:
        """The ids of the prompt `parts` spell (joint, content, joint, ..., joint), from a
        remembered head where one agrees, else from `tokenize_whole`; its heads are remembered
        for the prompts after it, unless it has `keep_below` ids or more."""
        layout, pieces = self._layout(vocabulary)
        if layout is None:
            return await tokenize_whole()
        text, heads = head_keys(scope, parts)
        found, resumed_from = None, None
        for _, key in reversed(heads):
            entry = self.memo.get(key)
            if entry is not None:
                found = await self._from_head(entry, text, layout, pieces, tokenize_again)
                resumed_from = None if found is None else key
                break
        if found is None:
            ids = await tokenize_whole()
            ends = spelled_ends(ids, text, layout, pieces)
        else:
            ids, ends = found
        if ends is not None and (keep_below is None or len(ids) < keep_below):
            # before the last message, and the whole (not the head resumed from: it is as it was)
            for length, head in heads[-2:]:
                if head == resumed_from:
                    continue
                entry = remembered(ids, ends, length + layout.space)
                if len(entry) // 2 > layout.lead + AGREE + 1:
                    self.memo.put(head, entry)
        return ids

    async def _from_head(
        self,
        entry: list[int],
        text: bytes,
        layout: Layout,
        pieces: Pieces,
        tokenize_again: TokenizeText,
    ) -> tuple[list[int], list[int]] | None:
        half = len(entry) // 2
        ids, ends = entry[:half], entry[half:]
        resume = plan_resume(ids, ends, text, layout, pieces)
        if resume is None:
            return None
        again = await tokenize_again(resume.text)
        if again is None:
            return None
        found = resumed(ids, ends, resume, again, text, layout, pieces)
        if found is None:
            self.declined += 1
        else:
            self.resumed += 1
        return found

    def _layout(self, vocabulary: Vocabulary) -> tuple[Layout | None, Pieces]:
        known = self._layouts.get(vocabulary)
        if known is None:
            pieces = Pieces(vocabulary)
            known = self._layouts[vocabulary] = (layout_of(vocabulary, pieces), pieces)
        return known
