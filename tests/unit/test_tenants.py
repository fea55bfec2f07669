"""The tenant registry on real SQLite files, or a real PostgreSQL database (`--database
postgresql`, for the tests using `where`): keys, changes, refusals, migrations, other writers."""

from __future__ import annotations

import re
import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlite_utils import Database, Migrations

from cacheproxy.db.connection import DATABASE_ERRORS, DatabaseTarget, connect, is_database_url
from cacheproxy.db.migrations import VERSION_TABLE
from cacheproxy.tenancy.registry import (
    DEFAULT_TENANT,
    DuplicateName,
    TenantRegistry,
    UnknownPublicPrefix,
    UnknownTenant,
)
from cacheproxy.tenancy.registry_records import InvalidField, hash_api_key
from cacheproxy.tenancy.registry_schema import MIGRATIONS, RegistryUnusable, tenants_marker
from tests.support import databases


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "cacheproxy.db"


@pytest.fixture
def where(database_url: str | None, db_path: Path) -> DatabaseTarget:
    """The registry's database: the test's PostgreSQL database, or the SQLite file."""
    return databases.target(database_url, db_path)


@pytest.fixture
def registry(where: DatabaseTarget) -> Iterator[TenantRegistry]:
    with TenantRegistry(where) as opened:
        yield opened


def rows(path: DatabaseTarget, sql: str) -> list[tuple]:
    """Read the database through a connection of its own, as another process would."""
    return databases.query(path, sql)


def live_key_counts(path: DatabaseTarget) -> dict[str, int]:
    return dict(
        rows(
            path,
            "SELECT t.id, count(k.id) FROM tenants t "
            "LEFT JOIN api_keys k ON k.tenant_id = t.id AND k.revoked_at IS NULL GROUP BY t.id",
        )
    )


def test_a_new_registry_has_no_tenants_and_serves_the_default(registry: TenantRegistry) -> None:
    assert not registry.has_tenants()
    assert registry.list() == []
    assert DEFAULT_TENANT.id == "default" and not DEFAULT_TENANT.disabled
    assert registry.authenticate("cpk_anything") is None


def test_create_then_authenticate(registry: TenantRegistry, where: DatabaseTarget) -> None:
    tenant, api_key = registry.create("acme", quota_bytes=1 << 30, quota_archives=50)
    assert re.fullmatch(r"t_[0-9a-f]{16}", tenant.id)
    assert re.fullmatch(r"cpk_[A-Za-z0-9_-]{43}", api_key)
    assert (tenant.name, tenant.quota_bytes, tenant.quota_archives) == ("acme", 1 << 30, 50)
    assert not tenant.disabled and not tenant.hide_cache_signals and tenant.may_use_public_prefixes
    assert registry.has_tenants()
    assert registry.authenticate(api_key) == tenant
    assert registry.get(tenant.id) == tenant
    assert registry.key_prefix(tenant.id) == api_key[:12]

    # stored hashed: the key itself is nowhere in the file, its sha256 is
    if not is_database_url(where):
        assert api_key.encode() not in Path(where).read_bytes()
    assert rows(where, "SELECT key_hash FROM api_keys") == [(hash_api_key(api_key),)]
    if not is_database_url(where):
        assert stat.S_IMODE(Path(where).stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "presented",
    ["", "cpk_", "cpk_" + "A" * 43, "not-a-key", "cpk_" + "x" * 10_000, "cpk_\udcff\x00"],
)
def test_unknown_keys_are_refused(registry: TenantRegistry, presented: str) -> None:
    registry.create("acme")
    assert registry.authenticate(presented) is None


def test_rotate_revokes_the_old_key_at_once(
    registry: TenantRegistry, where: DatabaseTarget
) -> None:
    tenant, first = registry.create("acme")
    second = registry.rotate_key(tenant.id)
    assert second != first
    assert registry.authenticate(first) is None
    assert registry.authenticate(second) == tenant
    keys = registry.api_keys(tenant.id)
    assert [key["revoked_at"] is None for key in keys] == [False, True]
    assert live_key_counts(where) == {tenant.id: 1}


def test_disable_and_enable(registry: TenantRegistry) -> None:
    tenant, api_key = registry.create("acme")
    other, other_key = registry.create("globex")
    assert registry.set_disabled(tenant.id, True).disabled
    assert registry.authenticate(api_key) is None
    assert registry.authenticate(other_key) == other
    registry.set_disabled(other.id, True)
    assert registry.has_tenants()  # everyone disabled locks everyone out, never opens the proxy
    assert registry.set_disabled(tenant.id, False) == tenant
    assert registry.authenticate(api_key) == tenant


