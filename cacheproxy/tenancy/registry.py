"""The tenant registry: tenants, their API keys (hashed), quotas, limits and public prefixes,
in SQLite or PostgreSQL (`tenancy/registry_schema.py` opens and migrates the database,
`tenancy/registry_records.py` holds the records and checks what a change may write).

One `TenantRegistry` per process owns one connection to the database. The proxy asks it on
every request who a key belongs to, so tenants and live keys are held in memory and re-read only
when another connection (the CLI, another proxy) committed a change: the `registry_changes`
counter says so, bumped by every change (on SQLite by triggers: the slot claims and leases in
the same file, written with every request, leave it alone). Every change is one write
transaction: it either happens whole or not at all.

The registry owns its thread hop. On an event loop it is opened with `aopen()`: its reads then
answer from memory only and never touch the database; `arefresh()` re-reads a stale snapshot and
the changes' async twins (`acreate`, `aupdate`, ...) write, each on a worker thread. The
connection is shared between threads under a lock. Where no loop runs (the command line,
start-up checks, tests) the same calls are made directly: `TenantRegistry(path).create(...)`.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import hmac
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cacheproxy.db.connection import DatabaseTarget, is_database_url
from cacheproxy.db.off_loop import off_loop
from cacheproxy.tenancy.limits import LIMIT_NAMES, NO_LIMITS, Limits
from cacheproxy.tenancy.registry_records import (
    API_KEY_PREFIX,
    KEY_DISPLAY_CHARS,
    MAX_API_KEY_CHARS,
    PublicPrefix,
    RegistryError,
    Tenant,
    hash_api_key,
    new_api_key,
    shown,
    valid_changes,
    valid_limits,
    valid_name,
    valid_new_tenant,
    valid_tokens,
)
from cacheproxy.tenancy.registry_schema import (
    failing_as_unusable,
    has_marker,
    mark_has_tenants,
    open_database,
)


class UnknownTenant(RegistryError, LookupError):
    pass


class UnknownPublicPrefix(RegistryError, LookupError):
    pass


class DuplicateName(RegistryError):
    pass


# The tenant everyone is while the registry holds no tenants: a single user needs no keys.
DEFAULT_TENANT = Tenant(
    id="default",
    name="default",
    disabled=False,
    hide_cache_signals=False,
    may_use_public_prefixes=True,
    quota_bytes=None,
    quota_archives=None,
)


@dataclass(frozen=True)
class _Snapshot:
    """What the registry holds, as of `data_version` (the `registry_changes` counter)."""

    data_version: int
    tenants: dict[str, Tenant]  # by id, in creation order
    live_keys: dict[str, tuple[str, str]]  # key hash -> (the stored hash, tenant id)
    key_prefix_by_tenant: dict[str, str]  # the live key's display prefix
    public_prefixes: tuple[PublicPrefix, ...]
    limits: dict[str, Limits]  # by tenant id, for tenants with limits of their own
    # keys this snapshot already accepted, and their tenants: a client sends its key with
    # every request, hashed once a snapshot (only live keys enter, so it stays that small)
    accepted: dict[str, Tenant] = dataclasses.field(default_factory=dict)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class TenantRegistry:
    """Tenants and their keys in the SQLite file at `database`, or the PostgreSQL database at
    a `postgresql://` URL (created, and migrated, on open).

    Raises `RegistryUnusable` when the database is unreadable, or when the SQLite file held
    tenants (its marker says so) and is now missing, empty or without tenants.
    """

    def __init__(
        self,
        database: DatabaseTarget,
        refresh_interval_s: float = 0.25,
        refresh_on_read: bool = True,
    ) -> None:
        self.target = database  # what it was opened with: a file, or a URL
        self.url = str(database) if is_database_url(database) else None
        # the SQLite file; None for PostgreSQL, whose server keeps the data
        self.path = None if self.url else Path(database)
        self.refresh_interval_s = refresh_interval_s
        # False: reads answer from memory only and the owner calls arefresh() (aopen's registry)
        self.refresh_on_read = refresh_on_read
        self._checked_at = float("-inf")
        # one connection, used from whichever worker thread runs a call: one call at a time
        self._lock = threading.RLock()
        # the re-read under way on the event loop, shared by the requests that wait for it
        self._refreshing: asyncio.Task[None] | None = None
        self._db = open_database(database)
        try:
            with failing_as_unusable(database):
                self._snapshot = self._read_snapshot()
        except BaseException:
            self._db.close()
            raise
        # whether it held tenants once (a SQLite file's marker says so): see has_tenants()
        self._marked = bool(self._snapshot.tenants) or has_marker(self.path)

    @classmethod
    async def aopen(
        cls, database: DatabaseTarget, refresh_interval_s: float = 0.25
    ) -> TenantRegistry:
        """The registry for an event loop, opened on a worker thread: its reads answer from
        memory only, `arefresh()` re-reads it when another connection changed it."""
        return await asyncio.to_thread(cls, database, refresh_interval_s, refresh_on_read=False)

    def _mark_has_tenants(self) -> None:
        self._marked = True
        mark_has_tenants(self.path)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    aclose = off_loop(close)

    def __enter__(self) -> TenantRegistry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reads: from the in-memory snapshot, refreshed when the file changed -----------------

    def has_tenants(self) -> bool:
        """Whether any tenant exists; disabled ones count (disabling all locks everyone out).

        Once the registry has held tenants (its marker exists), an emptied file seen while
        running still counts as having tenants: every key is refused rather than none needed.
        """
        return bool(self._fresh().tenants) or self._marked

    def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant whose live key this is, or None (unknown, revoked, or tenant disabled)."""
        if not api_key.startswith(API_KEY_PREFIX) or len(api_key) > MAX_API_KEY_CHARS:
            return None
        snapshot = self._fresh()
        accepted = snapshot.accepted.get(api_key)
        if accepted is not None:
            return accepted
        presented = hash_api_key(api_key)
        # The dict is keyed by the hash, so lookup timing says something about the hash at most,
        # which does not help find a key; the final comparison is constant-time all the same.
        stored_hash, tenant_id = snapshot.live_keys.get(presented, ("", ""))
        if not hmac.compare_digest(stored_hash, presented):
            return None
        tenant = snapshot.tenants[tenant_id]
        if tenant.disabled:
            return None
        snapshot.accepted[api_key] = tenant
        return tenant

    def list(self) -> list[Tenant]:
        return list(self._fresh().tenants.values())

    def get(self, tenant_id: str) -> Tenant:
        tenant = self._fresh().tenants.get(tenant_id)
        if tenant is None:
            raise UnknownTenant(f"no tenant with id {shown(tenant_id)}")
        return tenant

    def key_prefix(self, tenant_id: str) -> str | None:
        """The display prefix of the tenant's live key (None if it has none)."""
        return self._fresh().key_prefix_by_tenant.get(tenant_id)

    def api_keys(self, tenant_id: str) -> builtins.list[dict[str, Any]]:
        """Every key the tenant ever had, live and revoked, without secrets, oldest first."""
        self.get(tenant_id)
        with self._lock:
            return self._db.rows(
                "SELECT display_prefix, created_at, revoked_at FROM api_keys"
                " WHERE tenant_id = ? ORDER BY id",
                [tenant_id],
            )

    aapi_keys = off_loop(api_keys)

    # -- changes: one transaction each, then the snapshot is re-read ---------------------------

    def create(
        self,
        name: str,
        quota_bytes: int | None = None,
        quota_archives: int | None = None,
        hide_cache_signals: bool = False,
        may_use_public_prefixes: bool = True,
        **share: Any,
    ) -> tuple[Tenant, str]:
        """A new tenant and its API key; the key is returned here only and stored hashed.
        `share`: any of `SHARE_FIELDS` (weight, max_queued, max_concurrent, max_priority) and
        `models`, the models it may use (None: any)."""
        row = valid_new_tenant(
            name, quota_bytes, quota_archives, hide_cache_signals, may_use_public_prefixes, share
        )
        tenant_id = "t_" + secrets.token_hex(8)
        api_key = new_api_key()
        with self._change():
            self._require_free_name("tenants", row["name"])
            # before the commit: a crash in between fails closed (a marker and no tenant)
            self._mark_has_tenants()
            self._insert("tenants", {"id": tenant_id, **row, "disabled": 0, "created_at": _now()})
            self._insert_key(tenant_id, api_key)
        return self.get(tenant_id), api_key

    acreate = off_loop(create)

    def set_disabled(self, tenant_id: str, disabled: bool) -> Tenant:
        return self.update(tenant_id, disabled=disabled)

    def rotate_key(self, tenant_id: str) -> str:
        """A new key for the tenant; its previous keys stop working in the same transaction."""
        api_key = new_api_key()
        with self._change():
            self._require_tenant(tenant_id)
            self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE tenant_id = ? AND revoked_at IS NULL",
                [_now(), tenant_id],
            )
            self._insert_key(tenant_id, api_key)
        return api_key

    arotate_key = off_loop(rotate_key)

    def update(self, tenant_id: str, **fields: Any) -> Tenant:
        """Change any of `UPDATABLE_FIELDS`; quotas may be set to None (no limit)."""
        changes = valid_changes(fields)
        with self._change():
            self._require_tenant(tenant_id)
            if "name" in changes:
                self._require_free_name("tenants", changes["name"], except_id=tenant_id)
            if changes:
                assignments = ", ".join(f"{field} = ?" for field in changes)
                self._db.execute(
                    f"UPDATE tenants SET {assignments} WHERE id = ?", [*changes.values(), tenant_id]
                )
        return self.get(tenant_id)

    aupdate = off_loop(update)

    def add_public_prefix(self, name: str, tokens: builtins.list[int]) -> PublicPrefix:
        """Mark a token prefix as shareable between tenants (those allowed to use public ones)."""
        name = valid_name("name", name)
        tokens = valid_tokens(tokens)
        prefix_id = "pp_" + secrets.token_hex(8)
        with self._change():
            self._require_free_name("public_prefixes", name)
            self._insert(
                "public_prefixes",
                {
                    "id": prefix_id,
                    "name": name,
                    "tokens": json.dumps(tokens, separators=(",", ":")),
                    "n_tokens": len(tokens),
                    "created_at": _now(),
                },
            )
        return PublicPrefix(prefix_id, name, tokens)

    aadd_public_prefix = off_loop(add_public_prefix)

    def has_public_prefixes(self) -> bool:
        """Whether any public prefix exists (asked per request: no list is copied)."""
        return bool(self._fresh().public_prefixes)

    def public_prefixes(self) -> builtins.list[PublicPrefix]:
        """Every public prefix, oldest first (from memory: cheap enough to ask per request)."""
        return list(self._fresh().public_prefixes)

    def public_prefix(self, prefix_id: str) -> PublicPrefix:
        for prefix in self._fresh().public_prefixes:
            if prefix.id == prefix_id:
                return prefix
        raise UnknownPublicPrefix(f"no public prefix with id {shown(prefix_id)}")

    def remove_public_prefix(self, prefix_id: str) -> None:
        with self._change():
            cursor = self._db.execute("DELETE FROM public_prefixes WHERE id = ?", [prefix_id])
            if cursor.rowcount == 0:
                raise UnknownPublicPrefix(f"no public prefix with id {shown(prefix_id)}")

    aremove_public_prefix = off_loop(remove_public_prefix)

    def limits(self, tenant_id: str) -> Limits:
        """The tenant's own limits (unset ones None: the defaults apply), from memory."""
        return self._fresh().limits.get(tenant_id, NO_LIMITS)

    def set_limits(self, tenant_id: str, **limits: int | None) -> Limits:
        """Change any of the tenant's limits (`LIMIT_NAMES`); None: the default applies."""
        changes = valid_limits(limits)
        with self._change():
            self._require_tenant(tenant_id)
            current = Limits(**{**self._snapshot.limits.get(tenant_id, Limits()).as_dict()})
            row = {**current.as_dict(), **changes}
            row = {"tenant_id": tenant_id, **row, "updated_at": _now()}
            columns = ", ".join(row)
            assignments = ", ".join(f"{name} = excluded.{name}" for name in row)
            self._db.execute(
                f"INSERT INTO tenant_limits ({columns}) VALUES ({', '.join('?' for _ in row)})"
                f" ON CONFLICT (tenant_id) DO UPDATE SET {assignments}",
                list(row.values()),
            )
        return self.limits(tenant_id)

    aset_limits = off_loop(set_limits)

    # -- internals ---------------------------------------------------------------------------

    @contextmanager
    def _change(self) -> Iterator[None]:
        with self._lock:
            try:
                # the write lock is taken up front (waiting up to the busy timeout), so a change
                # never fails half-way because another process wrote between its read and write
                with self._db.write():
                    yield
                    self._db.execute("UPDATE registry_changes SET version = version + 1")
            finally:
                # what it wrote is read at once, not at the next check (also after a rollback)
                self._snapshot = self._read_snapshot()

    def snapshot_is_stale(self) -> bool:
        """Whether `refresh_interval_s` has passed since the file was last checked."""
        return time.monotonic() - self._checked_at >= self.refresh_interval_s

    def refresh(self) -> None:
        """Re-read the snapshot if another connection committed since (blocking: SQLite).

        Skipped while a change of ours holds the connection (it may wait seconds for another
        writer): the change re-reads the snapshot itself when it ends, and a reader is better
        served by the snapshot it has than by waiting."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._checked_at = time.monotonic()
            if self._data_version() != self._snapshot.data_version:
                self._snapshot = self._read_snapshot()
        finally:
            self._lock.release()

    async def arefresh(self) -> None:
        """`refresh` on a worker thread, once for everyone: callers that find the snapshot
        stale while a re-read is under way wait for that one, instead of each starting a
        thread of its own (which would find the connection busy and return without reading)."""
        running = self._refreshing
        if (
            running is None
            or running.done()
            or running.get_loop() is not asyncio.get_running_loop()
        ):
            running = self._refreshing = asyncio.create_task(
                asyncio.to_thread(self.refresh), name="tenant-registry-refresh"
            )
            running.add_done_callback(_retrieve_exception)
        # a caller that leaves does not cancel the read the others wait for
        await asyncio.shield(running)

    def _fresh(self) -> _Snapshot:
        # Asking for the change counter on every call would cost a query per request; changes
        # from another process (the CLI) are seen within `refresh_interval_s` instead.
        if self.refresh_on_read and self.snapshot_is_stale():
            self.refresh()
        return self._snapshot

    def _data_version(self) -> int:
        # every change of what the snapshot holds bumps the counter (on SQLite by triggers, so
        # a writer that bypasses this class does too); the file's PRAGMA data_version would
        # also move for every slot claim written to it
        return int(self._db.execute("SELECT version FROM registry_changes").fetchone()[0])

    def _read_snapshot(self) -> _Snapshot:
        db = self._db  # callers hold self._lock (or are the constructor)
        # creation order: SQLite's rowid; PostgreSQL has none, so the creation time, then id
        in_order = "created_at, id" if db.is_postgresql else "rowid"
        with db.read():  # one read transaction: a consistent view of all the reads
            # read the version first: a change that lands after it is seen on the next call
            version = self._data_version()
            tenants = {
                row["id"]: _tenant_from_row(row)
                for row in db.rows(f"SELECT * FROM tenants ORDER BY {in_order}")
            }
            key_rows = db.rows(
                "SELECT tenant_id, key_hash, display_prefix FROM api_keys WHERE revoked_at IS NULL"
            )
            public_prefixes = tuple(
                PublicPrefix(row["id"], row["name"], json.loads(row["tokens"]))
                for row in db.rows(f"SELECT * FROM public_prefixes ORDER BY {in_order}")
            )
            limits = {
                row["tenant_id"]: Limits(**{name: row[name] for name in LIMIT_NAMES})
                for row in db.rows("SELECT * FROM tenant_limits")
            }
        return _Snapshot(
            data_version=version,
            tenants=tenants,
            live_keys={row["key_hash"]: (row["key_hash"], row["tenant_id"]) for row in key_rows},
            key_prefix_by_tenant={row["tenant_id"]: row["display_prefix"] for row in key_rows},
            public_prefixes=public_prefixes,
            limits=limits,
        )

    def _insert(self, table: str, row: dict[str, Any]) -> None:
        self._db.execute(
            f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
            list(row.values()),
        )

    def _insert_key(self, tenant_id: str, api_key: str) -> None:
        self._insert(
            "api_keys",
            {
                "tenant_id": tenant_id,
                "key_hash": hash_api_key(api_key),
                "display_prefix": api_key[:KEY_DISPLAY_CHARS],
                "created_at": _now(),
                "revoked_at": None,
            },
        )

    def _require_tenant(self, tenant_id: str) -> None:
        found = self._db.execute("SELECT 1 FROM tenants WHERE id = ?", [tenant_id]).fetchone()
        if found is None:
            raise UnknownTenant(f"no tenant with id {shown(tenant_id)}")

    def _require_free_name(self, table: str, name: str, except_id: str | None = None) -> None:
        # names compare case-insensitively (names are ASCII): "Acme" and "acme" are one name
        other = "" if except_id is None else "AND id <> ?"
        found = self._db.execute(
            f"SELECT id FROM {table} WHERE lower(name) = lower(?) {other}",
            [name, *([] if except_id is None else [except_id])],
        ).fetchone()
        if found is not None:
            kind = "tenant" if table == "tenants" else "public prefix"
            raise DuplicateName(f"a {kind} named {name!r} already exists (names ignore case)")


def _tenant_from_row(row: dict[str, Any]) -> Tenant:
    return Tenant(
        id=row["id"],
        name=row["name"],
        disabled=bool(row["disabled"]),
        hide_cache_signals=bool(row["hide_cache_signals"]),
        may_use_public_prefixes=bool(row["may_use_public_prefixes"]),
        quota_bytes=row["quota_bytes"],
        quota_archives=row["quota_archives"],
        weight=row["weight"],
        max_queued=row["max_queued"],
        max_concurrent=row["max_concurrent"],
        max_priority=row["max_priority"],
        models=None if row.get("models") is None else tuple(json.loads(row["models"])),
    )


def _retrieve_exception(task: asyncio.Task[None]) -> None:
    # its waiters got the exception; without one left, asyncio would log it as never retrieved
    if not task.cancelled():
        task.exception()
