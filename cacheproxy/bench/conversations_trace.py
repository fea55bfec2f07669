"""The conversations trace, as pure data: recorded conversations picked by a seed, each replayed
as `/v1/chat/completions` requests behind one shared system prompt.

Turn k of a conversation sends its first 2k+1 utterances as user/assistant messages: the history
is the recorded answers, not the model's, so every arm sends exactly the same prompts whatever
its server generated, and the tokens each arm decoded are comparable request for request. The
system prompt is one product's: an assistant's instructions, the same for every conversation,
as a deployed chat product puts in front of each of its users' chats. No I/O here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cacheproxy.bench.agents_trace import sentences
from cacheproxy.bench.conversations_corpus import RecordedConversation

# Latin-script languages by default: each word a token or two in the test model's vocabulary
# (other scripts fall back to byte tokens, several per character).
DEFAULT_LANGUAGES = ("english", "spanish", "italian")


@dataclass(frozen=True)
class ConversationsSpec:
    """What to replay: `conversations` picked from `languages`, behind a system prompt of
    `system_words` words (0: none), answers of at most `answer_tokens` tokens."""

    conversations: int = 24
    languages: tuple[str, ...] = DEFAULT_LANGUAGES
    system_words: int = 300
    answer_tokens: int = 16

    def __post_init__(self) -> None:
        if self.conversations < 1:
            raise ValueError(f"conversations must be at least 1, not {self.conversations}")
        if not self.languages:
            raise ValueError("give at least one language")
        if self.system_words < 0:
            raise ValueError(f"system_words must not be negative, not {self.system_words}")
        if self.answer_tokens < 1:
            raise ValueError(f"answer_tokens must be at least 1, not {self.answer_tokens}")


@dataclass(frozen=True)
class ConversationsTrace:
    """What every arm replays: the shared system prompt and the conversations, in the order
    the clients start them."""

    system: str
    conversations: tuple[RecordedConversation, ...]

    @property
    def requests(self) -> int:
        return sum(conversation.turns for conversation in self.conversations)


def pick_conversations(
    corpus: Sequence[RecordedConversation], count: int, seed: int
) -> list[RecordedConversation]:
    """`count` different conversations drawn by `seed`, in the order they are drawn (the order
    the clients start them)."""
    if count > len(corpus):
        raise ValueError(f"{count} conversations asked for, the corpus has {len(corpus)}")
    ordered = sorted(corpus, key=lambda conversation: conversation.name)
    return random.Random(f"{seed}/conversations").sample(ordered, count)


def system_prompt(words: int, seed: int) -> str:
    """The product's instructions: a fixed opening, then `words` words drawn by `seed`."""
    if words == 0:
        return ""
    header = (
        "You are the assistant of an online help desk. You answer the user's messages briefly"
        " and politely, in the language they write in. Rules of the service:"
    )
    return header + " " + sentences(random.Random(f"{seed}/system"), words)


def turn_messages(
    conversation: RecordedConversation, turn: int, system: str
) -> list[dict[str, Any]]:
    """Request `turn` (0-based) of `conversation`: the system prompt (if any), then its first
    2 * turn + 1 utterances, alternately the user's and the assistant's."""
    if not 0 <= turn < conversation.turns:
        raise ValueError(f"{conversation.name} has {conversation.turns} turns, not turn {turn}")
    messages = [{"role": "system", "content": system}] if system else []
    for index, text in enumerate(conversation.utterances[: 2 * turn + 1]):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return messages


def full_text(conversation: RecordedConversation, system: str) -> str:
    """Everything its last request carries (without the template's markers): what a context
    check tokenizes."""
    last = turn_messages(conversation, conversation.turns - 1, system)
    return "\n".join(message["content"] for message in last)
