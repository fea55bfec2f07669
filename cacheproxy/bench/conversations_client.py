"""The conversations benchmark's client: each turn sent to `/v1/chat/completions` as the trace
has it, and what the server's `timings` said about it; the turns taken round-robin by a few
clients; and the check that every conversation fits a slot."""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp

from cacheproxy.bench.agents_bench import TEMPLATE_TOKENS_PER_TURN
from cacheproxy.bench.cache_bench import RoundRobinTurns, UpstreamServer
from cacheproxy.bench.cache_client import post_json, slot_context_of
from cacheproxy.bench.conversations_corpus import RecordedConversation
from cacheproxy.bench.conversations_trace import ConversationsTrace, full_text, turn_messages
from cacheproxy.bench.harness import BenchmarkError, run_clients

MODEL = "bench"  # llama-server serves its one model whatever the name


@dataclass(frozen=True)
class ChatResult:
    """One request as the server accounted for it."""

    conversation: str
    turn: int
    prompt_n: int  # prompt tokens decoded
    cache_n: int  # prompt tokens taken from a cache
    output_tokens: int
    started_s: float  # since the arm started
    latency_s: float

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_n + self.cache_n


@dataclass(frozen=True)
class ChatClient:
    session: aiohttp.ClientSession
    base_url: str
    answer_tokens: int
    system: str
    arm_started: float

    async def send(self, conversation: RecordedConversation, turn: int) -> ChatResult:
        where = f"{conversation.name} turn {turn} ({self.base_url})"
        body = {
            "model": MODEL,
            "messages": turn_messages(conversation, turn, self.system),
            "max_tokens": self.answer_tokens,
            "temperature": 0,
        }
        started = time.perf_counter()
        try:
            answer = await post_json(self.session, self.base_url + "/v1/chat/completions", body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchmarkError(f"{where} failed: {exc!r}") from exc
        finished = time.perf_counter()
        timings = answer.get("timings")
        if not isinstance(timings, dict) or "prompt_n" not in timings:
            raise BenchmarkError(f"{where}: the answer carried no timings")
        return ChatResult(
            conversation=conversation.name,
            turn=turn,
            prompt_n=timings["prompt_n"],
            cache_n=timings.get("cache_n", 0),
            output_tokens=answer.get("usage", {}).get("completion_tokens", 0),
            started_s=started - self.arm_started,
            latency_s=finished - started,
        )


async def replay(client: ChatClient, trace: ConversationsTrace, clients: int) -> list[ChatResult]:
    """`clients` workers take the conversations' turns round-robin until every one is through."""
    conversations = trace.conversations
    line = RoundRobinTurns([range(conversation.turns) for conversation in conversations], clients)
    results: list[ChatResult] = []

    async def worker() -> None:
        while (item := await line.next_turn()) is not None:
            index, turn = item
            results.append(await client.send(conversations[index], turn))
            line.answered(index, turn)

    await run_clients({f"chat-client-{index}": worker() for index in range(clients)})
    return results


async def check_context(
    session: aiohttp.ClientSession,
    server: UpstreamServer,
    trace: ConversationsTrace,
    answer_tokens: int,
) -> None:
    """Every conversation's last request, with the template's wrapping and its answer, must
    fit a slot."""
    slot_context = await slot_context_of(session, server.url)
    for conversation in trace.conversations:
        text = full_text(conversation, trace.system)
        tokens = (await post_json(session, server.url + "/tokenize", {"content": text}))["tokens"]
        needed = len(tokens) + conversation.turns * TEMPLATE_TOKENS_PER_TURN + answer_tokens
        if needed > slot_context:
            raise BenchmarkError(
                f"{conversation.name}'s last turn needs about {needed} tokens but a slot holds"
                f" {slot_context}: raise --slot-context or lower --system-words"
            )
