"""A chat template learnt from the server's own renderings, so that a plain chat's prompt text
is made here instead of asked of `POST /apply-template` (a round trip that costs llama-server
about 2 ms of CPU: it analyses the template afresh every time, common/chat.cpp).

Most templates render a conversation by concatenation: what stands before the first message
depends on its role, what stands between two messages on the two roles, what ends the prompt
on the last role (the generation prompt included), and each message's content is put in as it
is (or trimmed). Such a template is learnt from a few renderings of probe conversations whose
contents are unique markers: split at the markers, they give those joints. It is used only if
every joint was rendered the same way in every probe, and renderings of further conversations
(contents with whitespace, newlines, non-ASCII text) are reproduced exactly; otherwise the
server renders every request, as before. A template that reads the date, or an upstream whose
answers stop agreeing with the prompts made here (`TemplatesOfUpstreams.forget`), is not used.

A request is rendered here only when nothing but its messages can change the text: roles
system, user and assistant with string contents, the last not the assistant's (that one is
continued, a path of its own), no field outside `PLAIN_FIELDS` (tools, template kwargs,
response formats...), no blank content (empty or whitespace: templates test a content's
truth, and may leave out a message that has none), and no content holding a string literal of
the template (a template may act on those, as reasoning templates split at `</think>`) or the
BOS/EOS text (the server strips them at the ends).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from cacheproxy.ops.supervise import start_keyed

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
ENDING_ROLES = ("system", "user")  # a conversation ending with the assistant's is continued
# body fields that never change the prompt text (sampling, output and cache options)
PLAIN_FIELDS = frozenset(
    {
        "messages",
        "model",
        "stream",
        "stream_options",
        "n_predict",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "repeat_last_n",
        "cache_prompt",
        "id_slot",
        "return_tokens",
        "verbose",
        "timings_per_token",
        "ignore_eos",
        "n_probs",
        "logprobs",
        "top_logprobs",
        "user",
        "thinking_budget_tokens",
        "__metadata_user_id",
    }
)
# templates that read the clock render another text tomorrow
DATED = ("strftime_now", "date_string", "datetime", "now(")
MARKER = "Mq{}zX"  # a probe's content: found once each in a rendering, in order
# one sequence of roles per probe: together they show every joint (each ends on a role that
# is not the assistant's: the server would continue that one)
PROBES: tuple[tuple[str, ...], ...] = (
    ("user",),
    ("system",),
    ("assistant", "user"),
    ("system", "user", "assistant", "user"),
    ("user", "user"),
    ("user", "system"),
    ("system", "system", "user"),
    ("system", "assistant", "user"),
    ("user", "assistant", "assistant", "user"),
    ("user", "assistant", "system", "user"),
)
# conversations rendered here and by the server, which must agree to the byte
CHECKS: tuple[tuple[tuple[str, str], ...], ...] = (
    (
        ("system", "You are a careful assistant.\nAnswer briefly."),
        ("user", "  What is 2 + 2?  "),
        ("assistant", "\nIt is 4.\n"),
        ("user", "And in Ελληνικά, 日本語 — please?\n\n"),
    ),
    (
        ("user", "first\tquestion"),
        ("assistant", "first answer"),
        ("user", "second question"),
        ("assistant", " second answer "),
        ("user", "third question, { braces } and 'quotes' \"too\""),
    ),
)
# what the server's `trim` filter strips (Python's strip strips more: such text is not rendered)
TRIMMED = " \t\n\r"
_LITERAL = re.compile(r"""'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)\"""")
_MARKUP = re.compile(r"[^\w\s]")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}

Render = Callable[[list[dict]], Awaitable[str | None]]  # the server's rendering (None: refused)
# what more is learnt of an upstream's template once it is learnt (template_cuts.py)
Refine = Callable[[str, "LearntTemplate"], Awaitable["LearntTemplate"]]


