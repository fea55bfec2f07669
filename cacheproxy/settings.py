"""Settings: defaults < TOML file < `CACHEPROXY_*` environment < command-line flags.

Nothing is read at import time: `load_settings()` builds a `Settings` for the caller, and every
component receives the part it needs.

It stays one module (over 500 lines): one model per section of the TOML file, side by side, so
that the file, config/cacheproxy.toml and docs/configuration.md can be read against
each other in one place, and the loader validates them all together.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

ENV_PREFIX = "CACHEPROXY_"
MIB = 1 << 20

MIN_ADMIN_KEY_CHARS = 16


def long_enough_key(key: SecretStr | None) -> SecretStr | None:
    """An admin key or a cluster secret, refused when shorter than `MIN_ADMIN_KEY_CHARS`."""
    # pydantic's own min_length on a SecretStr words the rule as "items after validation"
    if key is not None and len(key.get_secret_value()) < MIN_ADMIN_KEY_CHARS:
        raise PydanticCustomError(
            "key_too_short",
            "must be at least {min_chars} characters long",
            {"min_chars": MIN_ADMIN_KEY_CHARS},
        )
    return key


Port = Annotated[int, Field(ge=0, le=65535)]
WILDCARDS = frozenset({"0.0.0.0", "::", ""})
# llama-server on a unix socket (`--host /path/server.sock`), as it prints its address
UNIX_SCHEME = "unix://"
MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108, its last one the terminating NUL
_HTTP_URL: TypeAdapter[AnyHttpUrl] = TypeAdapter(AnyHttpUrl)


def is_unix_url(url: str) -> bool:
    return url.startswith(UNIX_SCHEME)


def is_socket_path(host: str) -> bool:
    """As llama-server's --host: an address ending in .sock is the path of a unix socket."""
    return host.endswith(".sock")


def upstream_url(value: Any) -> str:
    """An upstream's base URL: `http(s)://host:port[/prefix]`, or `unix://` and the path of
    llama-server's socket (`unix:///run/llama/server.sock`; a relative path is taken from the
    current folder, where llama-server's `--host x.sock` binds it)."""
    if not isinstance(value, str) or not is_unix_url(value):
        return str(_HTTP_URL.validate_python(value))
    path = value[len(UNIX_SCHEME) :]
    if not path or path.endswith("/"):
        raise ValueError(f"a unix socket URL names the socket file: {value!r}")
    return UNIX_SCHEME + socket_path_that_fits(path)


def socket_path_that_fits(path: str) -> str:
    """`path` made absolute, or ValueError when a socket's address cannot hold it."""
    path = os.path.abspath(path)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"a unix socket path has at most {MAX_SOCKET_PATH_BYTES} bytes: {path!r}")
    return path


UpstreamUrl = Annotated[str, BeforeValidator(upstream_url)]


