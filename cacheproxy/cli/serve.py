"""`cacheproxy serve`: the proxy run until a signal stops it, and every refusal to start as one
line on stderr and an exit code."""

from __future__ import annotations

import gc
import logging
import sys
from typing import TYPE_CHECKING, Any

from cacheproxy.cli.common import EXIT_BAD_SETTINGS
from cacheproxy.ops.logs import configure_logging
from cacheproxy.settings import Settings, is_socket_path

if TYPE_CHECKING:
    from cacheproxy.ops.event_loop import LoopFactory

log = logging.getLogger("cacheproxy")

EXIT_CANNOT_START = 3  # a state file or folder is unusable: the message says which and the fix


def one_line(message: str) -> str:
    """A message of several lines as one: a refusal to start is one line on stderr."""
    joined = ""
    for line in (line.strip() for line in message.splitlines()):
        if line:
            joined += line if not joined else (" " if joined.endswith(":") else "; ") + line
    return joined


def serve(settings: Settings) -> int:
    """Run the proxy until a signal stops it. Whatever keeps it from starting (a plugin, a
    state file, an upstream it cannot serve, its own server or socket) is one line on stderr
    and an exit code, never a traceback."""
    from cacheproxy.cli.local_server import chosen_backend, local_server
    from cacheproxy.http.app import create_app
    from cacheproxy.http.start_checks import STARTUP_ERRORS, check_state
    from cacheproxy.ops.event_loop import EventLoopUnavailable, loop_factory
    from cacheproxy.ops.shutdown import check_can_listen
    from cacheproxy.plugins import PluginError

    configure_logging(settings.log_level, settings.log_format)
    try:
        loop_name, new_loop = loop_factory(settings.event_loop)
    except EventLoopUnavailable as exc:
        print(f"cacheproxy: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    try:
        # plugins, state files and the port are checked before anything starts
        check_state(settings)
        check_can_listen(settings.listen_hosts(), settings.port)
        managed = None if settings.upstreams else local_server(settings)
        app = create_app(settings, managed)
        return _serve_app(settings, app, managed, chosen_backend(settings), (loop_name, new_loop))
    except PluginError as exc:
        print(f"cacheproxy: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    except STARTUP_ERRORS as exc:
        print(f"cacheproxy: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_CANNOT_START


def _serve_app(
    settings: Settings, app: Any, managed: Any, backend: str, loop: tuple[str, LoopFactory]
) -> int:
    from cacheproxy.http.app_keys import SHUTDOWN
    from cacheproxy.http.clients import runner_options
    from cacheproxy.http.head_limits import ProxyRunner
    from cacheproxy.ops.shutdown import run_until_signalled

    upstreams = ", ".join(settings.upstream_urls()) or (
        f"{backend} ({managed.base_url if managed else ''})"
    )

    addresses = ", ".join(
        f"unix://{host}" if is_socket_path(host) else f"http://{host}:{settings.port}"
        for host in settings.listen_hosts()
    )

    def listening() -> None:
        # what the start made (modules, settings, the app and its state) lives as long as the
        # process: kept out of the garbage collector's passes, a full one no longer walks it
        # while every request waits (docs/drop-in.md, "The heap made at start")
        gc.freeze()
        log.info(
            "cacheproxy listening on %s, in front of %s (event loop: %s)",
            addresses,
            upstreams,
            loop[0],
        )
        log.debug("%d objects made at start kept out of garbage collection", gc.get_freeze_count())

    # SIGTERM/SIGINT: a stop bounded by settings.shutdown_timeout_s, whatever is stuck; what
    # refuses the start on the way (an upstream, a state file gone bad since the check, the
    # socket) goes up to `serve`
    run_until_signalled(
        app,
        settings.listen_hosts(),
        settings.port,
        app[SHUTDOWN],
        listening,
        runner_class=ProxyRunner,
        new_loop=loop[1],
        handler_cancellation=True,
        access_log=None,
        **runner_options(settings.clients),
    )
    return 0