@dataclass(frozen=True)
class LearntTemplate:
    """A concatenative chat template: joints by role, contents as they are or trimmed."""

    start: dict[str, str]  # before the first message, by its role
    join: dict[tuple[str, str], str]  # between two messages, by their roles
    end: dict[str, str]  # after the last message, by its role (the generation prompt in it)
    trims: bool  # contents trimmed of TRIMMED at both ends
    guarded: tuple[str, ...]  # texts that send a request to the server's rendering
    # joints that start with a special token the server parses on its own: the text before
    # one tokenizes apart from the text after it (learn_cuts), so a prompt is tokenized in
    # segments cut there, and a segment seen before is not tokenized again
    cuts: frozenset[str] = frozenset()

    def render(self, body: dict) -> str | None:
        """The prompt text the server would render for `body`; None: not a plain request, or
        one of a shape the probes did not show."""
        parts = self.parts(body)
        return None if parts is None else "".join(parts)

    def segments(self, body: dict) -> list[str] | None:
        """The prompt text of `body` (as `render` makes it) cut before each joint of `cuts`."""
        parts = self.parts(body)
        return None if parts is None else self.cut(parts)

    def cut(self, parts: list[str]) -> list[str]:
        """A prompt's `parts` joined into the segments that tokenize apart."""
        if not self.cuts:
            return ["".join(parts)]
        segments = [[parts[0]]]
        # parts: joint, content, joint, content, ..., joint
        for index in range(1, len(parts)):
            part = parts[index]
            if index % 2 == 0 and part in self.cuts:
                segments.append([part])
            else:
                segments[-1].append(part)
        return ["".join(pieces) for pieces in segments]

    def parts(self, body: dict) -> list[str] | None:
        """The prompt text of `body` as joint, content, joint, ..., content, joint."""
        if not PLAIN_FIELDS.issuperset(body):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        roles: list[str] = []
        contents: list[str] = []
        for message in messages:
            if not isinstance(message, dict) or len(message) != 2:
                return None
            role, content = message.get("role"), message.get("content")
            if role not in ROLES or not isinstance(content, str):
                return None
            if not content.strip():
                # templates test a content's truth (`if message.content`, or once trimmed):
                # a blank one may drop the message, or its joints, from the text
                return None
            if self.trims:
                content = _trimmed(content)
                if content is None:
                    return None
            roles.append(role)
            contents.append(content)
        for content in contents:
            for text in self.guarded:
                if text in content:
                    return None
        parts = [self.start.get(roles[0])]
        for index, content in enumerate(contents):
            parts.append(content)
            if index + 1 < len(roles):
                parts.append(self.join.get((roles[index], roles[index + 1])))
            else:
                parts.append(self.end.get(roles[index]))
        if None in parts:
            return None  # a joint the server refused to show (roles must alternate, say)
        return parts  # type: ignore[return-value]


def _trimmed(content: str) -> str | None:
    stripped = content.strip(TRIMMED)
    if stripped and (stripped[0].isspace() or stripped[-1].isspace()):
        return None  # other whitespace at an end: the server's trim may differ from Python's
    return stripped


def guarded_texts(source: str, bos: str, eos: str) -> tuple[str, ...]:
    """The template's markup literals (two characters or more beyond the whitespace, one of
    them neither a letter, a digit nor a space: not the words it compares roles and keys
    with), and the BOS and EOS texts."""
    found = {bos, eos}
    for match in _LITERAL.finditer(source):
        raw = match.group(1) if match.group(1) is not None else match.group(2)
        text = re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), raw).strip()
        if len(text) >= 2 and _MARKUP.search(text):
            found.add(text)
    return tuple(sorted(text for text in found if text))


def joints_of(roles: Sequence[str], rendered: str) -> list[tuple[object, str]] | None:
    """The joints a probe's rendering shows: (key, text) in order; None if its markers are not
    each found once, in order."""
    pieces: list[str] = []
    rest = rendered
    for index in range(len(roles)):
        marker = MARKER.format(index)
        before, found, rest = rest.partition(marker)
        if not found or marker in rest:
            return None
        pieces.append(before)
    pieces.append(rest)
    keys: list[object] = [("start", roles[0])]
    keys += [("join", roles[i], roles[i + 1]) for i in range(len(roles) - 1)]
    keys.append(("end", roles[-1]))
    return list(zip(keys, pieces, strict=True))


def template_from_probes(
    renderings: dict[tuple[str, ...], str | None], guarded: tuple[str, ...], trims: bool
) -> LearntTemplate | None:
    """The template the probes' renderings show, if each joint was rendered one way only."""
    joints: dict[object, str] = {}
    for roles, rendered in renderings.items():
        if rendered is None:
            continue  # refused: the joints only it shows stay unknown
        found = joints_of(roles, rendered)
        if found is None:
            return None
        for key, text in found:
            if joints.setdefault(key, text) != text:
                return None  # one joint, two renderings: not concatenative
    start = {key[1]: text for key, text in joints.items() if key[0] == "start"}  # type: ignore[index]
    join = {(key[1], key[2]): text for key, text in joints.items() if key[0] == "join"}  # type: ignore[index]
    end = {key[1]: text for key, text in joints.items() if key[0] == "end"}  # type: ignore[index]
    if not start or not end:
        return None
    return LearntTemplate(start, join, end, trims, guarded)


