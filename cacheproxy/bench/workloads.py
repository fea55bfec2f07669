"""The cache benchmark's workloads, as pure data, and the oracle they are judged against.

Prompts are arrays of random token ids, so every count is exact (no tokenizer in the way) and two
prompts share a prefix only where the workload says so. Everything is drawn from a seeded
`random.Random`: the same spec and seed give the same trace. No I/O here; the runner sends.

- W1 `shared_prefix_workload`: groups of one-shot prompts that share a long group prefix, shuffled.
- W2 `multi_turn_workload`: users in conversation, more users than slots; each turn's prompt is
  the whole history so far, including the answers the server generated, so it is built at run
  time from those answers (`Conversation.prompt`).
- W3: W2 with `restart_after_turn` set (`with_restart`): the runner restarts llama-server there.

`oracle` gives, per request, what an infinite cache would still have to decode.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class TokenRange:
    """Ids drawn for prompts: [low, high). The default avoids the control and byte-fallback ids
    (0..258) and the end of the llama-spm vocabulary of the test model."""

    low: int = 300
    high: int = 31000

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"empty or negative token range [{self.low}, {self.high})")


def random_tokens(rng: random.Random, count: int, tokens: TokenRange) -> Tokens:
    return tuple(rng.randrange(tokens.low, tokens.high) for _ in range(count))


def tenant_label(index: int) -> str:
    return f"tenant-{index}"


@dataclass(frozen=True)
class Request:
    """One completion to send: token-id prompt, how many tokens to generate, and who asks."""

    prompt: Tokens
    n_predict: int
    tenant: str
    conversation: str
    model: str | None = None  # the model it names (several models: a router-mode upstream)


# --- W1: shared prefix ------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedPrefixSpec:
    """W1. Every group's prompts belong to one tenant (group g -> tenant g mod `tenants`), so
    the sharing the oracle counts is sharing a tenant-isolating cache may do."""

    groups: int = 8
    prompts_per_group: int = 16
    prefix_tokens: int = 1024
    question_tokens: int = 128
    n_predict: int = 32
    tenants: int = 1
    tokens: TokenRange = field(default_factory=TokenRange)

    def __post_init__(self) -> None:
        _require_positive(
            groups=self.groups,
            prompts_per_group=self.prompts_per_group,
            question_tokens=self.question_tokens,
            n_predict=self.n_predict,
            tenants=self.tenants,
        )
        _require_non_negative(prefix_tokens=self.prefix_tokens)

    @property
    def longest_sequence(self) -> int:
        """Prompt plus output tokens of the longest request: what a slot must hold."""
        return self.prefix_tokens + self.question_tokens + self.n_predict


def shared_prefix_workload(spec: SharedPrefixSpec, seed: int) -> list[Request]:
    """W1 in issue order: each prompt is its group's prefix plus a fresh question, shuffled."""
    rng = random.Random(seed)
    requests = []
    for group in range(spec.groups):
        prefix = random_tokens(rng, spec.prefix_tokens, spec.tokens)
        for index in range(spec.prompts_per_group):
            question = random_tokens(rng, spec.question_tokens, spec.tokens)
            requests.append(
                Request(
                    prompt=prefix + question,
                    n_predict=spec.n_predict,
                    tenant=tenant_label(group % spec.tenants),
                    conversation=f"group-{group}/prompt-{index}",
                )
            )
    rng.shuffle(requests)
    return requests


# --- W2 and W3: multi-turn conversations ------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """One user's conversation. Turn t (0-based) sends
    opening + (question_0 + answer_0) + ... + (question_{t-1} + answer_{t-1}) + question_t,
    where opening = tenant prefix + the user's own history and answers come from the server."""

    user: str
    tenant: str
    opening: Tokens
    questions: tuple[Tokens, ...]
    n_predict: int
    model: str | None = None

    @property
    def turns(self) -> int:
        return len(self.questions)

    def prompt(self, turn: int, answers: Sequence[Sequence[int]]) -> Tokens:
        if not 0 <= turn < self.turns:
            raise ValueError(f"{self.user} has turns 0..{self.turns - 1}, not {turn}")
        if len(answers) < turn:
            raise ValueError(f"turn {turn} of {self.user} needs {turn} answers, got {len(answers)}")
        history = [*self.opening]
        for question, answer in zip(self.questions[:turn], answers, strict=False):
            history += question
            history += answer
        return tuple(history) + self.questions[turn]

    def request(self, turn: int, answers: Sequence[Sequence[int]]) -> Request:
        return Request(
            prompt=self.prompt(turn, answers),
            n_predict=self.n_predict,
            tenant=self.tenant,
            conversation=self.user,
            model=self.model,
        )


