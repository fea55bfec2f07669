"""The proxy's own Prometheus metrics, in a registry per app, and the upstreams' beside them."""

from __future__ import annotations

import re
import time
from typing import TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, float("inf"))
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))


class _PendingCounts:
    """Counter increments of the request path, added up here and handed to prometheus_client
    whenever the registry is read (`/metrics`, `get_sample_value`): registered first, so its
    `collect` runs before the counters' own. An increment there takes a lock and two checks,
    and a request makes several."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics
        self.counts: dict[tuple[int, tuple[str, ...]], list] = {}  # [metric, values, amount]

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        counts, self.counts = self.counts, {}
        for metric, values, amount in counts.values():
            self.metrics.child(metric, *values).inc(amount)
        return []


class ProxyMetrics:
    def __init__(self) -> None:
        # when these counters started (sent as llama-server sends its own, to tell a restart)
        self.started_unix = int(time.time())
        self._children: dict[tuple[int, tuple[str, ...]], Counter | Gauge | Histogram] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self._pending = _PendingCounts(self)
        self.registry.register(self._pending)  # before every metric: see _PendingCounts
        r = self.registry
        self.requests = Counter(
            "cacheproxy_requests",
            "Task requests by tenant and how they were placed",
            ["tenant", "placement"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "cacheproxy_prompt_tokens", "Prompt tokens of routed requests", ["tenant"], registry=r
        )
        self.reused_tokens = Counter(
            "cacheproxy_reused_tokens",
            "Prompt tokens the server took from a slot (cache_n)",
            ["tenant"],
            registry=r,
        )
        self.decoded_tokens = Counter(
            "cacheproxy_decoded_prompt_tokens",
            "Prompt tokens the server decoded (prompt_n)",
            ["tenant"],
            registry=r,
        )
        self.prefill_chunks = Counter(
            "cacheproxy_prefill_chunks",
            "Chunks of prompts computed before their requests (chunked prefill)",
            registry=r,
        )
        # by model: its name as the upstreams list it (a bounded set, never a client's string;
        # "" where the upstream does not say), apart from the tenants (no product of the two)
        self.model_requests = Counter(
            "cacheproxy_model_requests",
            "Task requests placed on a slot, by the model of the upstream that served them",
            ["model"],
            registry=r,
        )
        self.model_prompt_tokens = Counter(
            "cacheproxy_model_prompt_tokens",
            "Prompt tokens of requests placed on a slot, by model",
            ["model"],
            registry=r,
        )
        self.model_reused_tokens = Counter(
            "cacheproxy_model_reused_tokens",
            "Prompt tokens the server took from a slot (cache_n), by model",
            ["model"],
            registry=r,
        )
        self.predictions = Counter(
            "cacheproxy_predictions",
            "Predicted reuse checked against cache_n: match, mismatch, ram_load (the server's own "
            "RAM cache gave more), shifted (the server shifted chunks of the slot's text into "
            "place, --cache-reuse), unchecked",
            ["result"],
            registry=r,
        )
        self.tokenizations = Counter(
            "cacheproxy_tokenizations",
            "Prompt texts tokenized, by upstream and where: proxy (its model file's vocabulary, "
            "proven identical) or server (POST /tokenize)",
            ["upstream", "where"],
            registry=r,
        )
        self.tokenizer_verdicts = Counter(
            "cacheproxy_tokenizer_verdicts",
            "In-process tokenizers judged, by upstream: proven (the battery agreed), refused "
            "(no readable or loadable model file, or the battery disagreed), mispredicted (an "
            "answer's prompt count disagreed: back to the server's /tokenize)",
            ["upstream", "verdict"],
            registry=r,
        )
        self.table_corrections = Counter(
            "cacheproxy_table_corrections",
            "Slots corrected from GET /slots",
            ["upstream"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "cacheproxy_queue_wait_seconds",
            "Time a request waited for a slot",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "cacheproxy_queue_depth", "Requests waiting for a slot", registry=r
        )
        self.queue_wait_by_reason = Counter(
            "cacheproxy_queue_wait_by_reason_seconds",
            "Time requests waited for a slot, by why each still waited when it was served",
            ["reason"],
            registry=r,
        )
        self.lined_up = Counter(
            "cacheproxy_requests_lined_up",
            "Requests sent behind their tenant's running request on its slot, to wait there",
            registry=r,
        )
        self.request_seconds = Histogram(
            "cacheproxy_request_seconds",
            "Time from arrival to the answer's last byte, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shadow_mispredictions = Counter(
            "cacheproxy_shadow_mispredictions",
            "Answers whose cache_n the shadow of the upstream's RAM cache did not predict (the "
            "table and the shadow were corrected from it), by upstream",
            ["upstream"],
            registry=r,
        )
        self.shadow_budget = Gauge(
            "cacheproxy_shadow_budget_bytes",
            "The byte budget the shadow of the upstream's RAM cache follows: "
            "routing.server_ram_cache_mib at first, then what the server's answers show it "
            "keeps (0: no limit), by upstream",
            ["upstream"],
            registry=r,
        )
        self.shadow_proven = Gauge(
            "cacheproxy_shadow_proven_bytes",
            "How much of that budget the server has been seen to keep, the most a load is "
            "counted on (-1: all of it, routing.server_ram_cache_learn being off), by upstream",
            ["upstream"],
            registry=r,
        )
        self.archive_saves = Counter(
            "cacheproxy_archive_saves",
            "Slots the disk tier considered archiving: saved, covered (an archive already held "
            "them), ram_cache (the server's RAM cache keeps them), refused (too short), "
            "over_quota, failed",
            ["outcome"],
            registry=r,
        )
        self.archive_restores = Counter(
            "cacheproxy_archive_restores",
            "Archive matches: restored, failed (dropped, served cold), not_worth (prefill was "
            "cheaper); recomputed: restored, and the server reused none of it; branched: not "
            "restored, the request branching off a state that is restored whole or not at all",
            ["outcome"],
            registry=r,
        )
        self.archive_saves_awaited = Counter(
            "cacheproxy_archive_saves_awaited",
            "Requests whose restore waited for a save under way of their own tenant's text "
            "(their conversation's slot, just given to another)",
            registry=r,
        )
        self.archive_writes_beside = Counter(
            "cacheproxy_archive_writes_beside_lookup",
            "Saves the server wrote while the store looked up and reserved their room: kept, or "
            "discarded (the lookup turned them down; the file removed)",
            ["outcome"],
            registry=r,
        )
        self.archive_saved_bytes = Counter(
            "cacheproxy_archive_saved_bytes", "Bytes of slot state archived", registry=r
        )
        self.archive_restored_bytes = Counter(
            "cacheproxy_archive_restored_bytes", "Bytes of slot state restored", registry=r
        )
        self.archive_save_seconds = Histogram(
            "cacheproxy_archive_save_seconds",
            "Time to archive a slot, index included",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.archive_restore_seconds = Histogram(
            "cacheproxy_archive_restore_seconds",
            "Time to restore an archive into a slot",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # llama-server saves and restores inside its main loop: no slot decodes meanwhile
        self.disk_stall_seconds = Counter(
            "cacheproxy_disk_stall_seconds",
            "Time llama-server's main loop spent on the disk tier's saves and restores, as the "
            "server reports it (timings.save_ms / restore_ms), by action",
            ["action"],
            registry=r,
        )
        self.disk_stall_slot_seconds = Counter(
            "cacheproxy_disk_stall_slot_seconds",
            "That time times the other slots busy at that moment (each waited for it), by action",
            ["action"],
            registry=r,
        )
        # what a request behind a slot action waits: beside busy slots mostly the batch under
        # way, which llama-server finishes before it runs the action
        self.disk_round_trip_seconds = Histogram(
            "cacheproxy_disk_round_trip_seconds",
            "From asking llama-server for a save or restore to its answer, by action: its own "
            "time on it (cacheproxy_disk_stall_seconds_total), the batch under way it waits "
            "for, and the exchange",
            ["action"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.archive_bytes = Gauge(
            "cacheproxy_archive_bytes", "Archive bytes on disk by tenant", ["tenant"], registry=r
        )
        self.archive_count = Gauge(
            "cacheproxy_archives", "Archived slot states by tenant", ["tenant"], registry=r
        )
        # archives kept as blocks of KV cells: a block several archives use is stored once
        self.archive_shared_bytes = Gauge(
            "cacheproxy_archive_shared_bytes",
            "Bytes of archive blocks more than one archive uses (stored once), by tenant",
            ["tenant"],
            registry=r,
        )
        self.archive_deduplicated_bytes = Gauge(
            "cacheproxy_archive_deduplicated_bytes",
            "Bytes the archives would take as whole slot files beyond what they take, by tenant",
            ["tenant"],
            registry=r,
        )
        self.archive_copy_bytes = Gauge(
            "cacheproxy_archive_copy_bytes",
            "Bytes of whole copies kept beside archive blocks (in the budget, not the quota),"
            " by tenant",
            ["tenant"],
            registry=r,
        )
        self.archive_block_bytes = Counter(
            "cacheproxy_archive_block_bytes",
            "Bytes of saved states cut into blocks: written, or shared with blocks already kept",
            ["kind"],
            registry=r,
        )
        self.archive_conversions_pending = Gauge(
            "cacheproxy_archive_conversions_pending",
            "Saved archives waiting to be cut into blocks, or being cut",
            registry=r,
        )
        self.archive_assembled_bytes = Counter(
            "cacheproxy_archive_assembled_bytes",
            "Bytes of slot files put together from blocks for restores",
            registry=r,
        )
        self.archive_assemble_seconds = Histogram(
            "cacheproxy_archive_assemble_seconds",
            "Time to put a slot file together from blocks for a restore",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # the save cost model's inputs and what it decided (see cacheproxy.disk.policy)
        self.disk_save_mib_s = Gauge(
            "cacheproxy_disk_save_mib_per_second",
            "Measured save rate (moving average of the server's save_ms), by upstream",
            ["upstream"],
            registry=r,
        )
        self.disk_restore_mib_s = Gauge(
            "cacheproxy_disk_restore_mib_per_second",
            "Measured restore rate (moving average of the server's restore_ms), by upstream",
            ["upstream"],
            registry=r,
        )
        self.prefill_tokens_s = Gauge(
            "cacheproxy_prefill_tokens_per_second",
            "Measured prefill rate (moving average of prompt_ms per token), by upstream",
            ["upstream"],
            registry=r,
        )
        self.prefill_server_tokens_s = Gauge(
            "cacheproxy_prefill_server_tokens_per_second",
            "Prompt tokens the server computes a second across its batches (tokens over the "
            "union of the prompts' intervals): what the disk tier prices a prompt token at, "
            "by upstream",
            ["upstream"],
            registry=r,
        )
        self.disk_overhead_ms = Gauge(
            "cacheproxy_disk_overhead_ms",
            "What a save or restore on a request's path adds for that request beyond the "
            "server's own time (the round trip, measured with no other slot busy), by upstream and "
            "action",
            ["upstream", "action"],
            registry=r,
        )
        self.disk_busy_slots = Gauge(
            "cacheproxy_disk_busy_slots",
            "Other slots busy at the disk tier's last decision (each waits for a save or "
            "restore), by upstream",
            ["upstream"],
            registry=r,
        )
        self.disk_busy_when_placed = Gauge(
            "cacheproxy_disk_busy_when_placed",
            "Other slots usually busy when a request is placed (moving average): they wait for "
            "a returning conversation's prefill or restore, by upstream",
            ["upstream"],
            registry=r,
        )
        self.disk_continue_chance = Gauge(
            "cacheproxy_disk_continue_chance",
            "How often the tenant's requests lately continued the whole text they reused (1: "
            "conversations) rather than branched off it (questions on one document), as the cost "
            "model last weighed a save of its text, by tenant",
            ["tenant"],
            registry=r,
        )
        self.disk_bytes_per_token = Gauge(
            "cacheproxy_disk_bytes_per_token",
            "Bytes a token of slot state takes in a file (from the probe at attach, then from "
            "every save): what the cost model sizes a save or restore by, by upstream",
            ["upstream"],
            registry=r,
        )
        self.archive_ahead_bytes = Counter(
            "cacheproxy_archive_ahead_bytes",
            "Bytes archived ahead of need, in the background, from idle slots",
            registry=r,
        )
        self.evictions = Counter(
            "cacheproxy_evictions",
            "Slots worth keeping a request overwrote: covered (an archive held them, no save), "
            "saved (saved on the request's path), dropped (not saved)",
            ["archive"],
            registry=r,
        )
        self.saves_skipped = Counter(
            "cacheproxy_saves_skipped",
            "Saves the cost model declined, by path (eviction, ahead, ram_cache: an eviction the "
            "server's RAM cache keeps) and reason: not_worth "
            "(expected reuse below the write), restore_loses (prefill beats a restore), no_room "
            "(an ahead save would push out the tenant's archives), busy (worth it with fewer "
            "slots busy, each of which would wait for the write)",
            ["path", "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "cacheproxy_rejected",
            "Requests refused with 503 because the queue was full",
            registry=r,
        )
        self.tenant_refused = Counter(
            "cacheproxy_tenant_refused",
            "Requests refused with 429 at a tenant's own limit",
            ["tenant", "limit"],
            registry=r,
        )
        # big request bodies spilled to the spill folder as they arrive (http/spill_budget.py)
        self.body_spilled_bytes = Gauge(
            "cacheproxy_body_spilled_bytes",
            "Bytes of big request bodies held in the spill folder now, reserved as they arrive",
            registry=r,
        )
        self.body_spill_refusals = Counter(
            "cacheproxy_body_spill_refusals",
            "Big request bodies refused at once because a spill bound was reached: tenant (429),"
            " proxy (503)",
            ["bound"],
            registry=r,
        )
        # several proxies (cluster/): which upstreams this one holds, and its hand-offs
        self.upstream_held = Gauge(
            "cacheproxy_upstream_held",
            "1 while this proxy holds the upstream's cluster lease, else 0",
            ["upstream"],
            registry=r,
        )
        # whose text each slot holds, kept for the next holder (slots/claims_keeper.py)
        self.slot_claims_written = Counter(
            "cacheproxy_slot_claims_written",
            "Slot claims written: disown (before another tenant's text may go there), claim"
            " (what a slot holds after requests)",
            ["kind"],
            registry=r,
        )
        self.slots_learnt = Counter(
            "cacheproxy_slots_learnt",
            "Slots holding something when a table was built afresh (a takeover, a start): claimed"
            " (a tenant's, as its claim says), unclaimed (nobody's)",
            ["result"],
            registry=r,
        )
        self.handoffs = Counter(
            "cacheproxy_handoffs",
            "Task requests sent to the proxy their conversation belongs to: sent, or served"
            " here because that proxy did not answer (unreachable); invalid: received with a"
            " hand-off header that is forged or stale, served as if it had none",
            ["outcome"],
            registry=r,
        )
        self.shared_limit_exchanges = Counter(
            "cacheproxy_shared_limit_exchanges",
            "Transactions with the tenants' limits shared between proxies: round (every"
            " renewal period), top_up (a request's allowance ran short), concurrency (a capped"
            " tenant's requests in progress)",
            ["kind"],
            registry=r,
        )

        # `[tracing] stage_clock` (ops/stage_clock.py): what each request stage took
        self.stage_seconds = Counter(
            "cacheproxy_stage_seconds",
            "Time spent in each request stage while the stage clock is on, wall clock or the"
            " loop thread's CPU (inclusive: forward holds upstream, place holds queue)",
            ["stage", "clock"],
            registry=r,
        )
        self.stage_entries = Counter(
            "cacheproxy_stage_entries",
            "Times each request stage ran while the stage clock is on",
            ["stage"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count(self, *increments: tuple[Counter, tuple[str, ...], float | None]) -> None:
        """`metric.labels(*values).inc(amount)` for each `(metric, values, amount)`, as of the
        registry's next read (a counter is only ever read there): what the request path
        counts, all of a request's counters in one call. An amount of None counts nothing
        (the labelled counter is not even made)."""
        counts = self._pending.counts
        for metric, values, amount in increments:
            if amount is None:
                continue
            key = (id(metric), values)
            entry = counts.get(key)
            if entry is None:
                counts[key] = [metric, values, amount]
            else:
                entry[2] += amount

    def waited_for_slot(self, reason: str, seconds: float) -> None:
        """A request waited `seconds` for a slot, still for `reason` when it was served (the
        scheduler's `on_waited`; slots/waiter.py names the reasons)."""
        self.count((self.queue_wait_by_reason, (reason,), seconds))

    def child(self, metric: MetricT, *values: str) -> MetricT:
        """`metric.labels(*values)`, looked up once per label values: prometheus_client takes
        a lock and checks the values on every `labels()` call, several per request."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


# a sample line: its name, its labels (a quoted value may hold `}` or an escaped quote), the rest
_SAMPLE = re.compile(rb'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?( .*)$')


def label_upstream(exposition: bytes, upstream: str) -> bytes:
    """Add `upstream="..."` to every sample of an upstream's /metrics text."""
    label = b'upstream="' + upstream.encode().replace(b'"', b'\\"') + b'"'
    lines = []
    for line in exposition.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            lines.append(line)
            continue
        name, labels, rest = match.groups()
        inner = labels[1:-1] + b"," + label if labels and labels != b"{}" else label
        lines.append(name + b"{" + inner + b"}" + rest)
    return b"\n".join(lines) + b"\n"


def merge_upstream_metrics(texts: list[tuple[str, bytes]]) -> bytes:
    """One exposition from several upstreams: each family's HELP/TYPE once, samples grouped."""
    families: dict[bytes, list[bytes]] = {}
    headers: dict[bytes, list[bytes]] = {}
    for upstream, text in texts:
        for line in label_upstream(text, upstream).splitlines():
            if line.startswith(b"# HELP ") or line.startswith(b"# TYPE "):
                name = line.split(b" ", 3)[2]
                family_headers = headers.setdefault(name, [])
                if line not in family_headers:
                    family_headers.append(line)
                families.setdefault(name, [])
            elif line and not line.startswith(b"#"):
                sample = _SAMPLE.match(line)
                if sample is None:
                    continue  # not a sample: one such line would fail the whole scrape
                families.setdefault(sample.group(1), []).append(line)
    out = []
    for name, samples in families.items():
        out.extend(headers.get(name, []))
        out.extend(samples)
    return b"\n".join(out) + b"\n"


def route_label(request: web.Request) -> str:
    """The route a request is timed under: its resource, the catch-all as "other"."""
    resource = request.match_info.route.resource
    canonical = resource.canonical if resource is not None else "unmatched"
    return "other" if "{tail" in canonical else canonical
