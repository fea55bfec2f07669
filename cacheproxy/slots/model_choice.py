"""Which upstreams may serve a task request, by the model its body names (pure).

A router-mode llama-server answers a POST by its body's `"model"`, resolving aliases, and refuses
what it cannot route in its own words (tools/server/server-models.cpp `router_validate_model`,
1920-1937): 400 "model name is missing from the request" without one, 400 "model 'X' not found"
for a name it does not know. A plain llama-server ignores the field and serves its one model.

So a request goes only to an upstream serving the model it names: a router's instance of that
model, or a plain server whose `/v1/models` lists it (by id or alias). Without a `"model"`, it
goes to the plain servers, as it always did (a router would refuse it). With one model
everywhere (plain servers only, one model id among them), the name is not looked at: any
upstream serves, as before. A tenant limited to some models (`Tenant.models`) is placed only on
upstreams serving one of them, and refused (403) a model outside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

from cacheproxy.errors import ApiError
from cacheproxy.upstreams.slot_table import UpstreamSlots

MODEL_MISSING = "model name is missing from the request"  # server-models.cpp:1922


def model_not_found(name: str) -> ApiError:
    """The router's answer to a model it does not know (server-models.cpp:1927)."""
    return ApiError(400, f"model '{name}' not found")


def model_not_allowed(name: str) -> ApiError:
    return ApiError(403, f"model '{name}' is not available to this API key", "permission_error")


def named_model(document: dict) -> str | None:
    """The model a request body names (None: none, or not a name)."""
    model = document.get("model")
    return model if isinstance(model, str) and model else None


def one_model_everywhere(tables: Sequence[UpstreamSlots]) -> bool:
    """Plain servers only, all serving one model as far as they say: the model a request
    names is not looked at. A server without `--alias` is known by its model file's path,
    which two hosts may keep the same file under: the file's name is what is compared."""
    ids = set()
    for table in tables:
        if table.upstream.model is not None or table.router:
            return False
        if table.model_id is not None:
            ids.add(PurePosixPath(table.model_id).name)
    return len(ids) <= 1


def serving_tables(
    tables: Sequence[UpstreamSlots], model: str | None, allowed: frozenset[str] | None = None
) -> list[UpstreamSlots]:
    """The tables that may serve a request naming `model` (None: none named), for a tenant
    limited to the models `allowed` (None: any); raises the refusal in llama-server's
    envelope when there are none."""
    if model is None or one_model_everywhere(tables):
        chosen = [t for t in tables if t.upstream.model is None and not t.router]
        if not chosen:
            raise ApiError(400, MODEL_MISSING)
    else:
        chosen = [table for table in tables if model in table.model_names]
        if not chosen:
            raise model_not_found(model)
    if allowed is None:
        return chosen
    permitted = [table for table in chosen if table.model_names & allowed]
    if not permitted:
        shown = model or next((t.model_id for t in chosen if t.model_id), "")
        raise model_not_allowed(shown)
    return permitted


def visible_to(names: frozenset[str], allowed: frozenset[str] | None) -> bool:
    """Whether a model known by `names` is listed for a tenant limited to `allowed`."""
    return allowed is None or bool(names & allowed)
