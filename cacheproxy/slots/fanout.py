"""Several completions and prompt batches split into single tasks, and their answers merged
back into llama-server's own shape. Pure: no I/O.

How llama-server does it (pinned tree, tools/server):
- `handle_completions_impl` (server-context.cpp 4608-4874) makes one task per prompt of the
  request (`tokenize_input_prompts`, server-common.cpp 1052-1068: an array with no integer at its
  top level is a batch; each element is a string, an id array, a mixed array of strings and ids,
  or `{"prompt_string": ...}`), and per task `n_cmpl - 1` children (`n_cmpl`, alias `n`, read by
  server-schema.cpp 62-65 and 591-609: 1..n_parallel, else 400).
- A child copies its parent with the seed moved on by its number (server-task.h `add_child`,
  260-277). `post_tasks` numbers tasks flat, each prompt's task then its children
  (server-queue.cpp 525-541): that number is the answer's `index`.
- Not streamed: one result is answered as the object itself; on OAI routes several are the first
  result with every other result's `choices[0]` appended (its `usage` and `timings` stay the
  first task's); natively, the array of results in index order.
- Streamed: results are sent as they come. Each prompt task's first result is a begin marker
  (server-context.cpp 3646-3655) whose JSON is null: the first result of all only sends the
  headers, every later one is an event `data: null`; children (which start from their
  parent's state) send none. With `return_progress` the begin is a progress event, and a child
  sends one progress event only, its prompt all processed (copied from its parent). OAI routes
  end with `data: [DONE]`, the native one with nothing; an error result is answered as an HTTP
  error when it comes first, else as `data: {"error": ...}`, which ends the stream.

The proxy runs every task as a single request on a slot of its own (placed through the table)
and merges what they answer here: the same fields, `index` as llama-server numbers it, one OAI
`id` for every event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from cacheproxy.slots.prompt_bounds import RequestRejected

COUNT_FIELDS = ("n_cmpl", "n")  # server-schema.cpp: "n_cmpl" first, "n" as its alias
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed, which children keep
BAD_ELEMENT = (
    '"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt'
    " string, or a list of mixed strings & tokens."
)  # server-common.cpp tokenize_input_subprompt
EMPTY_PROMPT = '"prompt" must not be empty'  # server-common.cpp tokenize_input_prompts
JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string"}


class NotSplittable(Exception):
    """A prompt the proxy cannot tokenize as llama-server would (multimodal data)."""


@dataclass(frozen=True)
class SubTask:
    """One of llama-server's tasks for the request, as a single request of its own."""

    index: int  # llama-server's flat task number, the answer's `index`
    child: int  # 0: a prompt's own task; j > 0: its j-th child
    body: dict  # the request to send: one prompt, one completion
    # what to tokenize as tokenize_mixed does (a string, an array of ids and strings) for its
    # prompt's ids; None: a chat body, templated first
    prompt_input: Any


@dataclass(frozen=True)
class FanoutPlan:
    tasks: list[SubTask]
    oai: bool
    stream: bool
    progress: bool  # return_progress: every begin is an event of its own, never `data: null`


def plan_fanout(
    kind: Literal["completion", "chat"], oai: bool, document: dict, n_parallel: int | None
) -> FanoutPlan | None:
    """The tasks llama-server would make of `document`; None for one prompt and one completion
    (the single path serves it). Raise RequestRejected as llama-server refuses the request, and
    NotSplittable for a prompt only the server can read."""
    prompts: list[Any] = [None]
    if kind == "completion":
        if "prompt" not in document:
            return None  # llama-server's own answer to it is the single path's
        prompt = document["prompt"]
        batch = isinstance(prompt, list) and not any(_is_id(item) for item in prompt)
        prompts = list(prompt) if batch else [prompt]
        if not batch and _reads_as_one(document, n_parallel):
            return None
        if batch and not prompts:
            raise RequestRejected(EMPTY_PROMPT)
        inputs = [prompt_input(element) for element in prompts]  # refused before n is read
        count = completion_count(document, n_parallel)
    else:
        inputs = [None]
        count = completion_count(document, n_parallel)
        if count == 1:
            return None
    single = {key: value for key, value in document.items() if key not in COUNT_FIELDS}
    tasks = []
    for prompt, input_ in zip(prompts, inputs, strict=True):
        for child in range(count):
            body = dict(single)
            if kind == "completion":
                body["prompt"] = _as_single_prompt(prompt)
            if child:
                _shift_seed(body, child)
            tasks.append(SubTask(len(tasks), child, body, input_))
    return FanoutPlan(
        tasks,
        oai=oai,
        stream=document.get("stream") is True,
        progress=document.get("return_progress") is True,
    )


