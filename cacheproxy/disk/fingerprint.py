"""What an archived state depends on, as a fingerprint: a state restores only into a server
whose fingerprint is the same, on this host or any other that reads the same archive folder.

Only content counts, never a host-local fact (the model file's path, the server's address): the
weights are told apart by what they answer (`behaviour_hash`: two weight files of the same shape
answer differently, the same weights answer the same on every start and from any copy, and no
server lets the proxy read its model file's header over HTTP), plus the build, the KV layout read
from a probe save (`slot_file.read_kv_layout`), the slots' context and the model facts the server
reports.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.pool import Upstream

# The behavioural probe behind the fingerprint: a fixed short prompt of token ids every
# vocabulary has, completed greedily with the top candidates of each step. Two weight files of
# the same shape answer it differently; the same weights answer it the same on every start.
PROBE_PROMPT = [1, *range(100, 132)]
PROBE_PREDICT = 4
PROBE_TOP = 5


async def behaviour_hash(client: UpstreamClient, upstream: Upstream, slot_id: int) -> str:
    """A hash of what the weights answer to `PROBE_PROMPT`: the greedy tokens and, where the
    server gives them, the top candidates' ids at each step (ids only, as a set: no float
    rounding or near-tie order can change between two starts of the same weights)."""
    body: dict[str, Any] = {
        "prompt": PROBE_PROMPT,
        "n_predict": PROBE_PREDICT,
        "temperature": 0,
        "id_slot": slot_id,
        "cache_prompt": False,
        "return_tokens": True,
        "n_probs": PROBE_TOP,
    }
    try:
        answer = await client.post_json(upstream, "/completion", body)
    except aiohttp.ClientResponseError as exc:
        if exc.status not in (400, 501):
            raise
        # a server without n_probs (the embedded engine): the greedy tokens alone
        del body["n_probs"]
        answer = await client.post_json(upstream, "/completion", body)
    steps = [
        [entry.get("id"), sorted(top.get("id") for top in entry.get("top_logprobs") or [])]
        for entry in answer.get("completion_probabilities") or []
    ]
    seen = {"tokens": answer.get("tokens"), "steps": steps}
    if not seen["tokens"] and not steps:
        raise ValueError("its answer to the fingerprint probe has no tokens")
    canonical = json.dumps(seen, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def fingerprint_facts(
    props: dict[str, Any],
    models: dict[str, Any],
    slots: list[dict],
    n_stream: int,
    behaviour: str,
    kv_layout: str,
) -> dict[str, Any]:
    """Everything a saved state depends on: the weights (by what they answer: a path or a shape
    says nothing of the content), the build, the KV layout (V transposed or not, layer count,
    K and V tensor types: `--cache-type-k/-v` and flash attention change them, and a restore
    into another layout fails), the slots' context, and what the server tells of the model.
    Nothing local to one host (the model file's path or the name it gives), so a state
    archived by one server restores on any other with the same weights and layout."""
    data = (models.get("data") or [{}])[0]
    meta = data.get("meta") or {}
    return {
        "behaviour": behaviour,
        "kv_layout": kv_layout,
        "model_ftype": props.get("model_ftype"),
        "build": props.get("build_info"),
        "total_slots": props.get("total_slots"),
        "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
        "slot_n_ctx": ",".join(str(entry.get("n_ctx")) for entry in slots),
        "n_stream": n_stream,
        **{f"meta_{key}": meta.get(key) for key in sorted(meta)},
    }


def compatibility_fingerprint(facts: Mapping[str, str | int | float | bool | None]) -> str:
    """An opaque fingerprint of what a restore depends on; archives only match equal ones.

    A slot file names neither the model nor the KV layout, and restoring it elsewhere fails
    (n_stream) or, worse, loads a wrong-shaped state. Put in every fact that must be equal:
    the model (path and size, or a hash), the llama-server build, the KV layout (`-np`,
    unified or not), the KV cache types. Key order does not matter.
    """
    canonical = json.dumps(dict(facts), sort_keys=True, separators=(",", ":"))
    return "fp_" + hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
