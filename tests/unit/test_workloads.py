"""The cache benchmark's workloads: shapes, sharing, determinism, and the oracle."""

from __future__ import annotations

import itertools
import random
from collections import Counter, defaultdict

import pytest

from cacheproxy.bench.workloads import (
    Conversation,
    Exchange,
    MultiTurnSpec,
    SharedPrefixSpec,
    TokenRange,
    multi_turn_workload,
    oracle,
    shared_prefix_workload,
    with_restart,
)

# --- W1 ---------------------------------------------------------------------------------------


def test_shared_prefix_has_the_documented_defaults() -> None:
    spec = SharedPrefixSpec()
    assert (spec.groups, spec.prompts_per_group) == (8, 16)
    assert (spec.prefix_tokens, spec.question_tokens, spec.n_predict) == (1024, 128, 32)
    assert spec.tokens == TokenRange(300, 31000)


def test_shared_prefix_sizes() -> None:
    spec = SharedPrefixSpec()
    requests = shared_prefix_workload(spec, seed=7)
    assert len(requests) == 8 * 16
    assert all(len(request.prompt) == 1024 + 128 for request in requests)
    assert all(request.n_predict == 32 for request in requests)
    assert all(300 <= token < 31000 for request in requests for token in request.prompt)


def test_shared_prefix_groups_share_exactly_their_prefix() -> None:
    spec = SharedPrefixSpec(groups=5, prompts_per_group=6, prefix_tokens=40, question_tokens=9)
    requests = shared_prefix_workload(spec, seed=3)
    by_prefix = Counter(request.prompt[:40] for request in requests)
    assert sorted(by_prefix.values()) == [6] * 5
    questions = [request.prompt[40:] for request in requests]
    assert len(set(questions)) == len(questions)
    groups = {request.conversation.split("/")[0] for request in requests}
    assert len(groups) == 5
    for group in groups:
        members = [r for r in requests if r.conversation.startswith(f"{group}/")]
        assert len({member.prompt[:40] for member in members}) == 1
        assert len({member.tenant for member in members}) == 1


def test_shared_prefix_is_shuffled() -> None:
    requests = shared_prefix_workload(SharedPrefixSpec(), seed=1)
    groups_in_order = [request.conversation.split("/")[0] for request in requests]
    # Grouped order would change group only 7 times.
    changes = sum(a != b for a, b in itertools.pairwise(groups_in_order))
    assert changes > 7 * 4


def test_shared_prefix_tenants_never_split_a_group() -> None:
    spec = SharedPrefixSpec(groups=6, prompts_per_group=3, prefix_tokens=5, tenants=3)
    tenants_by_group = defaultdict(set)
    for request in shared_prefix_workload(spec, seed=0):
        tenants_by_group[request.conversation.split("/")[0]].add(request.tenant)
    assert all(len(tenants) == 1 for tenants in tenants_by_group.values())
    assert set().union(*tenants_by_group.values()) == {"tenant-0", "tenant-1", "tenant-2"}


def test_shared_prefix_is_deterministic_for_a_seed() -> None:
    spec = SharedPrefixSpec(groups=3, prompts_per_group=4, prefix_tokens=20, question_tokens=5)
    assert shared_prefix_workload(spec, seed=11) == shared_prefix_workload(spec, seed=11)
    assert shared_prefix_workload(spec, seed=11) != shared_prefix_workload(spec, seed=12)


def test_token_range_is_a_parameter() -> None:
    spec = SharedPrefixSpec(groups=2, prompts_per_group=2, tokens=TokenRange(5, 9))
    tokens = {t for request in shared_prefix_workload(spec, seed=0) for t in request.prompt}
    assert tokens <= set(range(5, 9))


# --- W2 / W3 ----------------------------------------------------------------------------------


def test_multi_turn_has_the_documented_defaults() -> None:
    spec = MultiTurnSpec()
    assert (spec.tenants, spec.users_per_tenant, spec.turns) == (3, 4, 6)
    assert (spec.tenant_prefix_tokens, spec.history_tokens) == (512, 1024)
    assert (spec.question_tokens, spec.n_predict, spec.restart_after_turn) == (128, 32, None)
    assert spec.longest_sequence == 512 + 1024 + 6 * (128 + 32)