def by_prompt(plan: FanoutPlan) -> list[list[SubTask]]:
    """The plan's tasks by prompt: each prompt's own task, then its children (`n` > 1), which
    llama-server runs side by side (a child starts from its parent's computed prompt)."""
    prompts: list[list[SubTask]] = []
    for task in plan.tasks:
        if task.child == 0:
            prompts.append([task])
        else:
            prompts[-1].append(task)
    return prompts


def completion_count(document: dict, n_parallel: int | None) -> int:
    """`n_cmpl` (else `n`) as llama-server reads it: a number cast to int32, null for absent,
    1..n_parallel (None: not known, no upper bound)."""
    for name in COUNT_FIELDS:
        value = document.get(name)
        if value is None:
            continue
        if isinstance(value, bool | int | float):
            count = _as_int32(value)
        else:
            kind = JSON_TYPE_NAMES.get(type(value), "object")
            raise RequestRejected(
                f"Field '{name}': [json.exception.type_error.302] type must be number,"
                f" but is {kind}"
            )
        upper = n_parallel if n_parallel is not None else 2**31 - 1
        if not 1 <= count <= upper:
            raise RequestRejected(
                f"Field '{name}': Value must be between 1 <= value <= {upper}, but got {count}"
            )
        return count
    return 1


def _reads_as_one(document: dict, n_parallel: int | None) -> bool:
    try:
        return completion_count(document, n_parallel) == 1
    except RequestRejected:
        return False  # refused, after the prompt is read


def prompt_input(element: Any) -> Any:
    """What to tokenize (as tokenize_mixed does) for one prompt, as tokenize_input_subprompt
    reads it; RequestRejected for what it refuses."""
    if isinstance(element, str):
        return element
    if isinstance(element, list):
        if not element or set(map(type, element)) == {int}:  # C speed over long id prompts
            return element
        if any(isinstance(item, str) for item in element) and any(map(_is_id, element)):
            return element  # mixed
    if isinstance(element, dict) and "prompt_string" in element:
        if "multimodal_data" in element or not isinstance(element["prompt_string"], str | list):
            raise NotSplittable("multimodal data, or a prompt string only the server reads")
        return element["prompt_string"]
    raise RequestRejected(BAD_ELEMENT)


def _as_single_prompt(prompt: Any) -> Any:
    """The prompt as a request of its own: itself, unless it would read as a batch there (an
    empty id array is an empty batch at the top level, an empty prompt inside one)."""
    if prompt == []:
        return {"prompt_string": []}
    return prompt


def _shift_seed(body: dict, child: int) -> None:
    seed = body.get("seed")
    if type(seed) is int:
        seed &= DEFAULT_SEED  # read as uint32: -1 is the default
        if seed != DEFAULT_SEED:
            body["seed"] = (seed + child) & DEFAULT_SEED


def _as_int32(value: bool | int | float) -> int:
    """nlohmann's get<int32_t>: a cast, truncating a float and wrapping an integer."""
    number = int(value)
    return (number + 2**31) % 2**32 - 2**31


def _is_id(item: Any) -> bool:
    return type(item) is int  # json is_number_integer: not a float, not a bool


# -- answers -------------------------------------------------------------------------------


