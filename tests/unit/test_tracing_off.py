"""Tracing is off by default and then free: no OpenTelemetry module is imported, no middleware
is added, every span is the same do-nothing context manager."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cacheproxy.http.app import create_app
from cacheproxy.http.app_keys import TRACER
from cacheproxy.ops.tracing import NO_TRACING
from cacheproxy.settings import load_settings

BUILD_APP = """
import sys
from cacheproxy.http.app import create_app
from cacheproxy.settings import load_settings
create_app(load_settings(upstreams=["http://127.0.0.1:9"], state_dir=sys.argv[1]))
print(sorted(name for name in sys.modules if name.startswith("opentelemetry")))
"""


def test_no_opentelemetry_module_is_imported_when_off(tmp_path: Path) -> None:
    found = subprocess.run(
        [sys.executable, "-c", BUILD_APP, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "[]"


def test_the_app_holds_the_no_op_tracer_and_no_tracing_middleware(tmp_path: Path) -> None:
    app = create_app(load_settings(upstreams=["http://127.0.0.1:9"], state_dir=tmp_path))
    assert app[TRACER] is NO_TRACING
    assert not any(getattr(m, "__name__", "") == "trace_request" for m in app.middlewares)
    with NO_TRACING.span("queue", slot=1) as first, NO_TRACING.span("upstream") as second:
        first.set(slot=2)
    assert first is second  # one shared object: nothing is allocated per span
