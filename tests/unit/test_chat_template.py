"""The learnt chat template: learnt from renderings, used only where it reproduces them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from cacheproxy.slots.chat_template import (
    LearntTemplate,
    TemplatesOfUpstreams,
    guarded_texts,
    learn_template,
)

CHATML_SOURCE = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"


def chatml(messages: list[dict]) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def trimmed_headers(messages: list[dict]) -> str:
    """As Llama 3 renders: a header per message, its content trimmed."""
    body = "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
        for m in messages
    )
    return body + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def system_in_first_user(messages: list[dict]) -> str:
    """As Llama 2 renders: the system text inside the first user turn (not concatenative)."""
    system = ""
    if messages[0]["role"] == "system":
        system, messages = f"<<SYS>>\n{messages[0]['content']}\n<</SYS>>\n\n", messages[1:]
    out = []
    for index, m in enumerate(messages):
        if m["role"] == "user":
            out.append(f"[INST] {system if index == 0 else ''}{m['content']} [/INST]")
        else:
            out.append(f" {m['content']} </s>")
    return "".join(out)


def alternating_only(messages: list[dict]) -> str | None:
    """Refuses conversations whose user and assistant turns do not alternate."""
    turns = [m["role"] for m in messages if m["role"] != "system"]
    if any(turns[i] == turns[i + 1] for i in range(len(turns) - 1)):
        return None
    return chatml(messages)


def learn(
    render: Callable[[list[dict]], str | None], source: str = CHATML_SOURCE
) -> LearntTemplate | None:
    async def server(messages: list[dict]) -> str | None:
        return render(messages)

    return asyncio.run(learn_template(source, "<s>", "</s>", server))


def conversation(*pairs: tuple[str, str], **fields: object) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in pairs], **fields}


def test_a_concatenative_template_is_learnt_and_renders_as_the_server() -> None:
    template = learn(chatml)
    assert template is not None and not template.trims
    body = conversation(("system", "s"), ("user", "q1"), ("assistant", "a1"), ("user", " q2\n"))
    assert template.render(body) == chatml(body["messages"])


def test_a_template_that_trims_contents_is_learnt_as_trimming() -> None:
    template = learn(trimmed_headers)
    assert template is not None and template.trims
    body = conversation(("user", "  spaced \n"), ("assistant", "a"), ("user", "b"))
    assert template.render(body) == trimmed_headers(body["messages"])
    # whitespace the server's trim may treat otherwise than Python's: left to the server
    assert template.render(conversation(("user", "\u00a0x"))) is None


def test_a_template_that_is_not_concatenative_is_not_learnt() -> None:
    assert learn(system_in_first_user) is None


def test_a_dated_template_is_not_learnt() -> None:
    assert learn(chatml, CHATML_SOURCE + "{{ strftime_now('%d %b %Y') }}") is None


def test_joints_the_server_refused_leave_those_conversations_to_it() -> None:
    template = learn(alternating_only)
    assert template is not None
    alternating = conversation(("system", "s"), ("user", "q"), ("assistant", "a"), ("user", "r"))
    assert template.render(alternating) == chatml(alternating["messages"])
    assert template.render(conversation(("user", "q"), ("user", "r"))) is None


@pytest.mark.parametrize(
    "body",
    [
        conversation(("user", "q"), tools=[{"type": "function"}]),
        conversation(("user", "q"), chat_template_kwargs={"enable_thinking": False}),
        conversation(("user", "q"), ("assistant", "prefilled")),  # continued by the server
        conversation(("tool", "output"), ("user", "q")),
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
        {"messages": [{"role": "user", "content": "q", "name": "me"}]},
        conversation(("user", "a <|im_start|> inside")),  # the template's own markup
        conversation(("user", "<s>q")),  # the BOS text, which the server strips at the start
        {"messages": []},
    ],
)
def test_what_else_may_change_the_text_is_left_to_the_server(body: dict) -> None:
    template = learn(chatml)
    assert template is not None
    assert template.render(body) is None


def test_sampling_fields_do_not_matter() -> None:
    template = learn(chatml)
    assert template is not None
    body = conversation(("user", "q"), temperature=0, n_predict=4, stream=True, seed=1)
    assert template.render(body) == chatml(body["messages"])


def test_guarded_texts_are_markup_not_words() -> None:
    source = "{% if message['role'] == 'system' %}{{ content.split('</think>')[-1] }}{% endif %}"
    assert guarded_texts(source, "<s>", "") == ("</think>", "<s>")


async def test_an_upstream_is_learnt_in_the_background_and_forgotten_on_disagreement() -> None:
    asked: list[str] = []

    async def props(base_url: str) -> dict:
        return {"chat_template": CHATML_SOURCE, "bos_token": "<s>", "eos_token": "</s>"}

    async def apply_template(base_url: str, body: dict) -> dict:
        asked.append(base_url)
        return {"prompt": chatml(body["messages"])}

    templates = TemplatesOfUpstreams(props, apply_template)
    body = conversation(("user", "q"))
    assert templates.render("http://a", body) is None  # learning started: the server renders
    assert await templates.learnt("http://a") is not None
    assert templates.render("http://a", body) == chatml(body["messages"])
    learnt_with = len(asked)
    assert templates.render("http://a", body) is not None
    assert len(asked) == learnt_with  # no round trip once learnt
    for _ in range(TemplatesOfUpstreams.MAX_FORGOTTEN):
        templates.forget("http://a")
        assert templates.render("http://a", body) is None
        await templates.learnt("http://a")
    # forgotten too often: the server renders them for good
    assert templates.render("http://a", body) is None
    await templates.aclose()


def test_a_learnt_template_is_frozen() -> None:
    template = learn(chatml)
    assert isinstance(template, LearntTemplate)
    with pytest.raises(AttributeError):
        template.trims = True  # type: ignore[misc]