def merge_answers(plan: FanoutPlan, answers: list[Any], shown_id: str | None = None) -> Any:
    """The non-streamed answer llama-server gives for these tasks' answers (in index order);
    an OAI one carries `shown_id` (llama-server's tasks share one id, the proxy's each its own;
    None: the first task's)."""
    for index, answer in enumerate(answers):
        _renumber(answer, index, plan.oai)
    if shown_id is not None and plan.oai and isinstance(answers[0], dict) and "id" in answers[0]:
        answers[0]["id"] = shown_id
    if len(answers) == 1:
        return answers[0]
    if not plan.oai:
        return answers
    merged = answers[0]
    choices = merged.setdefault("choices", [])
    for answer in answers[1:]:
        choices.extend(answer.get("choices", [])[:1])
    return merged


def _renumber(document: Any, index: int, oai: bool) -> None:
    if not isinstance(document, dict):
        return
    if oai:
        for choice in document.get("choices") or ():
            if isinstance(choice, dict) and "index" in choice:
                choice["index"] = index
        _renumber(document.get("__verbose"), index, oai=False)
    elif "index" in document:  # response_fields may have left it out
        document["index"] = index


class StreamMerge:
    """The tasks' event streams as llama-server's one stream: each task's events renumbered as
    they come, `data: null` for begins after the first, one OAI `id`, one `[DONE]` at the end."""

    def __init__(self, plan: FanoutPlan, completion_id: str) -> None:
        self.plan = plan
        self.completion_id = completion_id
        self.failed = False  # an error event was passed on: the stream ends with it
        self._pending = {task.index: b"" for task in plan.tasks}
        self._children = {task.index for task in plan.tasks if task.child}
        self._began = False

    def started(self, index: int) -> bytes:
        """Task `index` began (its answer's headers arrived)."""
        if index in self._children or self.plan.progress:
            return b""  # no begin marker, or one that is an event of its own
        if not self._began:
            self._began = True
            return b""  # the first result only sends the headers
        return b"data: null\n\n"

    def feed(self, index: int, chunk: bytes) -> bytes:
        """What to send for a chunk of task `index`'s stream: its complete events, rewritten."""
        *events, self._pending[index] = (self._pending[index] + chunk).split(b"\n\n")
        return b"".join(self._event(index, event) for event in events)

    def ended(self, index: int) -> bytes:
        """Task `index`'s stream ended: whatever it left unterminated."""
        rest, self._pending[index] = self._pending[index], b""
        return self._event(index, rest) if rest.strip() else b""

    def closing(self) -> bytes:
        """After the last task: OAI routes end with `[DONE]` (not after an error)."""
        return b"data: [DONE]\n\n" if self.plan.oai and not self.failed else b""

    def _event(self, index: int, event: bytes) -> bytes:
        if self.failed:
            return b""
        lines = event.split(b"\n")
        for at, line in enumerate(lines):
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                return b""  # sent once, after every task
            try:
                document = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(document, dict):
                continue
            if "error" in document:
                self.failed = True
                continue
            if index in self._children and not _prompt_done(document):
                return b""  # a child starts from its parent's prompt: it reports it done
            _renumber(document, index, self.plan.oai)
            if self.plan.oai and "id" in document:
                document["id"] = self.completion_id
            lines[at] = b"data: " + orjson.dumps(document)
        return b"\n".join(lines) + b"\n\n"


def _prompt_done(event: dict) -> bool:
    """Not a progress event, or the one saying the prompt is all processed (server-context.cpp
    sends a child that one only, as it starts from its parent's state)."""
    progress = event.get("prompt_progress")
    if not isinstance(progress, dict):
        return "prompt_progress" not in event
    return progress.get("processed") == progress.get("total")


def error_event(payload: bytes, fallback: bytes) -> bytes:
    """A task's error answer as the event llama-server ends a stream with:
    `data: {"error": ...}` (`fallback`, an envelope, when the answer is not one)."""
    try:
        document = orjson.loads(payload)
    except orjson.JSONDecodeError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        return b"data: " + orjson.dumps({"error": document["error"]}) + b"\n\n"
    return b"data: " + fallback + b"\n\n"
