"""W5's trace, as pure data: coding agents, each with its own long system prompt and a history
that grows by the model's answer, a tool call and the tool's output every turn.

Everything an agent sends, except the model's answers, is drawn here from a seeded
`random.Random`: system prompts, tasks, which tool each turn calls with which arguments, the
tool's output (a file listing, a log excerpt, search hits, a test run), how long the tool
"runs", how many turns each agent takes and when it arrives. The same spec and seed give the same
trace; sizes are drawn from ranges, so no agent is like another and nothing is tuned to a slot
count. The answers come from the server at run time (`agents_client.py` builds each request from
the trace and the answers so far). No I/O here.

Prose is sized in words (about 1.1 tokens each with the test model's vocabulary), tool outputs
in lines (20-40 tokens each): the prompt is text, and the server's usage gives the tokens it
became.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from typing import Any

# Common English and programming words: one or two tokens each in a SentencePiece vocabulary.
WORDS = (
    "the a an of to in for on with by from as at into over under after before about"
    " file files module function class method test tests build error errors warning log logs"
    " request response server client cache slot token tokens prompt queue worker task tasks"
    " config setting value values default option options path folder branch commit change"
    " changes fix bug issue review patch diff line lines code source import export return"
    " call calls run runs start stop read write open close check checks parse format type"
    " name names list map set key keys index table row rows column data state status result"
    " results time timeout retry limit size count total first last next previous new old"
    " always never only every each other same different must should may can will when if"
    " then else while because so but and or not no yes keep make use add remove update"
    " move copy find search look show print explain describe plan step steps done"
).split()

TOOL_NAMES = ("list_files", "read_log", "search_code", "run_tests")

TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "list_files": {"path": "string", "recursive": "boolean"},
    "read_log": {"path": "string", "lines": "integer"},
    "search_code": {"pattern": "string", "path": "string"},
    "run_tests": {"selector": "string"},
}

TOOL_DESCRIPTIONS = {
    "list_files": "List the files under a folder of the repository, with sizes and dates.",
    "read_log": "Read the last lines of a log file.",
    "search_code": "Search the repository for a regular expression; prints file:line: text.",
    "run_tests": "Run the test suite, or the tests a selector names, and print the report.",
}

LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARNING", "ERROR")
EXTENSIONS = (".py", ".toml", ".md", ".json", ".txt", ".cfg")


@dataclass(frozen=True)
class DrawRange:
    """How many (words, lines, turns) to draw: uniformly from [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"a range needs 0 <= low <= high, not [{self.low}, {self.high}]")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def scaled(self, scale: float, least: int = 1) -> DrawRange:
        return DrawRange(max(least, round(self.low * scale)), max(least, round(self.high * scale)))


@dataclass(frozen=True)
class AgentSpec:
    """W5. Turn counts and sizes are drawn per agent (and per turn) from these ranges; agents
    arrive one after another with exponential gaps of mean `arrival_gap_s`; each tool call takes
    a uniform [0, `max_tool_s`] before its output is sent back."""

    agents: int = 10
    turns: DrawRange = field(default_factory=lambda: DrawRange(3, 6))
    system_words: DrawRange = field(default_factory=lambda: DrawRange(600, 1200))
    task_words: DrawRange = field(default_factory=lambda: DrawRange(20, 60))
    # 20-40 tokens a line: a few hundred tokens per output
    tool_output_lines: DrawRange = field(default_factory=lambda: DrawRange(6, 16))
    answer_tokens: int = 32
    arrival_gap_s: float = 0.5
    max_tool_s: float = 0.3

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError(f"agents must be at least 1, not {self.agents}")
        if self.turns.low < 1:
            raise ValueError(f"every agent needs at least 1 turn, not {self.turns.low}")
        if self.answer_tokens < 1:
            raise ValueError(f"answer_tokens must be at least 1, not {self.answer_tokens}")
        if self.arrival_gap_s < 0 or self.max_tool_s < 0:
            raise ValueError("arrival_gap_s and max_tool_s must not be negative")

    def scaled(self, scale: float) -> AgentSpec:
        """Every size times `scale` (agents at least 2, turns at least 2, others at least 1)."""
        return replace(
            self,
            agents=max(2, round(self.agents * scale)),
            turns=self.turns.scaled(scale, least=2),
            system_words=self.system_words.scaled(scale),
            task_words=self.task_words.scaled(scale),
            tool_output_lines=self.tool_output_lines.scaled(scale),
            answer_tokens=max(1, round(self.answer_tokens * scale)),
        )