def test_update_fields(registry: TenantRegistry) -> None:
    tenant, _ = registry.create("acme", quota_bytes=10)
    changed = registry.update(
        tenant.id,
        name="acme-2",
        hide_cache_signals=True,
        may_use_public_prefixes=False,
        quota_bytes=None,
        quota_archives=0,
    )
    assert changed == registry.get(tenant.id)
    assert (changed.name, changed.hide_cache_signals, changed.may_use_public_prefixes) == (
        "acme-2",
        True,
        False,
    )
    assert (changed.quota_bytes, changed.quota_archives) == (None, 0)
    assert registry.update(tenant.id, name="ACME-2").name == "ACME-2"  # its own name, recased


def test_duplicate_names_are_refused(registry: TenantRegistry) -> None:
    registry.create("acme")
    other, _ = registry.create("globex")
    with pytest.raises(DuplicateName):
        registry.create("acme")
    with pytest.raises(DuplicateName):
        registry.create("ACME")  # names ignore case: two tenants must not look alike
    with pytest.raises(DuplicateName):
        registry.update(other.id, name="Acme")
    assert [t.name for t in registry.list()] == ["acme", "globex"]


@pytest.mark.parametrize("quota", [-1, True, 1.5, "5", 1 << 63, [1]])
def test_bad_quotas_are_refused(registry: TenantRegistry, quota: object) -> None:
    with pytest.raises(InvalidField, match="quota_bytes"):
        registry.create("acme", quota_bytes=quota)  # type: ignore[arg-type]
    tenant, _ = registry.create("globex")
    with pytest.raises(InvalidField, match="quota_archives"):
        registry.update(tenant.id, quota_archives=quota)
    assert [t.name for t in registry.list()] == ["globex"]
    assert registry.get(tenant.id).quota_archives is None


@pytest.mark.parametrize("name", ["", "a" * 65, "two words", "naïve", "a/b", None, 5])
def test_bad_names_are_refused(registry: TenantRegistry, name: object) -> None:
    with pytest.raises(InvalidField, match="name"):
        registry.create(name)  # type: ignore[arg-type]
    assert not registry.has_tenants()


def test_bad_flags_and_unknown_fields_are_refused(registry: TenantRegistry) -> None:
    tenant, _ = registry.create("acme")
    for bad in ({"disabled": 1}, {"hide_cache_signals": None}, {"may_use_public_prefixes": "no"}):
        with pytest.raises(InvalidField):
            registry.update(tenant.id, **bad)
    with pytest.raises(InvalidField, match="id"):
        registry.update(tenant.id, id="t_0000000000000000")
    assert registry.get(tenant.id) == tenant


def test_unknown_tenant(registry: TenantRegistry) -> None:
    for call in (
        lambda: registry.get("t_0000000000000000"),
        lambda: registry.set_disabled("nope", True),
        lambda: registry.rotate_key("nope"),
        lambda: registry.update("nope", quota_bytes=1),
        lambda: registry.api_keys("nope"),
    ):
        with pytest.raises(UnknownTenant):
            call()
    with pytest.raises(UnknownTenant):
        registry.get("default")  # the default tenant is not stored


def test_public_prefixes(registry: TenantRegistry) -> None:
    system = registry.add_public_prefix("system-prompt", [1, 2, 3])
    tools = registry.add_public_prefix("tools", list(range(1000)))
    assert re.fullmatch(r"pp_[0-9a-f]{16}", system.id)
    assert registry.public_prefixes() == [system, tools]
    assert registry.public_prefix(tools.id).tokens == list(range(1000))
    with pytest.raises(DuplicateName):
        registry.add_public_prefix("System-Prompt", [4])
    for tokens in ([], [-1], [1.5], [True], "123", [1 << 31]):
        with pytest.raises(InvalidField, match="tokens"):
            registry.add_public_prefix("bad", tokens)  # type: ignore[arg-type]
    registry.remove_public_prefix(system.id)
    assert registry.public_prefixes() == [tools]
    with pytest.raises(UnknownPublicPrefix):
        registry.remove_public_prefix(system.id)


