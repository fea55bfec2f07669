"""The conversations trace: read from the installed chatterbot-corpus, picked by seed, each turn
the recorded history up to a user's utterance behind one shared system prompt; and the turns
handed out round-robin, each conversation with its own count."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cacheproxy.bench.cache_bench import RoundRobinTurns
from cacheproxy.bench.conversations_bench import ConversationsBenchConfig, build_trace
from cacheproxy.bench.conversations_corpus import (
    corpus_languages,
    file_conversations,
    load_conversations,
)
from cacheproxy.bench.conversations_trace import (
    ConversationsSpec,
    pick_conversations,
    system_prompt,
    turn_messages,
)


def test_the_corpus_is_read_with_its_multi_turn_conversations_only() -> None:
    assert {"english", "spanish", "italian"} <= set(corpus_languages())
    english = load_conversations(("english",))
    assert len(english) > 50
    assert all(len(conversation.utterances) >= 3 for conversation in english)
    assert all(conversation.language == "english" for conversation in english)
    assert len({conversation.name for conversation in english}) == len(english)
    # the corpus's first English conversation file, as the package ships it
    greeting = next(c for c in english if c.name == "english/conversations/0")
    assert greeting.utterances[0] == "Good morning, how are you?"
    both = load_conversations(("english", "spanish"))
    assert {c.language for c in both} == {"english", "spanish"} and len(both) > len(english)


def test_short_and_unreadable_conversations_are_left_out() -> None:
    text = """categories: [x]
conversations:
- - Hi
  - Hello
- - Hi
  - Hello
  - How are you?
- - Hi
  - 42
  - Why?
- - Hi
  - ''
  - Why?
- - Who
  - is
  - there
  - Nobody.
"""
    found = file_conversations("test", "file", text)
    assert [c.name for c in found] == ["test/file/1", "test/file/4"]
    assert [c.turns for c in found] == [2, 2]
    assert file_conversations("test", "empty", "categories: [x]\n") == []


def test_an_unknown_language_is_refused() -> None:
    with pytest.raises(ValueError, match="no language \\['klingon'\\]"):
        load_conversations(("english", "klingon"))


def test_the_seed_picks_the_conversations() -> None:
    corpus = load_conversations(("english", "spanish", "italian"))
    picked = pick_conversations(corpus, 24, 7)
    assert picked == pick_conversations(list(reversed(corpus)), 24, 7)  # not the read order
    assert len({c.name for c in picked}) == 24
    assert picked != pick_conversations(corpus, 24, 8)
    assert len({c.language for c in picked}) == 3
    with pytest.raises(ValueError, match="the corpus has"):
        pick_conversations(corpus, len(corpus) + 1, 7)


def test_turn_k_sends_the_recorded_history_up_to_the_users_utterance() -> None:
    trace = build_trace(ConversationsSpec(conversations=10, system_words=40), 3)
    assert trace.system.startswith("You are the assistant of an online help desk.")
    long = max(trace.conversations, key=lambda conversation: conversation.turns)
    assert long.turns >= 2
    for turn in range(long.turns):
        messages = turn_messages(long, turn, trace.system)
        assert messages[0] == {"role": "system", "content": trace.system}
        spoken = messages[1:]
        assert [m["content"] for m in spoken] == list(long.utterances[: 2 * turn + 1])
        assert [m["role"] for m in spoken] == ["user", "assistant"] * turn + ["user"]
    assert turn_messages(long, 0, "") == [{"role": "user", "content": long.utterances[0]}]
    with pytest.raises(ValueError):
        turn_messages(long, long.turns, trace.system)
    assert trace.requests == sum(c.turns for c in trace.conversations)


def test_the_system_prompt_is_sized_in_words_and_shared() -> None:
    assert system_prompt(0, 1) == ""
    header_words = len(system_prompt(1, 1).split()) - 1
    assert len(system_prompt(300, 1).split()) == header_words + 300
    assert system_prompt(300, 1) == system_prompt(300, 1) != system_prompt(300, 2)


def test_the_configuration_needs_more_conversations_than_slots() -> None:
    with pytest.raises(ValueError, match="more conversations than slots"):
        ConversationsBenchConfig(spec=ConversationsSpec(conversations=4), slots=4)
    with pytest.raises(ValueError, match="unknown arm"):
        ConversationsBenchConfig(arms=("direct", "cached"))
    with pytest.raises(ValueError, match="at least 1"):
        ConversationsBenchConfig(clients=0)
    config = ConversationsBenchConfig()
    assert (config.server_cache_ram_mib("direct"), config.server_cache_ram_mib("proxy")) == (
        8192,
        0,
    )


def test_the_command_refuses_an_unknown_language_before_starting_anything() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cacheproxy", "bench", "conversations", "--languages", "klingon"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "cannot run: the corpus has no language ['klingon']" in done.stderr
    assert "starting" not in done.stderr


async def test_turns_go_round_robin_each_conversation_its_own_count() -> None:
    line = RoundRobinTurns([range(3), range(1), range(2)], workers=1)
    handed = []
    while (item := await line.next_turn()) is not None:
        handed.append(item)
        line.answered(*item)
    assert handed == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
