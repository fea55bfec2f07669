"""When a request body counts as too slow."""

from __future__ import annotations

from cacheproxy.http.clients import body_deadline, runner_options
from cacheproxy.settings import ClientSettings, load_settings

SETTINGS = ClientSettings(body_timeout_s=30.0, body_min_bytes_per_s=1000)


def test_a_pause_longer_than_the_timeout_is_too_slow() -> None:
    # 1 MB received at once buys 1000 s of rate, but a 30 s pause still ends it
    assert body_deadline(SETTINGS, started=0.0, last_byte=5.0, received=1_000_000) == 35.0


def test_below_the_minimum_rate_after_the_grace_time_is_too_slow() -> None:
    # a few bytes a second: the grace time plus what the bytes bought
    assert body_deadline(SETTINGS, started=0.0, last_byte=59.0, received=300) == 30.3
    # at the minimum rate the deadline keeps moving ahead of the clock
    assert body_deadline(SETTINGS, started=0.0, last_byte=100.0, received=100_000) == 130.0


def test_rate_zero_leaves_only_the_pause() -> None:
    # (the whole body's bound set past this body's life, so the pause alone is seen)
    settings = ClientSettings(body_timeout_s=30.0, body_min_bytes_per_s=0, body_max_s=3600.0)
    assert body_deadline(settings, started=0.0, last_byte=500.0, received=10) == 530.0


def test_a_body_keeping_pace_still_ends_at_the_absolute_deadline() -> None:
    # 60 MB at once buy some 17 hours of rate, and every pause is short: body_max_s ends it
    settings = ClientSettings(body_timeout_s=30.0, body_min_bytes_per_s=1000, body_max_s=300.0)
    assert body_deadline(settings, started=0.0, last_byte=299.0, received=60_000_000) == 300.0
    # before it, the pause and the rate still cut sooner
    assert body_deadline(settings, started=0.0, last_byte=5.0, received=60_000_000) == 35.0
    assert body_deadline(settings, started=0.0, last_byte=59.0, received=300) == 30.3


def test_defaults_are_a_reverse_proxy_s() -> None:
    clients = load_settings().clients
    assert (clients.keepalive_timeout_s, clients.body_timeout_s) == (75.0, 30.0)
    assert clients.body_max_s == 300.0
    assert runner_options(clients) == {"keepalive_timeout": 75.0}