def test_another_connection_s_changes_are_seen(where: DatabaseTarget) -> None:
    """Two registries on one database, as the proxy and the CLI: the change counter carries the
    news (checked on every call here; the proxy looks at most every quarter second)."""
    with (
        TenantRegistry(where, refresh_interval_s=0) as proxy_side,
        TenantRegistry(where, refresh_interval_s=0) as cli_side,
    ):
        assert not proxy_side.has_tenants()
        tenant, first = cli_side.create("acme")
        assert proxy_side.has_tenants()
        assert proxy_side.authenticate(first) == tenant

        second = cli_side.rotate_key(tenant.id)
        assert proxy_side.authenticate(first) is None
        assert proxy_side.authenticate(second) == tenant

        proxy_side.set_disabled(tenant.id, True)
        assert cli_side.get(tenant.id).disabled
        assert cli_side.authenticate(second) is None

        prefix = cli_side.add_public_prefix("shared", [7, 8, 9])
        assert proxy_side.public_prefixes() == [prefix]


def test_another_connection_s_changes_are_seen_within_the_refresh_interval(
    where: DatabaseTarget,
) -> None:
    with (
        TenantRegistry(where, refresh_interval_s=60) as proxy_side,
        TenantRegistry(where) as cli,
    ):
        assert not proxy_side.has_tenants()
        cli.create("acme")
        assert not proxy_side.has_tenants()  # not looked again yet: no query per request
        proxy_side.refresh_interval_s = 0  # the interval over (not waited out: a loaded
        assert proxy_side.has_tenants()  # machine could take it to commit the change)


async def test_on_an_event_loop_reads_answer_from_memory_and_the_twins_write(
    where: DatabaseTarget,
) -> None:
    """Opened for a loop, the registry reads only its snapshot: another connection's change is
    seen after `arefresh`, and its own changes (the async twins) at once."""
    registry = await TenantRegistry.aopen(where, refresh_interval_s=0)
    try:
        with TenantRegistry(where) as other:
            other.create("elsewhere")
        assert registry.list() == [] and registry.snapshot_is_stale()
        await registry.arefresh()
        assert [tenant.name for tenant in registry.list()] == ["elsewhere"]
        tenant, api_key = await registry.acreate("here", quota_bytes=5)
        assert registry.authenticate(api_key) == tenant
        assert (await registry.aupdate(tenant.id, quota_bytes=None)).quota_bytes is None
        rotated = await registry.arotate_key(tenant.id)
        assert registry.authenticate(api_key) is None and registry.authenticate(rotated) == (
            registry.get(tenant.id)
        )
        assert [key["revoked_at"] is None for key in await registry.aapi_keys(tenant.id)] == [
            False,
            True,
        ]
        assert (await registry.aset_limits(tenant.id, tokens_per_day=9)).tokens_per_day == 9
        prefix = await registry.aadd_public_prefix("shared", [1, 2, 3])
        await registry.aremove_public_prefix(prefix.id)
        assert registry.public_prefixes() == []
        with pytest.raises(UnknownTenant):
            await registry.aupdate("t_missing", disabled=True)
    finally:
        await registry.aclose()


