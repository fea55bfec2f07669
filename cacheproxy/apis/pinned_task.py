"""The body of a task pinned to a leased slot, and the observer that reads its answer.

What the proxy adds to the client's body (`id_slot`, the ids it reads back) and takes out of it
(`response_fields`: it projects the answer itself), and what keeps the server from reusing
another tenant's text (`cache_prompt`, `n_cache_reuse`). The observer hides again what was added
(cacheproxy/apis/observe.py).
"""

from __future__ import annotations

from collections.abc import Callable

from cacheproxy.apis.observe import ShownReuse, TaskObserver
from cacheproxy.apis.response_fields import fields_asked
from cacheproxy.upstreams.slot_table import Lease


def may_shift_chunks(n_cache_reuse: object) -> bool:
    """Whether llama-server may reuse chunks of a slot's text past the common prefix by
    shifting their KV, given a body's `n_cache_reuse`: unset or null takes the server's
    `--cache-reuse`; a number (a boolean too) above 0 is read as a chunk size
    (tools/server/server-schema.cpp, `field_num`); 0 turns it off, anything else is refused
    with a 400."""
    return n_cache_reuse is None or (isinstance(n_cache_reuse, int | float) and n_cache_reuse > 0)


def pinned_task(
    body: dict,
    lease: Lease,
    stream: bool,
    oai: bool,
    hide_cache_signals: bool,
    observing: type[TaskObserver] = TaskObserver,
    shown_as_sent: bool = True,
    shown: ShownReuse | None = None,
    foreign_text: bool = True,
) -> tuple[dict, TaskObserver]:
    """`body` pinned to the leased slot, asking for what tells what the slot holds after it
    (see the module's docstring), and the observer (of the route's answer shape) that reads
    that and hides it again. `shown_as_sent`: the client gets the server's answer as it is (not
    converted from the chat form), so a `__verbose` the server sends by default is the client's.
    `shown`: how its cache signals are shown, unless hidden (None: as the server sends them).
    `foreign_text`: the slot held text not the requester's (`lease_terms.holds_foreign_text`)."""
    # a server that picks the slot itself is let pick it (`Lease.unpinned`)
    document = {**body, "id_slot": -1 if lease.unpinned else lease.slot.slot_id}
    if "model" not in document and lease.table.upstream.model is not None:
        # a router routes by it; a converted agent body has none (llama-server's converter
        # drops it: server-chat.cpp `server_chat_convert_anthropic_to_oai`)
        document["model"] = lease.table.upstream.model
    if lease.isolate:
        document["cache_prompt"] = False  # another tenant's text: reuse none of it
    # the proxy reads the whole answer (what the task cost, what the slot holds) and makes
    # the projection the body asks for itself, after hiding what it hides
    fields = fields_asked(document.get("response_fields"))
    if fields is not None:
        del document["response_fields"]
    if foreign_text and may_shift_chunks(document.get("n_cache_reuse")):
        # past the prefix it may share (a public one), the server would reuse chunks of the
        # other tenant's text by shifting their KV (`n_cache_reuse`, by default `--cache-reuse`)
        document["n_cache_reuse"] = 0
    added: set[str] = set()
    learn: Callable[[bool], None] | None = None
    if not stream and observing.asks_for_ids and not lease.opaque:
        server_default = lease.table.verbose_default
        if oai and shown_as_sent and "verbose" not in body and server_default is not False:
            # sent by the server's default, or (not known yet) learnt from this answer
            if server_default is None:
                learn = lease.table.learn_verbose_default
        elif oai and not document.get("verbose"):
            document["verbose"] = True
            added.add("verbose")
        if not document.get("return_tokens"):
            document["return_tokens"] = True
            added.add("return_tokens")
    observer = observing(
        len(lease.prompt),
        stream,
        oai,
        frozenset(added),
        ids_in_answer=bool(document.get("return_tokens")),
        hide_cache_signals=hide_cache_signals,
        learn_verbose_default=learn,
        shown=shown,
        fields=fields,
    )
    return document, observer