def default_state_dir() -> Path:
    """systemd's `StateDirectory` when run as a unit, else the XDG state folder."""
    systemd_state = os.environ.get("STATE_DIRECTORY")
    if systemd_state:
        return Path(systemd_state.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "cacheproxy"


class ManagedServerSettings(BaseModel):
    """A llama-server that cacheproxy starts, watches and restarts itself.

    Used when no `upstreams` are configured. With no `binary`, the pinned llama-server is built
    from source into the cache folder; with no `model`, a small random-weight demo model is made.
    """

    model_config = ConfigDict(extra="forbid")

    binary: Path | None = None
    model: Path | None = None
    # several models: a router-mode llama-server (no model of its own) serving the GGUF files of
    # a folder, or the models of a preset file, one instance per model, loaded on demand
    models_dir: Path | None = Field(None, description="--models-dir: a folder of GGUF models")
    models_preset: Path | None = Field(None, description="--models-preset: a preset INI file")
    models_max: int | None = Field(
        None, ge=0, description="--models-max: models loaded at once (unset: llama-server's 4)"
    )
    host: str = Field(
        "127.0.0.1",
        description="--host: an address, or a unix socket's path ending in .sock (relative: from"
        " the proxy's folder)",
    )
    port: Port = 0
    parallel: int = Field(4, ge=1, description="-np: slots; explicit, so KV is not unified")
    ctx_size: int = Field(16384, ge=0, description="-c: total context, shared by the slots")
    cache_ram_mib: int | None = Field(
        None,
        ge=-1,
        description="--cache-ram (-1 no limit, 0 off); unset: 0 while the disk tier runs (it does"
        " that cache's work, and tenants need it off), else llama-server's own default",
    )
    extra_args: list[str] = Field(default_factory=list, description="further llama-server flags")
    startup_timeout_s: float = Field(120.0, gt=0)
    restart_backoff_s: float = Field(1.0, gt=0)
    restart_backoff_max_s: float = Field(30.0, gt=0)

    @field_validator("host")
    @classmethod
    def socket_path_fits(cls, host: str) -> str:
        if is_socket_path(host):
            socket_path_that_fits(host)  # kept as given: the server binds it from this folder
        return host

    @model_validator(mode="after")
    def one_model_or_several(self) -> ManagedServerSettings:
        if self.model is not None and (self.models_dir or self.models_preset):
            raise ValueError(
                "give the managed llama-server one model (model, -m) or several (models_dir,"
                " models_preset), not both"
            )
        return self

    @property
    def router(self) -> bool:
        """Whether it runs as a router: several models, one instance each."""
        return self.models_dir is not None or self.models_preset is not None


class EmbeddedSettings(BaseModel):
    """The in-process llama-cpp-python engine (the `embedded` extra), used instead of a
    llama-server when `backend` says so, or by default when no upstream is configured and a
    model is given. It serves llama-server's API on a loopback port of its own."""

    model_config = ConfigDict(extra="forbid")

    model: Path | None = Field(None, description="GGUF model; unset: managed.model")
    port: Port = Field(0, description="loopback port of the engine's API; 0: a free one")
    parallel: int = Field(4, ge=1, description="slots, as llama-server's -np")
    ctx_size: int = Field(16384, ge=256, description="total context, shared by the slots")
    batch_size: int = Field(2048, ge=32, description="tokens per decode, as llama-server's -b")
    threads: int = Field(2, ge=1, description="CPU threads for decoding")
    prompt_cache: str = Field(
        "llama-server", description="RAM prompt-cache plugin (entry point cacheproxy.prompt_cache)"
    )
    prompt_cache_options: dict[str, Any] = Field(
        default_factory=dict, description="the plugin's own options, e.g. limit_bytes"
    )


class RoutingSettings(BaseModel):
    """How requests are placed on slots."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(
        "exact-prefix", description="routing plugin (entry point cacheproxy.routing)"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="the plugin's own options")
    max_queue: int = Field(256, ge=0, description="requests that may wait for a slot; then 503")
    server_ram_cache: Literal["auto", "on", "off"] = Field(
        "auto", description="whether upstreams answer pinned requests from their RAM cache"
    )
    server_ram_cache_mib: int = Field(
        8192,
        ge=-1,
        description="the upstreams' --cache-ram (llama-server's default), followed by the shadow"
        " from this figure on",
    )
    server_ram_cache_learn: bool = Field(
        True,
        description="the shadow's budget follows what the server's answers show its RAM cache"
        " keeps; false: server_ram_cache_mib is taken as a fact",
    )
    health_interval_s: float = Field(2.0, gt=0, description="how often upstreams are checked")
    health_timeout_s: float = Field(
        5.0, gt=0, description="an upstream that does not answer a check within this is down"
    )
    reconcile_interval_s: float = Field(30.0, gt=0, description="how often GET /slots is read")
    recheck_idle_s: float = Field(
        0.1,
        ge=0,
        description="an upstream sent nothing this long is checked (GET /slots) before the next"
        " placement on it: a restart meanwhile is found before it costs a prediction (0: never)",
    )
    session_header: str = Field("X-Session-Id", description="optional conversation affinity key")
    line_up: bool = Field(
        True,
        description="with every slot busy, a request is sent behind its tenant's running"
        " request, to start at the server as that one ends, where the disk tier would do nothing"
        " between them (upstreams whose RAM cache is off only)",
    )
    model_load_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a router-mode upstream's model instance that does not load within this"
        " is refused (the request asking for it gets the router's answer)",
    )
    mirror_memo_mib: int = Field(
        64, ge=0, description="memory for memoised prompt tokenizations (0: none kept)"
    )
    tokenize_in_process: bool = Field(
        True,
        description="prompts are tokenized in the proxy with the upstream's own model file"
        " (vocabulary only), once a battery of texts tokenizes there as the server does;"
        " false: every tokenization is a POST /tokenize",
    )


class SchedulingSettings(BaseModel):
    """Who is served next when requests wait for a slot: fair share between tenants, their
    bounds, priority classes. A tenant's own weight and limits are in the registry; these are
    the defaults for those it does not set."""

    model_config = ConfigDict(extra="forbid")

    fair_share: bool = Field(
        True, description="per-tenant queues served by weighted fair queuing; false: one FIFO"
    )
    max_queue_per_tenant: int = Field(
        64, ge=1, description="requests one tenant may have waiting for a slot; then 429"
    )
    max_concurrent_per_tenant: int | None = Field(
        None,
        ge=1,
        description="requests one tenant may have in the proxy at once (waiting or running);"
        " then 429. Unset: no cap",
    )
    share_window_s: float = Field(
        5.0,
        ge=0,
        description="a tenant may hold more than its weighted share of the slots only while no"
        " other tenant had a request in the proxy within this many seconds; while one had, a"
        " free slot is kept for each such tenant below its share",
    )
    prefill_chunk_ms: float = Field(
        10.0,
        ge=0,
        description="a tenant at or beyond its share of the slots while others are active has"
        " its prompt computed in chunks of about this much prefill (at the rate the upstream"
        " computes prompts), so another tenant's prompt waits for one chunk, not the whole"
        " prompt; 0: never",
    )
    priority_header: str = Field(
        "X-Priority", description="request header naming the class: interactive or batch"
    )
    default_priority: Literal["interactive", "batch"] = Field(
        "interactive", description="the class of a request without the header"
    )
    batch_factor: float = Field(
        0.5,
        gt=0,
        le=1,
        description="a batch request counts against its tenant's share as 1/batch_factor"
        " interactive ones",
    )


class DiskTierSettings(BaseModel):
    """Archived slot states on disk: saved when a slot is overwritten, restored when they pay.

    llama-server writes and reads the files itself, so `directory` must be every upstream's
    `--slot-save-path` (a managed llama-server is started with it). An upstream that saves
    elsewhere is served without the disk tier.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="save evicted slots and restore them on a match")
    directory: Path | None = Field(
        None, description="archive folder = the upstreams' --slot-save-path; unset: state_dir/slots"
    )
    upstream_save_paths: dict[str, Path] = Field(
        default_factory=dict,
        description="upstream URL -> its --slot-save-path as that host mounts the archive folder"
        " (another path to the same shared folder); unset: the same path as `directory`",
    )
    database: Path | None = Field(
        None, description="archive index (SQLite); unset: state_dir / archive.db"
    )
    budget_mib: int = Field(1024, gt=0, description="disk budget of all archives together")
    blocks: bool = Field(
        True,
        description="keep archives as blocks of KV cells, a prefix shared by several archives"
        " stored once (false: each archive one whole slot file, as llama-server wrote it)",
    )
    whole_copies: bool = Field(
        True,
        description="with blocks: an archive cut into blocks keeps its whole slot file while the"
        " budget has room (counted in the budget, not the tenant's quota, and removed first when"
        " room is needed); a restore reads it where that costs less than a file put together"
        " from the blocks (most of the archive)",
    )
    always_save: bool = Field(
        False,
        description="save every slot worth keeping that no archive holds, whatever the cost"
        " model says (every turn survives a restart, at the price of the server's save stalls)",
    )
    min_tokens: int = Field(
        256, ge=64, description="a slot is archived only when it holds at least this many tokens"
    )
    eviction: str = Field("lru", description="eviction plugin (entry point cacheproxy.eviction)")
    eviction_options: dict[str, Any] = Field(
        default_factory=dict, description="the eviction plugin's own options"
    )
    drain_on_shutdown: bool = Field(
        True, description="archive the live slots worth keeping when the proxy stops"
    )
    min_free_mib: float = Field(
        64, ge=0, description="free space a save must leave on the archive folder's file system"
    )
    recheck_interval_s: float = Field(
        10.0, gt=0, description="after a disk or index error, seconds before the tier retries"
    )
    busy_timeout_s: float = Field(
        5.0, gt=0, description="how long an index write waits for another process's lock"
    )
    ahead_mib_s: float = Field(
        64.0,
        ge=0,
        description="archive idle slots in the background at most this fast (MiB/s); 0: off",
    )
    ahead_idle_s: float = Field(
        0.2,
        ge=0,
        description="a slot is archived ahead only once idle this long (between two turns, the"
        " save is priced by the busy slots it stalls)",
    )
    ahead_interval_s: float = Field(
        0.5, gt=0, description="how often the background archiver looks for idle slots"
    )
    return_half_life_s: float = Field(
        600.0,
        gt=0,
        description="cost model: a conversation idle this long is half as likely to come back",
    )
    remeasure_s: float = Field(
        60.0,
        gt=0,
        description="a rate not measured for this long is measured again by one save or restore",
    )
    ram_cache_loss_chance: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "cost model: the chance a state the server's RAM cache keeps is gone (a restart,"
            " others' load) when its conversation comes back; 0: never save what it keeps"
        ),
    )

    def save_path_of(self, upstream_url: str, directory: Path) -> Path:
        """The archive folder as `upstream_url` sees it: its `--slot-save-path`."""
        for url, path in self.upstream_save_paths.items():
            if url.rstrip("/") == upstream_url.rstrip("/"):
                return path
        return directory


