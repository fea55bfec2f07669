"""The tenant registry: tenants, their API keys (hashed), quotas and public prefixes, in SQLite
or PostgreSQL (`cacheproxy.db`).

One `TenantRegistry` per process owns one connection to the database. The proxy asks it on
every request who a key belongs to, so tenants and live keys are held in memory and re-read only
when another connection (the CLI, another proxy) committed a change: SQLite's
`PRAGMA data_version` says so for a file, the `registry_changes` counter (bumped by every change)
for PostgreSQL. Every change is one write transaction: it either happens whole or not at all.

The proxy opens it with `refresh_on_read=False`: then no read touches SQLite, and the event loop
calls `refresh()` (and every change) in a worker thread; the connection is shared between
threads under a lock. It stays one module (over 500 lines) because the schema, the snapshot and
the validated changes share one transaction discipline.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import hmac
import json
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cacheproxy.db.connection import (
    DATABASE_ERRORS,
    Database,
    DatabaseTarget,
    connect,
    is_database_url,
    is_lock_timeout,
    shown_target,
)
from cacheproxy.db.migrations import Migrations
from cacheproxy.tenancy.limits import LIMIT_NAMES, NO_LIMITS, Limits

API_KEY_PREFIX = "cpk_"
# "cpk_" and the first 8 characters of the random part: enough to tell keys apart in a listing,
# far too little to help guess the other 35.
KEY_DISPLAY_CHARS = len(API_KEY_PREFIX) + 8
# longer than any key we issue; anything longer is rejected before hashing
MAX_API_KEY_CHARS = 256
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_QUOTA = (1 << 63) - 1  # SQLite's INTEGER range, PostgreSQL's BIGINT
MAX_TOKEN_ID = (1 << 31) - 1
MAX_PUBLIC_PREFIX_TOKENS = 1 << 18
BUSY_TIMEOUT_S = 5.0

MAX_WEIGHT = 1000.0
PRIORITY_CLASSES = ("interactive", "batch")  # the highest first

TENANT_FIELDS = ("disabled", "hide_cache_signals", "may_use_public_prefixes")
QUOTA_FIELDS = ("quota_bytes", "quota_archives")
# fair share: weight, and the bounds that default to the scheduling settings when null
SHARE_FIELDS = ("weight", "max_queued", "max_concurrent", "max_priority")
UPDATABLE_FIELDS = ("name", *TENANT_FIELDS, *QUOTA_FIELDS, *SHARE_FIELDS)


class RegistryError(Exception):
    """A change the registry refused; nothing was written."""


class RegistryUnusable(RegistryError):
    """The registry file cannot be trusted (lost, emptied, unreadable): the proxy must not start.

    The message is one line naming the file and the fix, for an operator to read.
    """


class UnknownTenant(RegistryError, LookupError):
    pass


class UnknownPublicPrefix(RegistryError, LookupError):
    pass


class DuplicateName(RegistryError):
    pass


class InvalidField(RegistryError, ValueError):
    pass


@dataclass(frozen=True)
class Tenant:
    id: str  # opaque ("t_" + 16 hex), never derived from the name: names appear in no file or label
    name: str
    disabled: bool
    hide_cache_signals: bool  # show this tenant every answer as an uncached run would be
    may_use_public_prefixes: bool
    quota_bytes: int | None  # archive bytes on disk; None: no limit
    quota_archives: int | None  # archived states; None: no limit
    weight: float = 1.0  # its share of the slots against other waiting tenants'
    max_queued: int | None = None  # requests it may have waiting; None: the setting's default
    max_concurrent: int | None = None  # requests in the proxy at once; None: the setting's
    max_priority: str = "interactive"  # the highest class its requests may ask for


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
class PublicPrefix:
    id: str  # opaque ("pp_" + 16 hex)
    name: str
    tokens: list[int]


@dataclass(frozen=True)
class _Snapshot:
    """What the registry holds, as of `data_version`."""

    data_version: int
    tenants: dict[str, Tenant]  # by id, in creation order
    live_keys: dict[str, tuple[str, str]]  # key hash -> (the stored hash, tenant id)
    key_prefix_by_tenant: dict[str, str]  # the live key's display prefix
    public_prefixes: tuple[PublicPrefix, ...]
    limits: dict[str, Limits]  # by tenant id, for tenants with limits of their own
    # keys this snapshot already accepted, and their tenants: a client sends its key with
    # every request, hashed once a snapshot (only live keys enter, so it stays that small)
    accepted: dict[str, Tenant] = dataclasses.field(default_factory=dict)


def tenant_summary(tenant: Tenant, key_prefix: str | None) -> dict[str, Any]:
    """A tenant as the admin API and the CLI print it."""
    return {**asdict(tenant), "key_prefix": key_prefix}


def hash_api_key(api_key: str) -> str:
    # A plain sha256 suffices because every key is 32 random bytes: there is nothing to brute-force
    # that a slow, salted hash would protect (unlike a human-chosen password).
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


MIGRATIONS = Migrations("cacheproxy.tenants")

# Migrations are append-only: once released, a migration is never edited, only followed by another.
# The SQLite texts are those released before PostgreSQL was supported; PostgreSQL's say the same
# with its types (BIGINT for SQLite's 64-bit INTEGER, DOUBLE PRECISION for REAL), a unique index
# on lower(name) for COLLATE NOCASE, and no STRICT.
MIGRATIONS.add(
    "m001_tenants_keys_public_prefixes",
    sqlite="""
        CREATE TABLE tenants (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE COLLATE NOCASE CHECK (length(name) BETWEEN 1 AND 64),
            disabled INTEGER NOT NULL DEFAULT 0 CHECK (disabled IN (0, 1)),
            hide_cache_signals INTEGER NOT NULL DEFAULT 0 CHECK (hide_cache_signals IN (0, 1)),
            may_use_public_prefixes INTEGER NOT NULL DEFAULT 1
                CHECK (may_use_public_prefixes IN (0, 1)),
            quota_bytes INTEGER CHECK (quota_bytes IS NULL OR quota_bytes >= 0),
            quota_archives INTEGER CHECK (quota_archives IS NULL OR quota_archives >= 0),
            created_at TEXT NOT NULL
        ) STRICT;

        CREATE TABLE api_keys (
            id INTEGER PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id),
            key_hash TEXT NOT NULL UNIQUE,
            display_prefix TEXT NOT NULL,
            created_at TEXT NOT NULL,
            revoked_at TEXT
        ) STRICT;
        -- at most one live key per tenant, whatever writes the file
        CREATE UNIQUE INDEX api_keys_one_live_key_per_tenant
            ON api_keys(tenant_id) WHERE revoked_at IS NULL;

        CREATE TABLE public_prefixes (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE COLLATE NOCASE CHECK (length(name) BETWEEN 1 AND 64),
            tokens TEXT NOT NULL CHECK (json_valid(tokens)),  -- a JSON array of token ids
            n_tokens INTEGER NOT NULL CHECK (n_tokens > 0),
            created_at TEXT NOT NULL
        ) STRICT;
    """,
    postgresql="""
        CREATE TABLE tenants (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 64),
            disabled INTEGER NOT NULL DEFAULT 0 CHECK (disabled IN (0, 1)),
            hide_cache_signals INTEGER NOT NULL DEFAULT 0 CHECK (hide_cache_signals IN (0, 1)),
            may_use_public_prefixes INTEGER NOT NULL DEFAULT 1
                CHECK (may_use_public_prefixes IN (0, 1)),
            quota_bytes BIGINT CHECK (quota_bytes IS NULL OR quota_bytes >= 0),
            quota_archives BIGINT CHECK (quota_archives IS NULL OR quota_archives >= 0),
            created_at TEXT NOT NULL
        );
        CREATE UNIQUE INDEX tenants_name_ignoring_case ON tenants (lower(name));

        CREATE TABLE api_keys (
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id),
            key_hash TEXT NOT NULL UNIQUE,
            display_prefix TEXT NOT NULL,
            created_at TEXT NOT NULL,
            revoked_at TEXT
        );
        CREATE UNIQUE INDEX api_keys_one_live_key_per_tenant
            ON api_keys(tenant_id) WHERE revoked_at IS NULL;

        CREATE TABLE public_prefixes (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 64),
            tokens TEXT NOT NULL CHECK (json_typeof(tokens::json) = 'array'),
            n_tokens BIGINT NOT NULL CHECK (n_tokens > 0),
            created_at TEXT NOT NULL
        );
        CREATE UNIQUE INDEX public_prefixes_name_ignoring_case ON public_prefixes (lower(name));
    """,
)

_FAIR_SHARE = """
    ALTER TABLE tenants ADD COLUMN weight {float} NOT NULL DEFAULT 1.0
        CHECK (weight > 0 AND weight <= 1000);
    ALTER TABLE tenants ADD COLUMN max_queued {int}
        CHECK (max_queued IS NULL OR max_queued >= 1);
    ALTER TABLE tenants ADD COLUMN max_concurrent {int}
        CHECK (max_concurrent IS NULL OR max_concurrent >= 1);
    ALTER TABLE tenants ADD COLUMN max_priority TEXT NOT NULL DEFAULT 'interactive'
        CHECK (max_priority IN ('interactive', 'batch'));