def test_multi_turn_sizes_and_sharing() -> None:
    workload = multi_turn_workload(MultiTurnSpec(), seed=5)
    conversations = workload.conversations
    assert len(conversations) == 12
    assert len({c.user for c in conversations}) == 12
    assert Counter(c.tenant for c in conversations) == {
        "tenant-0": 4,
        "tenant-1": 4,
        "tenant-2": 4,
    }
    for conversation in conversations:
        assert len(conversation.opening) == 512 + 1024
        assert [len(q) for q in conversation.questions] == [128] * 6
        assert conversation.n_predict == 32
    # The tenant prefix is shared by exactly the tenant's users; histories are each user's own.
    prefixes = {c.tenant: c.opening[:512] for c in conversations}
    assert len(set(prefixes.values())) == 3
    assert all(c.opening[:512] == prefixes[c.tenant] for c in conversations)
    histories = [c.opening[512:] for c in conversations]
    assert len(set(histories)) == 12
    questions = [q for c in conversations for q in c.questions]
    assert len(set(questions)) == 12 * 6


def test_users_alternate_between_tenants() -> None:
    workload = multi_turn_workload(MultiTurnSpec(), seed=0)
    first_round = [c.tenant for c in workload.conversations[:3]]
    assert first_round == ["tenant-0", "tenant-1", "tenant-2"]


def test_multi_turn_is_deterministic_for_a_seed() -> None:
    spec = MultiTurnSpec(users_per_tenant=2, tenant_prefix_tokens=8, history_tokens=8)
    assert multi_turn_workload(spec, seed=4) == multi_turn_workload(spec, seed=4)
    assert multi_turn_workload(spec, seed=4) != multi_turn_workload(spec, seed=5)


def test_a_turn_is_the_history_with_every_answer_then_the_question() -> None:
    conversation = Conversation(
        user="u",
        tenant="t",
        opening=(1, 2),
        questions=((10, 11), (20,), (30, 31, 32)),
        n_predict=2,
    )
    answers = [(100, 101), (200, 201)]
    assert conversation.prompt(0, []) == (1, 2, 10, 11)
    assert conversation.prompt(1, answers[:1]) == (1, 2, 10, 11, 100, 101, 20)
    assert conversation.prompt(2, answers) == (1, 2, 10, 11, 100, 101, 20, 200, 201, 30, 31, 32)
    request = conversation.request(1, answers)
    assert (request.tenant, request.conversation, request.n_predict) == ("t", "u", 2)
    with pytest.raises(ValueError):
        conversation.prompt(2, answers[:1])
    with pytest.raises(ValueError):
        conversation.prompt(3, answers)


def test_each_turn_extends_the_previous_prompt_and_answer() -> None:
    conversation = multi_turn_workload(MultiTurnSpec(), seed=2).conversations[7]
    answers = [tuple(range(1000 + 32 * turn, 1032 + 32 * turn)) for turn in range(6)]
    for turn in range(1, 6):
        previous = conversation.prompt(turn - 1, answers) + answers[turn - 1]
        current = conversation.prompt(turn, answers)
        assert current[: len(previous)] == previous
        assert len(current) == len(previous) + 128


def test_w3_restarts_half_way() -> None:
    spec = with_restart(MultiTurnSpec())
    assert spec.restart_after_turn == 3
    workload = multi_turn_workload(spec, seed=0)
    assert workload.phases() == [range(0, 3), range(3, 6)]
    assert multi_turn_workload(MultiTurnSpec(), seed=0).phases() == [range(0, 6)]
    # The restart changes when, not what: the same conversations either way.
    assert workload.conversations == multi_turn_workload(MultiTurnSpec(), seed=0).conversations


def test_a_restart_must_fall_between_turns() -> None:
    with pytest.raises(ValueError):
        MultiTurnSpec(turns=6, restart_after_turn=6)
    with pytest.raises(ValueError):
        MultiTurnSpec(turns=6, restart_after_turn=0)


# --- the oracle -------------------------------------------------------------------------------


def test_oracle_of_nothing() -> None:
    assert oracle([]) == []


def test_oracle_first_request_decodes_its_whole_prompt() -> None:
    assert oracle([Exchange((5, 6, 7), (8,))]) == [3]


def test_oracle_repeated_prompt_decodes_nothing() -> None:
    assert oracle([Exchange((5, 6, 7), (8,)), Exchange((5, 6, 7), (9,))]) == [3, 0]


def test_oracle_counts_the_longest_common_prefix() -> None:
    trace = [Exchange((1, 2, 3, 4), (9,)), Exchange((1, 2, 5), (9,))]
    assert oracle(trace) == [4, 1]


