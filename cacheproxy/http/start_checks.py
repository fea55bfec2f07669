"""What `serve` checks before it listens: the plugins the settings name, the state folder, the
tenant registry, the ledger and the archive index; and the errors that stop it at start, each
with a one-line message naming the fix."""

from __future__ import annotations

import os
from pathlib import Path

from cacheproxy.disk.archive_types import ArchiveIndexUnusable
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.ops.shutdown import CannotListen
from cacheproxy.plugins import check_plugin, load_plugin
from cacheproxy.settings import Settings
from cacheproxy.tenancy.ledger import LedgerStore, LedgerUnusable
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.tenancy.registry_schema import RegistryUnusable
from cacheproxy.upstreams.client import UnsuitableUpstream
from cacheproxy.upstreams.managed import LocalServerFailed
from cacheproxy.upstreams.tls import UnusableCaFile, upstream_ssl_context


class StartupError(Exception):
    """The proxy cannot start; the message is one line naming the file and the fix."""


# what stops `serve` at start (a state file or folder, an upstream it cannot serve, its own
# server or socket), each with a one-line message for the operator; a plugin that cannot be
# found or configured is a settings error (`PluginError`)
STARTUP_ERRORS = (
    StartupError,
    RegistryUnusable,
    ArchiveIndexUnusable,
    LedgerUnusable,
    UnsuitableUpstream,
    LocalServerFailed,
    CannotListen,
)


def check_plugins(settings: Settings) -> None:
    """Every plugin the settings name (routing, archive eviction, the embedded engine's prompt
    cache) is installed and takes its options; raises `PluginError` naming the known ones."""
    check_plugin("routing", settings.routing.policy, settings.routing.options)
    check_plugin("eviction", settings.disk.eviction, settings.disk.eviction_options)
    embedded = settings.embedded
    check_plugin("prompt_cache", embedded.prompt_cache, embedded.prompt_cache_options)


def check_state(settings: Settings) -> None:
    """Open what start-up opens (the upstreams' CA file, state folder, tenant registry, archive
    index) and close it again, so that a problem with any of them stops `serve` with one line
    before it listens; check the plugins first (`check_plugins`).

    An archive folder that cannot be written is not an error: the proxy starts with the disk
    tier off, says so, and turns it on once the folder works.
    """
    check_plugins(settings)
    if settings.upstream_ca_file is not None:
        try:
            upstream_ssl_context(settings.upstream_ca_file)
        except UnusableCaFile as exc:
            raise StartupError(str(exc)) from exc
    state_dir = settings.state_dir
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        _probe_writable(state_dir)
    except OSError as exc:
        raise StartupError(
            f"state_dir {state_dir} is not usable ({exc.strerror or exc}): make it a folder this"
            " user can write, or point state_dir (CACHEPROXY_STATE_DIR) elsewhere"
        ) from exc
    with TenantRegistry(settings.tenant_database()):
        pass
    with LedgerStore(settings.usage_database()):
        pass
    if settings.disk.enabled:
        eviction = load_plugin("eviction", settings.disk.eviction, settings.disk.eviction_options)
        with ArchiveIndex.from_settings(settings, eviction) as index:
            index.verify()


def _probe_writable(folder: Path) -> None:
    probe = folder / f".write-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