"""
MIGRATIONS.add("m002_fair_share", _FAIR_SHARE)


# Rate limits and budgets live in a table of their own: the tenants table keeps who a tenant
# is and its share of the slots (m002).
def _tenant_limits(db: Database) -> str:
    integer, strict = ("BIGINT", "") if db.is_postgresql else ("INTEGER", "STRICT")
    checks = " ".join(
        f"{name} {integer} CHECK ({name} IS NULL OR {name} >= 0)," for name in LIMIT_NAMES
    )
    return f"""
        CREATE TABLE tenant_limits (
            tenant_id TEXT PRIMARY KEY REFERENCES tenants(id),
            {checks}
            updated_at TEXT NOT NULL
        ) {strict};
    """


MIGRATIONS.add("m003_tenant_limits", sqlite=_tenant_limits, postgresql=_tenant_limits)

# A counter every change bumps: how a PostgreSQL registry tells that another connection
# committed (SQLite's PRAGMA data_version has no PostgreSQL equivalent).
MIGRATIONS.add(
    "m004_registry_changes",
    """
    CREATE TABLE registry_changes (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        version {int} NOT NULL
    ) {strict};
    INSERT INTO registry_changes (id, version) VALUES (1, 0);
    """,
)


# The lease tables of several proxies on one database (step m005_cluster_leases, released in
# this set) are created by their own set now, in cluster/leases.py.


def tenants_marker(path: Path) -> Path:
    """The file beside the registry that says it once held tenants.

    It lives outside the database on purpose: a registry file that is deleted, emptied or
    overwritten cannot take with it the knowledge that keys were required. It is written before
    the first tenant is committed and removed by nothing but an operator, so a lost registry
    fails closed (no start) rather than open (every request served without a key).
    """
    return path.with_name(path.name + ".has-tenants")


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
        # the SQLite file and its marker; None for PostgreSQL, whose server keeps the data
        self.path = None if self.url else Path(database)
        self.marker = None if self.path is None else tenants_marker(self.path)
        self.refresh_interval_s = refresh_interval_s
        # False: reads answer from memory only and the owner calls refresh() (off its event loop)
        self.refresh_on_read = refresh_on_read
        self._checked_at = float("-inf")
        # one connection, used from whichever worker thread runs a call: one call at a time
        self._lock = threading.RLock()
        is_new = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            is_new = not self.path.exists()
            if self._has_marker() and (is_new or self.path.stat().st_size == 0):
                raise self._lost("is missing or empty")
        try:
            self._db = connect(database, busy_timeout_s=BUSY_TIMEOUT_S, lock_name="registry")
        except DATABASE_ERRORS as exc:
            if is_lock_timeout(exc):
                raise
            raise self._unusable(exc) from exc
        if is_new and self.path is not None:
            # key hashes are not secrets, but tenant names and quotas are nobody else's business
            self.path.chmod(0o600)
        try:
            if not self._db.is_postgresql:
                self._db.execute("PRAGMA foreign_keys = ON")
            MIGRATIONS.migrate(self._db)
            self._snapshot = self._read_snapshot()
        except DATABASE_ERRORS as exc:
            self._db.close()
            if is_lock_timeout(exc):
                raise
            raise self._unusable(exc) from exc
        except BaseException:
            self._db.close()
            raise
        self._marked = self._has_marker()
        try:
            if self._snapshot.tenants:
                self._mark_has_tenants()  # a registry from before the marker existed
            elif self._marked:
                # the first tenant's creator writes the marker before it commits: wait for its
                # write lock, then look again
                with self._db.write():
                    pass
                self._snapshot = self._read_snapshot()
                if not self._snapshot.tenants:
                    raise self._lost("holds no tenants")
        except BaseException:
            self._db.close()
            raise

    def _has_marker(self) -> bool:
        return self.marker is not None and self.marker.exists()

    def _unusable(self, exc: Exception) -> RegistryUnusable:
        if self.path is None:
            return RegistryUnusable(
                f"tenant registry {shown_target(str(self.url))} cannot be used ({exc}): check"
                " that the PostgreSQL server runs and database_url names a database this user"
                " may create tables in"
            )
        if isinstance(exc, sqlite3.OperationalError):
            return RegistryUnusable(
                f"tenant registry {self.path} cannot be opened ({exc}): make"
                f" {self.path.parent} writable by this user, or set tenants.database"
            )
        return RegistryUnusable(
            f"tenant registry {self.path} is not a usable SQLite file ({exc}): restore it"
            " from a backup"
            + (
                ""
                if self._has_marker()
                else ", or move it away to start with no tenants (no keys needed)"
            )
        )

    def _lost(self, what: str) -> RegistryUnusable:
        return RegistryUnusable(
            f"tenant registry {self.path} {what} but held tenants (so says {self.marker}):"
            f" restore it from a backup, or delete {self.marker} to run with no tenants"
            " (every request served without a key)"
        )

    def _mark_has_tenants(self) -> None:
        self._marked = True
        if self.marker is not None and not self.marker.exists():
            self.marker.write_text(
                "This tenant registry has held tenants. While this file exists, the proxy\n"
                "refuses to start from a registry that is missing, empty or unreadable.\n"
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
            raise UnknownTenant(f"no tenant with id {_shown(tenant_id)}")
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
        `share`: any of `SHARE_FIELDS` (weight, max_queued, max_concurrent, max_priority)."""
        unknown = sorted(set(share) - set(SHARE_FIELDS))
        if unknown:
            raise InvalidField(f"unknown field(s) {', '.join(map(_shown, unknown))}")
        row = {
            **{field: _valid_share(field, value) for field, value in share.items()},
            "name": _valid_name("name", name),
            "quota_bytes": _valid_quota("quota_bytes", quota_bytes),
            "quota_archives": _valid_quota("quota_archives", quota_archives),
            "hide_cache_signals": int(_valid_flag("hide_cache_signals", hide_cache_signals)),
            "may_use_public_prefixes": int(
                _valid_flag("may_use_public_prefixes", may_use_public_prefixes)
            ),
        }
        tenant_id = "t_" + secrets.token_hex(8)
        api_key = new_api_key()
        with self._change():
            self._require_free_name("tenants", row["name"])
            # before the commit: a crash in between fails closed (a marker and no tenant)
            self._mark_has_tenants()
            self._insert("tenants", {"id": tenant_id, **row, "disabled": 0, "created_at": _now()})
            self._insert_key(tenant_id, api_key)
        return self.get(tenant_id), api_key

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

    def update(self, tenant_id: str, **fields: Any) -> Tenant:
        """Change any of `UPDATABLE_FIELDS`; quotas may be set to None (no limit)."""
        unknown = sorted(set(fields) - set(UPDATABLE_FIELDS))
        if unknown:
            raise InvalidField(
                f"cannot update {', '.join(map(_shown, unknown))}; "
                f"updatable: {', '.join(UPDATABLE_FIELDS)}"
            )
        changes: dict[str, Any] = {}
        for field, value in fields.items():
            if field == "name":
                changes[field] = _valid_name(field, value)
            elif field in QUOTA_FIELDS:
                changes[field] = _valid_quota(field, value)
            elif field in SHARE_FIELDS:
                changes[field] = _valid_share(field, value)
            else:
                changes[field] = int(_valid_flag(field, value))  # 0/1 columns on both backends
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

    def add_public_prefix(self, name: str, tokens: builtins.list[int]) -> PublicPrefix:
        """Mark a token prefix as shareable between tenants (those allowed to use public ones)."""
        name = _valid_name("name", name)
        tokens = _valid_tokens(tokens)
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
        raise UnknownPublicPrefix(f"no public prefix with id {_shown(prefix_id)}")

    def remove_public_prefix(self, prefix_id: str) -> None:
        with self._change():
            cursor = self._db.execute("DELETE FROM public_prefixes WHERE id = ?", [prefix_id])
            if cursor.rowcount == 0:
                raise UnknownPublicPrefix(f"no public prefix with id {_shown(prefix_id)}")

    def limits(self, tenant_id: str) -> Limits:
        """The tenant's own limits (unset ones None: the defaults apply), from memory."""
        return self._fresh().limits.get(tenant_id, NO_LIMITS)

    def set_limits(self, tenant_id: str, **limits: int | None) -> Limits:
        """Change any of the tenant's limits (`LIMIT_NAMES`); None: the default applies."""
        unknown = sorted(set(limits) - set(LIMIT_NAMES))
        if unknown:
            raise InvalidField(
                f"cannot set {', '.join(map(_shown, unknown))}; limits: {', '.join(LIMIT_NAMES)}"
            )
        changes = {name: _valid_quota(name, value) for name, value in limits.items()}
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
                # our own commits do not move data_version: re-read (also after a rollback)
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

    def _fresh(self) -> _Snapshot:
        # Asking SQLite for data_version on every call would cost a query per request; changes
        # from another process (the CLI) are seen within `refresh_interval_s` instead.
        if self.refresh_on_read and self.snapshot_is_stale():
            self.refresh()
        return self._snapshot

    def _data_version(self) -> int:
        if self._db.is_postgresql:
            return int(self._db.execute("SELECT version FROM registry_changes").fetchone()[0])
        # also moves for writers that bypass this class (an operator's sqlite3 session)
        return int(self._db.execute("PRAGMA data_version").fetchone()[0])

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
            raise UnknownTenant(f"no tenant with id {_shown(tenant_id)}")

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
    )