@dataclass(frozen=True)
class ToolCall:
    """What the agent does after the model answered a turn: calls `name` with `arguments`,
    which runs `duration_s` and prints `output`."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    output: str
    duration_s: float

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, sort_keys=True)


@dataclass(frozen=True)
class Agent:
    """One agent: its system prompt and task, and one tool call per turn but the last (whose
    answer ends the work). Turn t's request is system + task + (answer_i, call_i, output_i) for
    every i < t."""

    name: str
    arrival_s: float
    system: str
    task: str
    tool_calls: tuple[ToolCall, ...]

    @property
    def turns(self) -> int:
        return len(self.tool_calls) + 1

    @property
    def known_text(self) -> str:
        """Everything of the last turn's request that the trace fixes (all but the answers):
        what a context check tokenizes."""
        calls = [f"{call.name} {call.arguments_json}\n{call.output}" for call in self.tool_calls]
        return "\n".join([self.system, self.task, *calls])


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def sentences(rng: random.Random, count: int) -> str:
    """`count` words as sentences of 6-18 words."""
    parts = []
    left = count
    while left > 0:
        length = min(left, rng.randint(6, 18))
        sentence = words(rng, length)
        parts.append(sentence[:1].upper() + sentence[1:] + ".")
        left -= length
    return " ".join(parts)


def file_path(rng: random.Random) -> str:
    depth = rng.randint(1, 3)
    folders = "/".join(rng.choice(WORDS) for _ in range(depth))
    return f"{folders}/{rng.choice(WORDS)}_{rng.choice(WORDS)}{rng.choice(EXTENSIONS)}"


def file_listing(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"-rw-r--r-- 1 dev dev {rng.randint(80, 90000)} 2026-{rng.randint(1, 12):02d}-"
        f"{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        f" {file_path(rng)}"
        for _ in range(lines)
    )


def log_excerpt(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"2026-03-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
        f"{rng.randint(0, 59):02d}Z {rng.choice(LEVELS)} {rng.choice(WORDS)}"
        f"[{rng.randint(1, 64)}] {words(rng, rng.randint(4, 12))}"
        for _ in range(lines)
    )


def search_hits(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"{file_path(rng)}:{rng.randint(1, 900)}: {words(rng, rng.randint(3, 10))}"
        for _ in range(lines)
    )


def suite_report(rng: random.Random, lines: int) -> str:
    outcomes = [
        rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED")) for _ in range(lines - 1)
    ]
    report = [
        f"tests/{file_path(rng)}::test_{rng.choice(WORDS)}_{rng.choice(WORDS)} {outcome}"
        for outcome in outcomes
    ]
    passed = outcomes.count("PASSED")
    report.append(
        f"==== {passed} passed, {len(outcomes) - passed} other in {rng.uniform(0.5, 30):.2f}s ===="
    )
    return "\n".join(report)


OUTPUTS = {
    "list_files": file_listing,
    "read_log": log_excerpt,
    "search_code": search_hits,
    "run_tests": suite_report,
}


def tool_arguments(rng: random.Random, name: str) -> dict[str, Any]:
    if name == "list_files":
        return {"path": file_path(rng).rsplit("/", 1)[0], "recursive": rng.random() < 0.5}
    if name == "read_log":
        return {"path": f"logs/{rng.choice(WORDS)}.log", "lines": rng.randint(20, 200)}
    if name == "search_code":
        return {"pattern": f"{rng.choice(WORDS)}_{rng.choice(WORDS)}", "path": "."}
    return {"selector": f"tests/{rng.choice(WORDS)}"}


def tool_call(rng: random.Random, spec: AgentSpec, call_id: str) -> ToolCall:
    name = rng.choice(TOOL_NAMES)
    arguments = tool_arguments(rng, name)
    output = OUTPUTS[name](rng, spec.tool_output_lines.draw(rng))
    return ToolCall(call_id, name, arguments, output, rng.uniform(0, spec.max_tool_s))


def system_prompt(rng: random.Random, spec: AgentSpec, index: int) -> str:
    header = (
        f"You are coding agent {index}. You work in the repository {rng.choice(WORDS)}-"
        f"{rng.choice(WORDS)} and may call the tools you are given. Rules of this repository:"
    )
    return header + " " + sentences(rng, spec.system_words.draw(rng))


def agent_trace(spec: AgentSpec, seed: int) -> list[Agent]:
    """The agents in arrival order. Agent i's content comes from its own generator (seeded
    from `seed` and i), so changing one agent's size does not change the others."""
    arrivals = random.Random(f"{seed}/arrivals")
    agents = []
    arrival_s = 0.0
    for index in range(spec.agents):
        rng = random.Random(f"{seed}/agent-{index}")
        turns = spec.turns.draw(rng)
        system = system_prompt(rng, spec, index)
        task = sentences(rng, spec.task_words.draw(rng))
        calls = tuple(tool_call(rng, spec, f"{index}-{turn}") for turn in range(turns - 1))
        agents.append(Agent(f"agent-{index}", arrival_s, system, task, calls))
        arrival_s += arrivals.expovariate(1 / spec.arrival_gap_s) if spec.arrival_gap_s else 0.0
    return agents


def tool_schemas() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, description, JSON schema of the arguments) of every tool, as agents declare them."""
    schemas = []
    for name in TOOL_NAMES:
        properties = {key: {"type": kind} for key, kind in TOOL_SCHEMAS[name].items()}
        schema = {"type": "object", "properties": properties, "required": [*properties][:1]}
        schemas.append((name, TOOL_DESCRIPTIONS[name], schema))
    return schemas
