"""The completion ids each tenant was answered with, and the tasks upstream behind each.

llama-server acts on a running completion by its id (`POST /v1/chat/completions/control`,
tools/server/server-context.cpp `post_control`: the first slot whose task carries that
`oaicompat_cmpl_id`), whoever asks. The proxy sees every id it relays (an OpenAI-shaped answer's
`id`, apis/observe.py), so it keeps, per tenant, the ids its requests were shown and where the
task behind each runs: the control route then answers a tenant only about its own
(http/control_routes.py). A split request shows one id for several tasks, each with its own id
upstream; a control request reaches each of them.

Bounded: each tenant's most recent `PER_TENANT` ids (a control request names a running
completion; one long finished answers "no active completion" upstream, and 404 here).
"""

from __future__ import annotations

from collections import OrderedDict

from cacheproxy.upstreams.pool import Upstream

PER_TENANT = 256

# where a task runs: its upstream and its id there
TaskAt = tuple[Upstream, str]


class CompletionIds:
    def __init__(self, per_tenant: int = PER_TENANT) -> None:
        self.per_tenant = per_tenant
        self._ids: dict[str, OrderedDict[str, list[TaskAt]]] = {}

    def record(self, tenant: str, shown: str | None, upstream: Upstream, task_id: str) -> None:
        """A task of `tenant` on `upstream` runs as `task_id` there, its answer showing `shown`
        (None: `task_id` itself; a split request's own id for all its tasks)."""
        ids = self._ids.get(tenant)
        if ids is None:
            ids = self._ids[tenant] = OrderedDict()
        shown = task_id if shown is None else shown
        tasks = ids.get(shown)
        if tasks is None:
            tasks = ids[shown] = []
            if len(ids) > self.per_tenant:
                ids.popitem(last=False)
        else:
            ids.move_to_end(shown)
        tasks.append((upstream, task_id))

    def tasks(self, tenant: str, shown: str) -> list[TaskAt]:
        """The tasks behind id `shown` of `tenant`'s answers (none: not one of them)."""
        ids = self._ids.get(tenant)
        return list(ids.get(shown, ())) if ids is not None else []
