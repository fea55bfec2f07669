"""Rate limits and budgets as pure decisions (tenancy/limits.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from cacheproxy.tenancy.limits import (
    Limits,
    Refusal,
    TokenBucket,
    admit,
    charge,
    duration_text,
    rate_headers,
    refusal_headers,
    seconds_to_next_day,
    seconds_to_next_month,
    take_prompt,
)

NOW = datetime(2026, 11, 30, 23, 0, tzinfo=UTC).timestamp()


def test_a_new_bucket_starts_full_and_refills_a_minute_worth_a_minute() -> None:
    buckets: dict[str, TokenBucket] = {}
    limits = Limits(requests_per_minute=3)
    for _ in range(3):
        assert admit(buckets, limits, NOW, 0, 0) is None
    refusal = admit(buckets, limits, NOW, 0, 0)
    assert refusal is not None and refusal.limit == "requests_per_minute"
    assert refusal.retry_after_s == 20.0  # one request comes back every 20 s
    assert refusal.retry_after_header == "20"
    assert admit(buckets, limits, NOW + 20, 0, 0) is None
    # never more than the capacity, however long it waited
    admit(buckets, limits, NOW + 3600, 0, 0)
    assert buckets["requests_per_minute"].level == 2


def test_a_refusal_takes_nothing() -> None:
    buckets: dict[str, TokenBucket] = {}
    limits = Limits(requests_per_minute=10, generated_tokens_per_minute=10)
    assert admit(buckets, limits, NOW, 0, 0) is None
    charge(buckets, limits, "generated_tokens_per_minute", 15, NOW)
    refusal = admit(buckets, limits, NOW, 0, 0)
    assert refusal is not None and refusal.limit == "generated_tokens_per_minute"
    assert buckets["requests_per_minute"].level == 9
    # 5 below zero, 10 a minute: 36 s until it holds one token again
    assert refusal.retry_after_s == 36.0


def test_prompt_tokens_taken_before_forwarding() -> None:
    buckets: dict[str, TokenBucket] = {}
    limits = Limits(prompt_tokens_per_minute=100)
    assert take_prompt(buckets, limits, 60, NOW) is None
    refusal = take_prompt(buckets, limits, 60, NOW)
    assert refusal is not None and refusal.limit == "prompt_tokens_per_minute"
    assert refusal.retry_after_s == 12.0  # 20 more tokens at 100 a minute
    assert buckets["prompt_tokens_per_minute"].level == 40
    # a prompt larger than the whole minute's worth needs a full bucket, then goes below zero
    assert take_prompt(buckets, limits, 500, NOW) is not None
    assert take_prompt(buckets, limits, 500, NOW + 36) is None
    assert buckets["prompt_tokens_per_minute"].level == -400
    assert admit(buckets, limits, NOW + 36, 0, 0).limit == "prompt_tokens_per_minute"


def test_budgets_are_checked_first_and_reset_at_the_utc_day_and_month() -> None:
    limits = Limits(requests_per_minute=5, tokens_per_day=100, tokens_per_month=1000)
    buckets: dict[str, TokenBucket] = {}
    assert admit(buckets, limits, NOW, 99, 99) is None
    refusal = admit(buckets, limits, NOW, 100, 100)
    assert refusal is not None and refusal.limit == "budget_tokens_per_day"
    assert refusal.retry_after_s == 3600  # 23:00 to midnight
    refusal = admit(buckets, limits, NOW, 0, 1000)
    assert refusal is not None and refusal.limit == "budget_tokens_per_month"
    assert refusal.retry_after_s == 3600  # the 30th of November: December is an hour away
    assert seconds_to_next_month(datetime(2026, 12, 31, tzinfo=UTC).timestamp()) == 86400
    assert seconds_to_next_day(datetime(2026, 2, 28, 12, tzinfo=UTC).timestamp()) == 43200


def test_a_lowered_limit_caps_the_level_and_a_raised_one_keeps_it() -> None:
    buckets: dict[str, TokenBucket] = {}
    assert admit(buckets, Limits(requests_per_minute=60), NOW, 0, 0) is None
    assert admit(buckets, Limits(requests_per_minute=10), NOW, 0, 0) is None
    assert buckets["requests_per_minute"].level == 9
    assert admit(buckets, Limits(requests_per_minute=100), NOW, 0, 0) is None
    assert buckets["requests_per_minute"].level == 8


def test_headers_as_openai_sends_them() -> None:
    buckets: dict[str, TokenBucket] = {}
    limits = Limits(
        requests_per_minute=60, prompt_tokens_per_minute=1000, generated_tokens_per_minute=100
    )
    admit(buckets, limits, NOW, 0, 0)
    charge(buckets, limits, "generated_tokens_per_minute", 50, NOW)
    take_prompt(buckets, limits, 100, NOW)
    headers = rate_headers(buckets, limits, NOW)
    assert headers["x-ratelimit-limit-requests"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "59"
    assert headers["x-ratelimit-reset-requests"] == "1s"
    # the generated bucket has the smaller share left (50 %, against 90 %)
    assert headers["x-ratelimit-limit-tokens"] == "100"
    assert headers["x-ratelimit-remaining-tokens"] == "50"
    assert headers["x-ratelimit-reset-tokens"] == "30s"
    assert headers["x-ratelimit-remaining-prompt-tokens"] == "900"
    assert headers["x-ratelimit-reset-prompt-tokens"] == "6s"
    assert rate_headers({}, Limits(), NOW) == {}


def test_a_refusal_by_the_request_rate_says_no_request_is_left() -> None:
    # a view of pools shared between proxies may show some left that this proxy could not take
    limits = Limits(requests_per_minute=4, prompt_tokens_per_minute=1000)
    buckets = {
        "requests_per_minute": TokenBucket(4, 3.0, NOW),
        "prompt_tokens_per_minute": TokenBucket(1000, 400.0, NOW),
    }
    settling = Refusal("requests_per_minute", "limits being settled between proxies", 1.0)
    headers = refusal_headers(buckets, limits, settling, NOW)
    assert rate_headers(buckets, limits, NOW)["x-ratelimit-remaining-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-remaining-prompt-tokens"] == "400"  # the others as they stand
    # a token rate's refusal leaves its figures as they stand: a prompt may need more than 400
    prompt = Refusal("prompt_tokens_per_minute", "prompt tokens per minute", 36.0)
    assert refusal_headers(buckets, limits, prompt, NOW) == rate_headers(buckets, limits, NOW)


def test_durations() -> None:
    assert duration_text(0.02) == "20ms"
    assert duration_text(1.5) == "1.5s"
    assert duration_text(360) == "6m0s"
    assert duration_text(3723) == "1h2m3s"


def test_own_limits_over_the_defaults() -> None:
    defaults = Limits(requests_per_minute=10, tokens_per_day=1000)
    assert Limits(tokens_per_day=5).over(defaults) == Limits(
        requests_per_minute=10, tokens_per_day=5
    )
