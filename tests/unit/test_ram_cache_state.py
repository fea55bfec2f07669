"""What the proxy takes the upstream's RAM cache to be, from the setting and the probe."""

from __future__ import annotations

import pytest

from cacheproxy.upstreams.client import ram_cache_state
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import UpstreamSlots

UPSTREAM = Upstream("http://127.0.0.1:1")


@pytest.mark.parametrize(
    ("setting", "seen", "state"),
    [
        ("auto", None, "unknown"),  # the probe could not run: never "off"
        ("auto", True, "on"),
        ("auto", False, "off"),
        ("on", None, "on"),
        ("on", False, "on"),
        ("off", None, "off"),  # declared where the probe cannot tell
        ("off", True, "on"),  # a cache seen answering is never declared away
        ("off", False, "off"),
    ],
)
def test_state_from_setting_and_probe(setting: str, seen: bool | None, state: str) -> None:
    assert ram_cache_state(setting, seen, UPSTREAM) == state


@pytest.mark.parametrize(("state", "shared"), [("on", True), ("unknown", True), ("off", False)])
def test_unknown_is_treated_as_a_shared_cache(state: str, shared: bool) -> None:
    table = UpstreamSlots(0, UPSTREAM, [])
    table.set_ram_cache(state)
    assert table.ram_cache is shared and table.ram_cache_state == state