class TenancySettings(BaseModel):
    """The tenant registry and the admin API that manages it."""

    # a rejected key is never echoed, not even in str(ValidationError)
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    database: Path | None = Field(
        None, description="tenant registry (SQLite); unset: state_dir / cacheproxy.db"
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="key for /admin/...; unset: the admin API answers 403 permission_error",
    )

    @field_validator("admin_api_key")
    @classmethod
    def _long_enough(cls, key: SecretStr | None) -> SecretStr | None:
        return long_enough_key(key)


class UsageSettings(BaseModel):
    """The usage ledger: per tenant and hour, in SQLite, written in batches."""

    model_config = ConfigDict(extra="forbid")

    database: Path | None = Field(
        None, description="usage ledger (SQLite); unset: state_dir / usage.db"
    )
    flush_interval_s: float = Field(
        5.0,
        gt=0,
        description="how often the figures counted in memory are written; a kill -9 loses at"
        " most this much (SIGTERM loses nothing)",
    )
    retention_days: int = Field(
        400, ge=1, description="hours older than this are deleted from the ledger"
    )


class LimitSettings(BaseModel):
    """Default limits for every tenant (and the single user) without its own; unset: none."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=0, description="requests a minute")
    prompt_tokens_per_minute: int | None = Field(
        None, ge=0, description="prompt tokens a minute (cached ones included)"
    )
    generated_tokens_per_minute: int | None = Field(
        None, ge=0, description="generated tokens a minute, charged when an answer ends"
    )
    tokens_per_day: int | None = Field(
        None, ge=0, description="prompt + generated tokens a UTC day"
    )
    tokens_per_month: int | None = Field(
        None, ge=0, description="prompt + generated tokens a UTC calendar month"
    )


class ClientSettings(BaseModel):
    """How long a client may take: idle, slow-header and slow-body connections are cut."""

    model_config = ConfigDict(extra="forbid")

    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="an idle connection is closed after this long, as nginx's keepalive_timeout;"
        " it also bounds the time to send a complete request line and headers, counted from the"
        " connection's opening or the previous answer (aiohttp keeps one timer for both)",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="longest pause while a request body is sent, and its grace time"
    )
    body_min_bytes_per_s: int = Field(
        1024,
        ge=0,
        description="slowest body accepted: after body_timeout_s, every this many bytes buy one"
        " more second (Apache mod_reqtimeout's MinRate); 0: only the pause counts",
    )
    body_max_s: float = Field(
        300.0,
        gt=0,
        description="longest a request body may take in all, however it keeps pace: a body"
        " that keeps the rate above could otherwise take hours (100 MiB at 1024 bytes/s)",
    )


class BodySettings(BaseModel):
    """Request bodies over 1 MiB: written to a file as they arrive (the spill), parsed aside,
    and forwarded from the file; the bytes spilled at once are bounded."""

    model_config = ConfigDict(extra="forbid")

    spill_dir: Path | None = Field(
        None,
        description="folder of the spilled bodies; unset: state_dir/bodies (on disk: a tmpfs"
        " such as /dev/shm would hold them in RAM)",
    )
    max_spilled_bytes: int = Field(
        2048 * MIB,
        gt=0,
        description="bytes of all bodies spilled at once (being received or served); past it"
        " a big body gets 503 with Retry-After",
    )
    max_spilled_bytes_per_tenant: int = Field(
        512 * MIB,
        gt=0,
        description="the same, for one tenant (the single user is one); past it 429 with"
        " Retry-After",
    )


class TracingSettings(BaseModel):
    """OpenTelemetry spans of each request's stages (needs the `otel` extra when enabled)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="send spans; off: nothing is imported or recorded")
    otlp_endpoint: str = Field(
        "http://127.0.0.1:4318/v1/traces", description="the OTLP/HTTP traces endpoint"
    )
    service_name: str = Field("cacheproxy", description="the spans' service.name")
    export_timeout_s: float = Field(10.0, gt=0, description="bound on one export request")
    stage_clock: bool = Field(
        False,
        description="time each request's stages into cacheproxy_stage_seconds_total (a"
        " benchmark's breakdown; a few microseconds a stage; not with `enabled`)",
    )