def test_migrations_from_an_empty_file_and_an_idempotent_reopen(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.touch()  # an empty file is an empty SQLite database
    with TenantRegistry(db_path) as registry:
        tenant, api_key = registry.create("acme")
    applied = rows(db_path, "SELECT migration_set, name FROM _sqlite_migrations")
    assert applied == [("cacheproxy.tenants", m.name) for m in MIGRATIONS.steps]
    assert rows(db_path, "PRAGMA journal_mode") == [("wal",)]
    assert {name for (name,) in rows(db_path, "SELECT name FROM sqlite_master")} >= {
        "tenants",
        "api_keys",
        "public_prefixes",
    }

    for _ in range(2):
        with TenantRegistry(db_path) as reopened:
            assert reopened.authenticate(api_key) == tenant
            assert reopened._db.execute("PRAGMA foreign_keys").fetchone() == (1,)
    assert rows(db_path, "SELECT count(*) FROM _sqlite_migrations") == [(len(applied),)]


def test_many_openers_of_a_new_file_migrate_it_once(where: DatabaseTarget) -> None:
    failures: list[BaseException] = []

    def open_and_create(index: int) -> None:
        try:
            with TenantRegistry(where) as registry:
                registry.create(f"tenant-{index}")
        except BaseException as exc:  # reported below, with the thread's own error
            failures.append(exc)

    threads = [threading.Thread(target=open_and_create, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    version_table = VERSION_TABLE[connect_dialect(where)]
    assert rows(where, f"SELECT count(*) FROM {version_table}") == [(len(MIGRATIONS.steps),)]
    assert rows(where, "SELECT count(*) FROM tenants") == [(6,)]


def connect_dialect(where: DatabaseTarget):  # noqa: ANN201 - the Dialect of `where`
    db = connect(where, busy_timeout_s=5.0, lock_name="test", wal=False)
    db.close()
    return db.dialect


def test_a_change_that_fails_half_way_leaves_nothing_behind(
    registry: TenantRegistry, where: DatabaseTarget
) -> None:
    tenant, api_key = registry.create("acme")
    # A real fault inside the transaction: the database refuses every new key, after the tenant
    # row (create) or the revocation of the old key (rotate) has already been written.
    writer = connect(where, busy_timeout_s=5.0, lock_name="test", wal=False)
    if writer.is_postgresql:
        writer.execute(
            "CREATE FUNCTION refuse_keys() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RAISE EXCEPTION 'disk says no'; END $$"
        )
        writer.execute(
            "CREATE TRIGGER refuse_keys BEFORE INSERT ON api_keys"
            " FOR EACH ROW EXECUTE FUNCTION refuse_keys()"
        )
    else:
        writer.execute(
            "CREATE TRIGGER refuse_keys BEFORE INSERT ON api_keys "
            "BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
        )

    with pytest.raises(DATABASE_ERRORS, match="disk says no"):
        registry.create("globex")
    with pytest.raises(DATABASE_ERRORS, match="disk says no"):
        registry.rotate_key(tenant.id)

    assert [t.name for t in registry.list()] == ["acme"]
    assert rows(where, "SELECT name FROM tenants") == [("acme",)]
    assert registry.authenticate(api_key) == tenant  # the old key was not revoked after all
    assert live_key_counts(where) == {tenant.id: 1}

    writer.execute("DROP TRIGGER refuse_keys" + (" ON api_keys" if writer.is_postgresql else ""))
    writer.close()
    new_key = registry.rotate_key(tenant.id)
    assert registry.authenticate(new_key) == tenant
    assert registry.create("globex")[0].name == "globex"


def test_the_database_itself_holds_the_invariants(
    registry: TenantRegistry, where: DatabaseTarget
) -> None:
    """Whatever writes the database, it cannot hold a second live key, a dangling key, a bad
    quota or a name differing from another in case only."""
    tenant, _ = registry.create("acme")
    writer = connect(where, busy_timeout_s=5.0, lock_name="test", wal=False)
    if not writer.is_postgresql:
        writer.execute("PRAGMA foreign_keys = ON")
    refused = (sqlite3.IntegrityError, psycopg.errors.IntegrityError, psycopg.errors.DataError)
    for statement in (
        "INSERT INTO api_keys (tenant_id, key_hash, display_prefix, created_at) "
        f"VALUES ('{tenant.id}', 'h2', 'p', 'now')",
        "INSERT INTO api_keys (tenant_id, key_hash, display_prefix, created_at) "
        "VALUES ('t_missing', 'h3', 'p', 'now')",
        f"UPDATE tenants SET quota_bytes = -1 WHERE id = '{tenant.id}'",
        f"UPDATE tenants SET disabled = 'yes' WHERE id = '{tenant.id}'",
        "INSERT INTO tenants (id, name, created_at) VALUES ('t_2', 'ACME', 'now')",
    ):
        with pytest.raises(refused):
            writer.execute(statement)
    writer.close()


# -- a registry that held tenants never comes back open ------------------------------------------


def _lose(path: Path, how: str) -> None:
    for suffix in ("-wal", "-shm"):  # what a stopped proxy may leave beside it
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    if how == "truncated":
        path.write_bytes(b"")
    elif how == "deleted":
        path.unlink()
    elif how == "garbage":
        path.write_bytes(b"this is not a database, " * 200)
    else:  # a new, valid database without the tenants
        path.unlink()
        sqlite3.connect(path).close()
        with pytest.raises(RegistryUnusable):  # refused before it is even migrated
            TenantRegistry(path)
        path.unlink()
        connection = sqlite3.connect(path)
        connection.execute("CREATE TABLE unrelated (x)")
        connection.commit()
        connection.close()


@pytest.mark.parametrize("how", ["truncated", "deleted", "garbage", "replaced"])
def test_a_lost_registry_that_held_tenants_refuses_to_open(db_path: Path, how: str) -> None:
    with TenantRegistry(db_path) as registry:
        registry.create("acme")
    _lose(db_path, how)
    with pytest.raises(RegistryUnusable) as refused:
        TenantRegistry(db_path)
    message = str(refused.value)
    assert "\n" not in message and str(db_path) in message
    assert "backup" in message
    if how != "garbage":
        # the marker is what remembers, and removing it is the operator's explicit choice
        assert str(tenants_marker(db_path)) in message
        tenants_marker(db_path).unlink()
        if how == "replaced":
            db_path.unlink()
        with TenantRegistry(db_path) as registry:
            assert not registry.has_tenants()


def test_a_registry_from_before_the_marker_gets_one(db_path: Path) -> None:
    with TenantRegistry(db_path) as registry:
        registry.create("acme")
    tenants_marker(db_path).unlink()
    with TenantRegistry(db_path) as registry:
        assert registry.has_tenants()
    assert tenants_marker(db_path).exists()


def test_an_unreadable_registry_without_tenants_is_refused_with_one_line(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"garbage" * 1000)
    with pytest.raises(RegistryUnusable) as refused:
        TenantRegistry(db_path)
    assert "\n" not in str(refused.value) and str(db_path) in str(refused.value)


def test_tenants_emptied_under_a_running_registry_still_need_keys(db_path: Path) -> None:
    with TenantRegistry(db_path, refresh_interval_s=0) as registry:
        _, api_key = registry.create("acme")
        other = sqlite3.connect(db_path)
        other.execute("DELETE FROM api_keys")
        other.execute("DELETE FROM tenants")
        other.commit()
        other.close()
        assert registry.list() == []
        assert registry.has_tenants()  # fails closed: no request goes through without a key
        assert registry.authenticate(api_key) is None


def test_share_fields_default_validate_and_persist(
    registry: TenantRegistry, where: DatabaseTarget
) -> None:
    tenant, _ = registry.create("acme")
    assert (tenant.weight, tenant.max_queued, tenant.max_concurrent) == (1.0, None, None)
    assert tenant.max_priority == "interactive"
    registry.update(tenant.id, weight=4, max_queued=3, max_concurrent=2, max_priority="batch")
    for field, bad in (
        ("weight", 0),
        ("weight", 1001),
        ("weight", True),
        ("max_queued", 0),
        ("max_concurrent", 1.5),
        ("max_priority", "urgent"),
    ):
        with pytest.raises(InvalidField):
            registry.update(tenant.id, **{field: bad})
    with TenantRegistry(where) as reopened:
        kept = reopened.get(tenant.id)
    assert (kept.weight, kept.max_queued, kept.max_concurrent, kept.max_priority) == (
        4.0,
        3,
        2,
        "batch",
    )


def test_a_registry_from_before_fair_share_is_migrated_with_the_defaults(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    # a file as sqlite-utils' Migrations left it, with the first migration's released text
    database = Database(sqlite3.connect(db_path))
    old = Migrations("cacheproxy.tenants")

    @old(name=MIGRATIONS.steps[0].name)
    def m001(db: Database) -> None:
        db.executescript(str(MIGRATIONS.steps[0].sqlite))

    old.apply(database)
    database.execute(
        "INSERT INTO tenants (id, name, created_at) VALUES ('t_0000000000000001', 'old', 'then')"
    )
    database.conn.commit()
    database.close()
    with TenantRegistry(db_path) as registry:
        tenant = registry.get("t_0000000000000001")
    assert (tenant.weight, tenant.max_queued, tenant.max_priority) == (1.0, None, "interactive")


def test_a_tenant_may_be_limited_to_some_models(registry: TenantRegistry) -> None:
    tenant, _ = registry.create("acme", models=["llama-8b", "org/qwen:Q4_K_M", "llama-8b"])
    assert tenant.models == ("llama-8b", "org/qwen:Q4_K_M")  # each once, in order
    assert registry.create("globex")[0].models is None  # any model
    assert registry.update(tenant.id, models=["x"]).models == ("x",)
    assert registry.update(tenant.id, models=[]).models == ()  # none at all
    assert registry.update(tenant.id, models=None).models is None
    for bad in ("llama-8b", [""], [" padded"], ["a\nb"], [1], ["m" * 257], ["m"] * 257):
        with pytest.raises(InvalidField, match="models"):
            registry.update(tenant.id, models=bad)
    assert registry.get(tenant.id).models is None