@dataclass(frozen=True)
class MultiTurnSpec:
    """W2 (and W3 with `restart_after_turn`: the number of turns done before the restart)."""

    tenants: int = 3
    users_per_tenant: int = 4
    turns: int = 6
    tenant_prefix_tokens: int = 512
    history_tokens: int = 1024
    question_tokens: int = 128
    n_predict: int = 32
    restart_after_turn: int | None = None
    tokens: TokenRange = field(default_factory=TokenRange)
    # several models: user u talks to model u mod models, named `model_name(index)` (one
    # model: no name in the requests)
    models: int = 1

    def __post_init__(self) -> None:
        _require_positive(
            models=self.models,
            tenants=self.tenants,
            users_per_tenant=self.users_per_tenant,
            turns=self.turns,
            question_tokens=self.question_tokens,
            n_predict=self.n_predict,
        )
        _require_non_negative(
            tenant_prefix_tokens=self.tenant_prefix_tokens, history_tokens=self.history_tokens
        )
        if self.restart_after_turn is not None and not 0 < self.restart_after_turn < self.turns:
            raise ValueError(
                f"restart_after_turn must be between 1 and turns - 1 ({self.turns - 1}),"
                f" not {self.restart_after_turn}"
            )

    @property
    def longest_sequence(self) -> int:
        """Prompt plus output tokens of the last turn, with every answer at full length."""
        opening = self.tenant_prefix_tokens + self.history_tokens
        return opening + self.turns * (self.question_tokens + self.n_predict)


def with_restart(spec: MultiTurnSpec) -> MultiTurnSpec:
    """W3: W2 with a restart half-way (after turn 3 of 6 by default)."""
    if spec.turns < 2:
        raise ValueError("a restart needs at least two turns, one on either side")
    return replace(spec, restart_after_turn=spec.turns // 2)


@dataclass(frozen=True)
class MultiTurnWorkload:
    conversations: tuple[Conversation, ...]
    turns: int
    restart_after_turn: int | None

    def phases(self) -> list[range]:
        """Turn ranges (0-based) to run one after the other; a restart comes between two."""
        if self.restart_after_turn is None:
            return [range(self.turns)]
        return [range(self.restart_after_turn), range(self.restart_after_turn, self.turns)]


def multi_turn_workload(spec: MultiTurnSpec, seed: int) -> MultiTurnWorkload:
    """W2/W3. Users alternate between tenants (user u -> tenant u mod tenants), so a round-robin
    over users mixes tenants from the start."""
    rng = random.Random(seed)
    tenant_prefixes = [
        random_tokens(rng, spec.tenant_prefix_tokens, spec.tokens) for _ in range(spec.tenants)
    ]
    conversations = []
    for user in range(spec.tenants * spec.users_per_tenant):
        tenant = user % spec.tenants
        history = random_tokens(rng, spec.history_tokens, spec.tokens)
        questions = tuple(
            random_tokens(rng, spec.question_tokens, spec.tokens) for _ in range(spec.turns)
        )
        conversations.append(
            Conversation(
                user=f"user-{user}",
                tenant=tenant_label(tenant),
                opening=tenant_prefixes[tenant] + history,
                questions=questions,
                n_predict=spec.n_predict,
                model=model_name(user % spec.models) if spec.models > 1 else None,
            )
        )
    return MultiTurnWorkload(tuple(conversations), spec.turns, spec.restart_after_turn)


def model_name(index: int) -> str:
    """The name of a workload's model `index` (several models: a router's `--models-dir`)."""
    return f"model-{index}"


# --- the oracle -------------------------------------------------------------------------------


class Exchange(NamedTuple):
    """A request as it happened: the prompt sent and the tokens generated for it."""

    prompt: Sequence[int]
    output: Sequence[int]


class PrefixTrie:
    """Every prefix of every sequence inserted; answers the longest one a sequence starts with."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}

    def insert(self, tokens: Iterable[int]) -> None:
        node = self._root
        for token in tokens:
            node = node.setdefault(token, {})

    def longest_prefix(self, tokens: Iterable[int]) -> int:
        node = self._root
        length = 0
        for token in tokens:
            child = node.get(token)
            if child is None:
                break
            node = child
            length += 1
        return length


def oracle(exchanges: Iterable[Exchange]) -> list[int]:
    """Per exchange, in issue order: prompt length minus the longest common prefix with any
    earlier prompt + output, i.e. the prompt tokens an infinite cache would still decode.

    (llama-server always decodes at least one token, even for a prompt it holds in full; the
    oracle says 0 there, as an infinite cache would need no decoding.)
    """
    seen = PrefixTrie()
    uncached = []
    for exchange in exchanges:
        uncached.append(len(exchange.prompt) - seen.longest_prefix(exchange.prompt))
        seen.insert([*exchange.prompt, *exchange.output])
    return uncached


# --- checks -----------------------------------------------------------------------------------


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")


def _require_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must not be negative, not {value}")
