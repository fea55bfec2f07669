"""W5's trace and the requests built from it: deterministic by seed, drawn from the spec's ranges,
histories that grow turn by turn, a tool output in every one, on both APIs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cacheproxy.bench.agents_bench import AgentsBenchConfig
from cacheproxy.bench.agents_client import messages_body, responses_body
from cacheproxy.bench.agents_trace import Agent, AgentSpec, DrawRange, agent_trace

SPEC = AgentSpec(
    agents=7,
    turns=DrawRange(2, 6),
    system_words=DrawRange(300, 900),
    task_words=DrawRange(10, 30),
    tool_output_lines=DrawRange(3, 12),
)


def answers_for(agent: Agent, turns: int) -> list[str]:
    """Stand-ins for the model's answers (one empty: the model may stop at once)."""
    return ["" if turn == 1 else f"answer {turn} of {agent.name}" for turn in range(turns)]


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    assert agent_trace(SPEC, 5) == agent_trace(SPEC, 5)
    other = agent_trace(SPEC, 6)
    assert other != agent_trace(SPEC, 5)
    assert {agent.system for agent in other}.isdisjoint(
        agent.system for agent in agent_trace(SPEC, 5)
    )


def test_sizes_are_drawn_from_the_ranges_and_differ() -> None:
    trace = agent_trace(SPEC, 1)
    assert len(trace) == 7
    turns = [agent.turns for agent in trace]
    assert all(2 <= count <= 6 for count in turns) and len(set(turns)) > 1
    system_words = [len(agent.system.split()) for agent in trace]
    # the header adds a few words to the drawn count
    assert all(300 <= count <= 900 + 40 for count in system_words)
    assert len(set(system_words)) == len(system_words)
    lines = [len(call.output.splitlines()) for agent in trace for call in agent.tool_calls]
    assert all(3 <= count <= 12 for count in lines) and len(set(lines)) > 1
    assert len({call.name for agent in trace for call in agent.tool_calls}) > 1


def test_every_agent_has_its_own_system_prompt() -> None:
    trace = agent_trace(SPEC, 1)
    assert len({agent.system for agent in trace}) == len(trace)
    # not even a long common prefix beyond the shared opening words
    first, second = trace[0].system, trace[1].system
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert common < 40


def test_agents_arrive_staggered() -> None:
    arrivals = [agent.arrival_s for agent in agent_trace(SPEC, 1)]
    assert arrivals[0] == 0
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)
    assert arrivals[-1] > 0


def test_one_agent_does_not_change_with_the_number_of_agents() -> None:
    """Each agent has its own generator, so a bigger run keeps the smaller one's agents."""
    small = agent_trace(AgentSpec(agents=3), 2)
    big = agent_trace(AgentSpec(agents=9), 2)
    assert [(a.system, a.task, a.tool_calls) for a in small] == [
        (a.system, a.task, a.tool_calls) for a in big[:3]
    ]


@pytest.mark.parametrize("build", [messages_body, responses_body])
def test_each_turn_extends_the_last_one_by_an_answer_a_call_and_its_output(build: Any) -> None:
    key = "messages" if build is messages_body else "input"
    for agent in agent_trace(SPEC, 3):
        answers = answers_for(agent, agent.turns)
        previous: list[Any] | None = None
        for turn in range(agent.turns):
            body = build(agent, turn, answers[:turn])
            assert body.get("system", body.get("instructions")) == agent.system
            assert [tool["name"] for tool in body["tools"]]
            history = body[key]
            if previous is not None:
                assert history[: len(previous)] == previous  # a prefix: nothing rewritten
                assert len(history) > len(previous)
                text = json.dumps(history[len(previous) :])
                call = agent.tool_calls[turn - 1]
                assert json.dumps(call.output)[1:-1] in text  # the tool blob
                assert call.name in text
            previous = history


def test_messages_carry_tool_use_and_tool_result_blocks() -> None:
    agent = next(agent for agent in agent_trace(SPEC, 4) if agent.turns >= 3)
    body = messages_body(agent, 2, ["first answer", "second answer"])
    messages = body["messages"]
    assert [message["role"] for message in messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    use = messages[1]["content"]
    assert use[0] == {"type": "text", "text": "first answer"}
    assert use[1]["type"] == "tool_use" and use[1]["input"] == agent.tool_calls[0].arguments
    result = messages[2]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == use[1]["id"]
    assert result["content"] == agent.tool_calls[0].output


def test_responses_carry_function_call_and_output_items() -> None:
    agent = next(agent for agent in agent_trace(SPEC, 4) if agent.turns >= 3)
    items = responses_body(agent, 2, ["first answer", ""])["input"]
    kinds = [item.get("type", item.get("role")) for item in items]
    # the empty second answer sends no message item, only the call
    assert kinds == [
        "user",
        "message",
        "function_call",
        "function_call_output",
        "function_call",
        "function_call_output",
    ]
    call, output = items[2], items[3]
    assert json.loads(call["arguments"]) == agent.tool_calls[0].arguments
    assert output["call_id"] == call["call_id"] and output["output"] == agent.tool_calls[0].output


def test_a_turn_needs_exactly_the_answers_before_it() -> None:
    agent = agent_trace(SPEC, 1)[0]
    with pytest.raises(ValueError):
        messages_body(agent, 1, [])
    with pytest.raises(ValueError):
        responses_body(agent, agent.turns, ["x"] * agent.turns)


def test_scaled_spec_keeps_at_least_two_agents_and_two_turns() -> None:
    tiny = AgentSpec().scaled(0.01)
    assert tiny.agents == 2 and tiny.turns.low == 2 and tiny.system_words.low >= 1
    assert AgentSpec().scaled(2).system_words == DrawRange(1200, 2400)


def test_specs_and_configs_that_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        DrawRange(5, 4)
    with pytest.raises(ValueError, match="at least 1 turn"):
        AgentSpec(turns=DrawRange(0, 3))
    with pytest.raises(ValueError, match="more agents than slots"):
        AgentsBenchConfig(spec=AgentSpec(agents=4), slots=4)
    with pytest.raises(ValueError, match="unknown API"):
        AgentsBenchConfig(apis=("chat",))