def _shown(value: object, limit: int = 80) -> str:
    """A value for an error message, cut short: messages must not echo arbitrary input whole."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _valid_name(field: str, value: object) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise InvalidField(
            f"{field} must be 1-64 characters of A-Z a-z 0-9 _ . - (got {_shown(value)})"
        )
    return value


def _valid_quota(field: str, value: object) -> int | None:
    if value is None:
        return None
    # bool is an int in Python; a quota of True is a mistake, not 1
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUOTA:
        raise InvalidField(
            f"{field} must be a whole number from 0 to {MAX_QUOTA}, or null (got {_shown(value)})"
        )
    return value


def _valid_share(field: str, value: object) -> float | int | str | None:
    """A fair-share field: weight in (0, 1000], a bound >= 1 or None, a priority class."""
    if field == "weight":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidField(
                f"weight must be a number above 0, at most 1000 (got {_shown(value)})"
            )
        if not 0 < value <= MAX_WEIGHT:
            raise InvalidField(
                f"weight must be a number above 0, at most 1000 (got {_shown(value)})"
            )
        return float(value)
    if field == "max_priority":
        if value not in PRIORITY_CLASSES:
            raise InvalidField(
                f"max_priority must be one of {', '.join(PRIORITY_CLASSES)} (got {_shown(value)})"
            )
        return value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUOTA:
        raise InvalidField(
            f"{field} must be a whole number from 1 to {MAX_QUOTA}, or null (got {_shown(value)})"
        )
    return value


def _valid_flag(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidField(f"{field} must be true or false (got {_shown(value)})")
    return value


def _valid_tokens(value: object) -> builtins.list[int]:
    if (
        not isinstance(value, list)
        or not 1 <= len(value) <= MAX_PUBLIC_PREFIX_TOKENS
        or not all(
            isinstance(token, int) and not isinstance(token, bool) and 0 <= token <= MAX_TOKEN_ID
            for token in value
        )
    ):
        raise InvalidField(
            f"tokens must be a list of 1 to {MAX_PUBLIC_PREFIX_TOKENS} token ids "
            f"(whole numbers from 0 to {MAX_TOKEN_ID})"
        )
    return list(value)