def conversation(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


async def learn_template(source: str, bos: str, eos: str, render: Render) -> LearntTemplate | None:
    """Learn the template from the server's renderings of the probes, and check it on
    conversations of real text; None: it cannot be rendered here."""
    if any(word in source for word in DATED):
        return None
    renderings = {}
    for roles in PROBES:
        probe = conversation([(role, MARKER.format(i)) for i, role in enumerate(roles)])
        renderings[roles] = await render(probe)
    guarded = guarded_texts(source, bos, eos)
    checks = []
    for pairs in CHECKS:
        expected = await render(conversation(pairs))
        if expected is None:
            return None
        checks.append((pairs, expected))
    for trims in (False, True):
        template = template_from_probes(renderings, guarded, trims)
        if template is None:
            return None
        if all(
            template.render({"messages": conversation(pairs)}) == expected
            for pairs, expected in checks
        ):
            return template
    return None


class TemplatesOfUpstreams:
    """The learnt template of each upstream, learnt in the background the first time a chat
    is mirrored there (its requests are rendered by the server meanwhile)."""

    # answers that disagreed, after which the upstream's is not learnt again (until it restarts)
    MAX_FORGOTTEN = 3

    def __init__(
        self,
        props: Callable[[str], Awaitable[dict]],
        apply_template: Callable[[str, dict], Awaitable[dict]],
        refine: Refine | None = None,
    ) -> None:
        self._props = props
        self._apply_template = apply_template
        self._refine = refine
        self._learnt: dict[str, LearntTemplate | None] = {}  # None: cannot be learnt
        self._learning: dict[str, asyncio.Task[None]] = {}
        self._forgotten: dict[str, int] = {}
        self.rendered = 0  # prompts rendered here
        self.asked = 0  # prompts the server rendered

    def render(self, base_url: str, body: dict) -> str | None:
        """The prompt text of `body` for the upstream at `base_url`, if made here."""
        rendered = self.render_parts(base_url, body)
        return None if rendered is None else "".join(rendered[0])

    def render_parts(self, base_url: str, body: dict) -> tuple[list[str], list[str]] | None:
        """The prompt text of `body` for the upstream at `base_url`, if made here: its parts
        (`LearntTemplate.parts`) and its segments that tokenize apart (one when its template
        has no cuts)."""
        template = self._learnt.get(base_url)
        if template is None:
            if base_url not in self._learnt and base_url not in self._learning:
                self._start_learning(base_url)
            self.asked += 1
            return None
        parts = template.parts(body)
        if parts is None:
            self.asked += 1
            return None
        self.rendered += 1
        return parts, template.cut(parts)

    def forget(self, base_url: str) -> None:
        """The upstream answered a prompt of another length than the one made here: its
        template is learnt again (it may have restarted with another), or no more."""
        if self._learnt.pop(base_url, None) is None:
            return
        count = self._forgotten[base_url] = self._forgotten.get(base_url, 0) + 1
        if count >= self.MAX_FORGOTTEN:
            self._learnt[base_url] = None
        log.warning("the chat template learnt from %s is forgotten (%d)", base_url, count)

    async def learnt(self, base_url: str) -> LearntTemplate | None:
        """The upstream's template once a learning under way has ended (None: none learnt)."""
        task = self._learning.get(base_url)
        if task is not None:
            await asyncio.wait([task])
        return self._learnt.get(base_url)

    async def aclose(self) -> None:
        for task in self._learning.values():
            task.cancel()
        await asyncio.gather(*self._learning.values(), return_exceptions=True)
        self._learning.clear()

    def restarted(self, base_url: str) -> None:
        """Another server process at the upstream, maybe with another template: what was
        learnt of the one before, or is being learnt, is dropped (learnt at its next chat)."""
        self._learnt.pop(base_url, None)
        self._forgotten.pop(base_url, None)
        task = self._learning.pop(base_url, None)
        if task is not None:
            task.cancel()

    def _start_learning(self, base_url: str) -> None:
        start_keyed(
            self._learning, base_url, self._learn(base_url), f"chat-template-learner {base_url}"
        )

    async def _learn(self, base_url: str) -> None:
        async def render(messages: list[dict]) -> str | None:
            try:
                answer = await self._apply_template(base_url, {"messages": messages})
            except Exception:  # the server refused this conversation: its joints stay unknown
                return None
            prompt = answer.get("prompt")
            return prompt if isinstance(prompt, str) else None

        try:
            props = await self._props(base_url)
            source = props.get("chat_template")
            bos, eos = props.get("bos_token") or "", props.get("eos_token") or ""
            if not isinstance(source, str) or not isinstance(bos, str) or not isinstance(eos, str):
                template = None
            else:
                template = await learn_template(source, bos, eos, render)
        except Exception as exc:  # unreachable for now: learnt at the next chat
            log.info("chat template of %s not learnt: %r", base_url, exc)
            return
        if template is not None and self._refine is not None:
            try:
                template = await self._refine(base_url, template)
            except Exception as exc:  # what it would add is left out: the template stands
                log.info("chat template of %s not refined: %r", base_url, exc)
        self._learnt[base_url] = template
        log.info(
            "chat template of %s %s",
            base_url,
            "learnt: plain chats are rendered here" if template else "rendered by the server",
        )