def test_oracle_reuses_an_earlier_prompt_plus_its_output() -> None:
    # The second prompt is the first prompt, its two generated tokens, and two new tokens.
    trace = [Exchange((1, 2, 3), (7, 8)), Exchange((1, 2, 3, 7, 8, 9, 10), (11,))]
    assert oracle(trace) == [3, 2]


def test_oracle_reuses_part_of_an_earlier_output() -> None:
    trace = [Exchange((1, 2, 3), (7, 8)), Exchange((1, 2, 3, 7, 6), (11,))]
    assert oracle(trace) == [3, 1]


def test_oracle_prompt_inside_an_earlier_output() -> None:
    trace = [Exchange((1, 2), (3, 4)), Exchange((1, 2, 3), (5,))]
    assert oracle(trace) == [2, 0]


def test_oracle_takes_the_best_of_all_earlier_sequences() -> None:
    trace = [
        Exchange((1, 2, 3, 4, 5), (0,)),
        Exchange((9, 9), (0,)),
        Exchange((1, 2, 3, 4, 6), (0,)),
        Exchange((9, 9, 9), (0,)),
    ]
    assert oracle(trace) == [5, 2, 1, 1]


def test_oracle_never_joins_two_earlier_sequences() -> None:
    # (1, 2, 3) and (1, 2, 4, 5) are cached; (1, 2, 4, 3) shares 3 tokens with the second only.
    trace = [Exchange((1, 2, 3), ()), Exchange((1, 2, 4, 5), ()), Exchange((1, 2, 4, 3), ())]
    assert oracle(trace) == [3, 2, 1]


def test_oracle_uses_only_earlier_requests() -> None:
    long, short = Exchange((1, 2, 3, 4), (5,)), Exchange((1, 2), (6,))
    assert oracle([long, short]) == [4, 0]
    assert oracle([short, long]) == [2, 2]


def test_oracle_does_not_count_a_request_against_itself() -> None:
    assert oracle([Exchange((4, 4, 4), (4, 4))]) == [3]


def brute_force_oracle(trace: list[Exchange]) -> list[int]:
    def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        length = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            length += 1
        return length

    earlier: list[tuple[int, ...]] = []
    result = []
    for prompt, output in trace:
        best = max((common_prefix(tuple(prompt), seen) for seen in earlier), default=0)
        result.append(len(prompt) - best)
        earlier.append((*prompt, *output))
    return result


def test_oracle_matches_brute_force_on_random_traces() -> None:
    rng = random.Random(42)
    for _ in range(200):
        trace = []
        for _ in range(rng.randint(1, 8)):
            base = list(rng.choice(trace).prompt) if trace and rng.random() < 0.7 else []
            prompt = base[: rng.randint(0, len(base))] + [
                rng.randint(0, 3) for _ in range(rng.randint(0, 5))
            ]
            output = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
            trace.append(Exchange(tuple(prompt), tuple(output)))
        assert oracle(trace) == brute_force_oracle(trace)


def test_oracle_of_w1_is_one_prefix_per_group_and_every_question() -> None:
    spec = SharedPrefixSpec(groups=4, prompts_per_group=5, prefix_tokens=50, question_tokens=7)
    requests = shared_prefix_workload(spec, seed=9)
    trace = [Exchange(request.prompt, (1, 2, 3)) for request in requests]
    assert sum(oracle(trace)) == 4 * 50 + 4 * 5 * 7


def test_oracle_of_w2_is_tenant_prefixes_histories_and_questions() -> None:
    spec = MultiTurnSpec()
    workload = multi_turn_workload(spec, seed=1)
    answers: dict[str, list[tuple[int, ...]]] = {c.user: [] for c in workload.conversations}
    trace = []
    answer_ids = iter(range(100_000, 10_000_000))
    for turn in range(spec.turns):  # round-robin, as the runner issues them
        for conversation in workload.conversations:
            prompt = conversation.prompt(turn, answers[conversation.user])
            answer = tuple(next(answer_ids) for _ in range(spec.n_predict))
            answers[conversation.user].append(answer)
            trace.append(Exchange(prompt, answer))
    users = spec.tenants * spec.users_per_tenant
    first_turns = spec.tenants * spec.tenant_prefix_tokens + users * (
        spec.history_tokens + spec.question_tokens
    )
    later_turns = users * (spec.turns - 1) * spec.question_tokens
    assert sum(oracle(trace)) == first_turns + later_turns == 23040