class ClusterSettings(BaseModel):
    """Several proxies in front of the same upstreams, sharing the registry database (leases
    live there) and the archive. Off: one proxy holds every upstream, as always."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # a secret is never echoed

    enabled: bool = Field(False, description="hold upstreams by leases shared with other proxies")
    advertise_url: str | None = Field(
        None,
        description="this proxy's URL as the other proxies reach it (hand-offs);"
        " unset: http://host:port",
    )
    proxy_id: str | None = Field(
        None, description="this proxy's name in the lease table; unset: its advertise_url"
    )
    lease_ttl_s: float = Field(
        15.0, gt=0, description="a lease not renewed for this long may be taken over"
    )
    renew_interval_s: float | None = Field(
        None, gt=0, description="how often leases are renewed and free ones taken; unset: ttl/3"
    )
    handoff: bool = Field(
        True, description="send a request to the proxy its conversation hashes to"
    )
    key_prefix_tokens: int = Field(
        256,
        ge=16,
        description="a conversation is known by its tenant and the first this many prompt tokens"
        " (4 characters each for text); chat by its first messages",
    )
    handoff_timeout_s: float = Field(
        2.0, gt=0, description="connecting to the owner proxy; then the request is served here"
    )
    secret: SecretStr | None = Field(
        None,
        description="the key hand-offs are signed with (HMAC-SHA256), the same on every proxy;"
        " unset: a random one kept in the shared database",
    )
    handoff_window_s: float = Field(
        10.0,
        gt=0,
        description="a hand-off's signature is accepted this long either way of its time (the"
        " proxies' clocks must agree within it); later, the request is served as if it had none",
    )

    @field_validator("secret")
    @classmethod
    def _secret_long_enough(cls, key: SecretStr | None) -> SecretStr | None:
        return long_enough_key(key)

    @model_validator(mode="after")
    def _renewal_within_ttl(self) -> ClusterSettings:
        if self.renew_interval_s is not None and self.renew_interval_s * 2 > self.lease_ttl_s:
            raise ValueError("cluster.renew_interval_s must be at most half of lease_ttl_s")
        return self

    def renewal_s(self) -> float:
        return self.renew_interval_s or self.lease_ttl_s / 3

    def takeover_bound_s(self) -> float:
        """A dead holder's upstream is taken over at most this long after its last renewal."""
        return self.lease_ttl_s + self.renewal_s()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        # str(ValidationError) would echo rejected values, keys among them; describe_settings_errors
        # in cli/common.py shows the ones that are not secret
        hide_input_in_errors=True,
    )

    host: str = Field(
        "127.0.0.1",
        description="addresses to listen on, as llama-server's --host: comma-separated, a path"
        " ending in .sock a unix socket",
    )
    port: Port = Field(8080, description="port to listen on, as llama-server's --port")
    upstreams: Annotated[list[UpstreamUrl], NoDecode] = Field(
        default_factory=list,
        description="llama-server base URLs (or unix:///path/server.sock, its unix socket);"
        " empty: start a managed one",
    )
    upstream_api_key: SecretStr | None = Field(
        None, description="key the proxy sends upstream; clients never see it"
    )
    upstream_ca_file: Path | None = Field(
        None,
        description="PEM file of the CA (or self-signed certificate) https upstreams are checked"
        " against, as llama-server's --ssl-cert-file; unset: the system's",
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="keys clients present while no tenants exist, as llama-server's --api-key;"
        " empty: the upstream_api_key, if set, else no key is needed",
    )
    upstream_connect_timeout_s: float = Field(5.0, gt=0)
    upstream_read_timeout_s: float = Field(
        3600.0, gt=0, description="longest silence from an upstream, as llama-server's --timeout"
    )
    max_body_bytes: int = Field(
        100 * MIB, gt=0, description="largest request body; llama-server's own limit is 100 MB"
    )
    state_dir: Path = Field(default_factory=default_state_dir)
    database_url: str | None = Field(
        None,
        pattern=r"^postgres(ql)?://",
        description="PostgreSQL database for the tenant registry, archive index and usage"
        " ledger (postgresql://user@host:port/db), shared by several proxies; unset: the"
        " SQLite files",
    )
    shutdown_timeout_s: float = Field(
        30.0,
        gt=0,
        description="SIGTERM to exit: requests in flight get the first half, the disk tier's"
        " drain the rest; what is left then is cut and named in the log",
    )
    upstream_metrics_interval_s: float = Field(
        15.0,
        gt=0,
        description="how often several upstreams' /metrics are scraped for GET /metrics",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="the proxy's event loop; auto: uvloop when it can be imported, else"
        " asyncio's own",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = Field(
        "text", description="json: one JSON object per line, request fields as keys"
    )
    backend: Literal["auto", "llama-server", "embedded"] = Field(
        "auto",
        description="what serves when no upstreams are configured; auto: the embedded engine"
        " when a model is given and llama-cpp-python is installed, else a managed llama-server",
    )
    managed: ManagedServerSettings = Field(default_factory=ManagedServerSettings)
    embedded: EmbeddedSettings = Field(default_factory=EmbeddedSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    scheduling: SchedulingSettings = Field(default_factory=SchedulingSettings)
    tenants: TenancySettings = Field(default_factory=TenancySettings)
    disk: DiskTierSettings = Field(default_factory=DiskTierSettings)
    clients: ClientSettings = Field(default_factory=ClientSettings)
    bodies: BodySettings = Field(default_factory=BodySettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)

    @field_validator("upstreams", "api_keys", mode="before")
    @classmethod
    def _split_comma_list(cls, value: Any) -> Any:
        # CACHEPROXY_UPSTREAMS="http://a:8080,http://b:8080" as well as a JSON list; keys alike,
        # as llama-server's --api-key K1,K2
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # first wins: flags (init), then the environment, then the TOML file, then defaults
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _toml_file_var.get()
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    def single_user_keys(self) -> list[str]:
        """The keys a client must present while no tenants exist (none: no key needed)."""
        keys = self.api_keys or ([self.upstream_api_key] if self.upstream_api_key else [])
        return [key.get_secret_value() for key in keys]

    def listen_hosts(self) -> list[str]:
        """As llama-server's --host: "127.0.0.1,::1" listens on both (a path ending in .sock:
        a unix socket)."""
        return [host.strip() for host in self.host.split(",") if host.strip()]

    def upstream_urls(self) -> list[str]:
        return [str(url).rstrip("/") for url in self.upstreams]

    @model_validator(mode="after")
    def _save_paths_name_upstreams(self) -> Settings:
        # a mapping for a URL no upstream has would silently apply to nothing
        mapped = {url.rstrip("/") for url in self.disk.upstream_save_paths}
        unknown = sorted(mapped - set(self.upstream_urls()))
        if unknown:
            raise ValueError(
                f"disk.upstream_save_paths names {', '.join(unknown)}, not among `upstreams`"
            )
        return self

    @model_validator(mode="after")
    def _cluster_is_reachable(self) -> Settings:
        # the other proxies hand requests to advertise_url: a wildcard address or a unix
        # socket reaches nobody
        sockets = any(is_socket_path(host) for host in self.listen_hosts())
        unreachable = self.host in WILDCARDS or sockets
        if self.cluster.enabled and not self.cluster.advertise_url and unreachable:
            raise ValueError(
                f"cluster.advertise_url must be set when listening on {self.host!r}: the URL"
                " the other proxies reach this one at"
            )
        return self

    # The databases: `database_url` (all three in one PostgreSQL database) or each SQLite file.
    def tenant_database(self) -> Path | str:
        return self.database_url or self.tenants.database or self.state_dir / "cacheproxy.db"

    def archive_directory(self) -> Path:
        return self.disk.directory or self.state_dir / "slots"

    def managed_settings(self) -> ManagedServerSettings:
        """The managed llama-server's settings, its RAM cache decided when not set: off while
        the disk tier runs, which saves and restores what that cache would keep (beside it the
        cache brings nothing back and costs both processes CPU: docs/drop-in.md), and which a
        tenant needs off (a cache shared by all slots is refused while tenants exist); else
        llama-server's own default (None: no flag)."""
        managed = self.managed
        if managed.cache_ram_mib is None and self.disk.enabled:
            return managed.model_copy(update={"cache_ram_mib": 0})
        return managed

    def archive_database(self) -> Path | str:
        return self.database_url or self.disk.database or self.state_dir / "archive.db"

    def body_spill_dir(self) -> Path:
        return self.bodies.spill_dir or self.state_dir / "bodies"

    def usage_database(self) -> Path | str:
        return self.database_url or self.usage.database or self.state_dir / "usage.db"

    def advertise_url(self) -> str:
        """Where the other proxies of a cluster reach this one."""
        return (self.cluster.advertise_url or f"http://{self.host}:{self.port}").rstrip("/")

    def proxy_id(self) -> str:
        return self.cluster.proxy_id or self.advertise_url()


# The TOML path is per call, not per class: a context variable carries it into the source hook.
_toml_file_var: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "cacheproxy_toml_file", default=None
)


# words in a key's name (split at "_" and "-") that make its value a secret, for free-form keys
# such as plugin options
SECRET_NAME_WORDS = frozenset(
    {
        "key",
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "credential",
        "credentials",
        "authorization",
    }
)


def is_secret_field(location: tuple[int | str, ...]) -> bool:
    """Whether a setting at `location` (a validation error's `loc`) holds a secret: a
    `SecretStr` field of the model, or any key whose name says it is one."""
    model: Any = Settings
    for part in location:
        if isinstance(part, str) and SECRET_NAME_WORDS & set(re.split(r"[_\-]", part.lower())):
            return True
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            model = None  # a list index or a free-form key: no more declared types below
            continue
        if "SecretStr" in repr(field.annotation):
            return True
        model = _model_in(field.annotation)
    return False


def _model_in(annotation: Any) -> Any:
    """The pydantic model a field's annotation names, if any (`X | None` included)."""
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


class ConfigFileError(ValueError):
    """The configuration file is missing or is not valid TOML."""


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the effective settings; `overrides` are command-line flags (None means not given)."""
    if config_file is not None:
        _check_toml_file(config_file)
    given = {key: value for key, value in overrides.items() if value is not None}
    token = _toml_file_var.set(config_file)
    try:
        return Settings(**given)
    finally:
        _toml_file_var.reset(token)


def _check_toml_file(path: Path) -> None:
    import tomllib

    try:
        with open(path, "rb") as handle:
            tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigFileError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"config file {path} is not valid TOML: {exc}") from exc
