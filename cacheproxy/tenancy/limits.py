"""Per-tenant rate limits and budgets as pure decisions: token buckets, admission, headers.

No I/O and no clock of its own: every call takes `now` (wall-clock seconds, so that a bucket
persisted before a restart refills by the time that really passed while the proxy was down).

- Rates (requests, prompt tokens, generated tokens per minute) are token buckets holding up to
  one minute's worth, refilled continuously at limit/60 per second; a new bucket starts full.
- A request takes one request token when admitted. Its prompt tokens are known before it is
  forwarded (the mirror tokenizes it) and are taken then: a prompt needs that many tokens in the
  bucket, or a full bucket if it is larger than the whole minute's worth. Generated tokens are
  only known when the answer ends: they are charged then and may take the bucket below zero;
  a tenant whose prompt or generated bucket is not above zero is refused until it refills.
  (OpenAI estimates output from `max_tokens` up front instead; charging what was really
  generated never refuses a request for tokens it would not have used.)
- Budgets (prompt + generated tokens per UTC day and per UTC calendar month) are checked at
  admission against what the ledger counted: a request is admitted while the total is below
  the budget, so the last one admitted may take it past.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta

RATE_NAMES = ("requests_per_minute", "prompt_tokens_per_minute", "generated_tokens_per_minute")
BUDGET_NAMES = ("tokens_per_day", "tokens_per_month")
LIMIT_NAMES = (*RATE_NAMES, *BUDGET_NAMES)


@dataclass(frozen=True)
class Limits:
    """A tenant's limits; None: no limit."""

    requests_per_minute: int | None = None
    prompt_tokens_per_minute: int | None = None
    generated_tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None

    def over(self, defaults: Limits) -> Limits:
        """These limits, each unset one taken from `defaults`."""
        return Limits(
            **{
                field.name: getattr(self, field.name)
                if getattr(self, field.name) is not None
                else getattr(defaults, field.name)
                for field in fields(self)
            }
        )

    def as_dict(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}


NO_LIMITS = Limits()


@dataclass
class TokenBucket:
    """Up to `capacity` tokens, refilled at capacity per minute; `level` may go below zero."""

    capacity: float
    level: float
    updated: float  # wall-clock seconds of `level`

    @property
    def per_second(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        # the rate written out, not `per_second`: several buckets are refilled per request
        if now > self.updated:
            self.level = min(
                self.capacity, self.level + (now - self.updated) * (self.capacity / 60.0)
            )
            self.updated = now

    def resize(self, capacity: float) -> None:
        """A changed limit: the level is kept, but never above the new capacity."""
        self.capacity = capacity
        self.level = min(self.level, capacity)

    def seconds_until(self, level: float) -> float:
        """How long until the bucket holds `level` (0: it does)."""
        if self.level >= level:
            return 0.0
        if self.capacity <= 0:
            return math.inf
        return (level - self.level) / (self.capacity / 60.0)


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the limit (`type`), a message, and when to try again."""

    limit: str  # the error `type`: a name of LIMIT_NAMES, budgets prefixed "budget_"
    message: str
    retry_after_s: float

    @property
    def retry_after_header(self) -> str:
        # whole seconds, at least 1 (0 would invite an immediate retry that fails again)
        return str(max(1, math.ceil(self.retry_after_s)))


def bucket_for(buckets: dict[str, TokenBucket], name: str, limit: int, now: float) -> TokenBucket:
    """The tenant's bucket for the rate `name` with capacity `limit`, refilled up to `now`."""
    bucket = buckets.get(name)
    if bucket is None:
        bucket = buckets[name] = TokenBucket(float(limit), float(limit), now)
    elif bucket.capacity != limit:
        bucket.resize(float(limit))
    bucket.refill(now)
    return bucket


def admit(
    buckets: dict[str, TokenBucket],
    limits: Limits,
    now: float,
    used_today: int,
    used_this_month: int,
) -> Refusal | None:
    """Admit a request (taking one request token) or say which limit refuses it (taking
    nothing). Checked in the order a client can act on: budgets, then rates."""
    if limits.tokens_per_day is not None and used_today >= limits.tokens_per_day:
        return Refusal(
            "budget_tokens_per_day",
            f"budget tokens per day reached: {used_today} of {limits.tokens_per_day} tokens"
            " used today (UTC)",
            seconds_to_next_day(now),
        )
    if limits.tokens_per_month is not None and used_this_month >= limits.tokens_per_month:
        return Refusal(
            "budget_tokens_per_month",
            f"budget tokens per month reached: {used_this_month} of {limits.tokens_per_month}"
            " tokens used this month (UTC)",
            seconds_to_next_month(now),
        )
    for name, unit in (
        ("prompt_tokens_per_minute", "prompt tokens"),
        ("generated_tokens_per_minute", "generated tokens"),
    ):
        limit = getattr(limits, name)
        if limit is None:
            continue
        bucket = bucket_for(buckets, name, limit, now)
        if bucket.level <= 0:
            return Refusal(
                name,
                f"rate limit of {limit} {unit} per minute reached: {-bucket.level:.0f} over,"
                " charged as the last answers ended",
                bucket.seconds_until(min(1.0, bucket.capacity)),
            )
    if limits.requests_per_minute is not None:
        bucket = bucket_for(buckets, "requests_per_minute", limits.requests_per_minute, now)
        if bucket.level < 1:
            return Refusal(
                "requests_per_minute",
                f"rate limit of {limits.requests_per_minute} requests per minute reached",
                bucket.seconds_until(1.0),
            )
        bucket.level -= 1
    return None


def take_prompt(
    buckets: dict[str, TokenBucket], limits: Limits, n_tokens: int, now: float
) -> Refusal | None:
    """Take a prompt's tokens before it is forwarded, or refuse it (taking nothing)."""
    limit = limits.prompt_tokens_per_minute
    if limit is None:
        return None
    bucket = bucket_for(buckets, "prompt_tokens_per_minute", limit, now)
    needed = min(float(n_tokens), bucket.capacity)  # a larger prompt needs a full bucket
    if bucket.level < needed or bucket.level <= 0:
        return Refusal(
            "prompt_tokens_per_minute",
            f"rate limit of {limit} prompt tokens per minute reached: the prompt has"
            f" {n_tokens} tokens, {max(bucket.level, 0):.0f} are left",
            bucket.seconds_until(max(needed, 1.0)),
        )
    bucket.level -= n_tokens
    return None


def charge(
    buckets: dict[str, TokenBucket], limits: Limits, name: str, n_tokens: int, now: float
) -> None:
    """Charge tokens already spent (generated, or a prompt only counted afterwards)."""
    limit = getattr(limits, name)
    if limit is None or n_tokens <= 0:
        return
    bucket_for(buckets, name, limit, now).level -= n_tokens


# each rate and the suffix of its `x-ratelimit-*` headers
RATE_HEADERS = (
    ("requests_per_minute", "requests"),
    ("prompt_tokens_per_minute", "prompt-tokens"),
    ("generated_tokens_per_minute", "generated-tokens"),
)
REQUEST_RATE_HEADERS = RATE_HEADERS[:1]
TOKEN_RATE_HEADERS = RATE_HEADERS[1:]
# the limit, remaining and reset header names of each suffix ("tokens": the tightest token rate)
_HEADER_NAMES = {
    suffix: tuple(f"x-ratelimit-{kind}-{suffix}" for kind in ("limit", "remaining", "reset"))
    for suffix in (*(suffix for _, suffix in RATE_HEADERS), "tokens")
}


def rate_headers(
    buckets: dict[str, TokenBucket],
    limits: Limits,
    now: float,
    rates: tuple[tuple[str, str], ...] = RATE_HEADERS,
) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for the tenant's rate limits as they stand at `now`.

    `-requests` for the request rate; `-tokens` for whichever token rate has the least left
    (as a share of its limit), and `-prompt-tokens` / `-generated-tokens` for each. `rates`:
    only those (`REQUEST_RATE_HEADERS`: the `-requests` headers alone)."""
    headers: dict[str, str] = {}
    tightest: tuple[str, str, str] | None = None  # the first token rate with the least left
    tightest_share = 0.0
    for name, suffix in rates:
        limit = getattr(limits, name)
        if limit is None:
            continue
        bucket = bucket_for(buckets, name, limit, now)
        figures = (
            str(limit),
            str(max(math.floor(bucket.level), 0)),
            duration_text(bucket.seconds_until(bucket.capacity)),  # until full
        )
        limit_name, remaining_name, reset_name = _HEADER_NAMES[suffix]
        headers[limit_name], headers[remaining_name], headers[reset_name] = figures
        if suffix != "requests":
            share = bucket.level / bucket.capacity if bucket.capacity else 0.0
            if tightest is None or share < tightest_share:
                tightest, tightest_share = figures, share
    if tightest is not None:
        limit_name, remaining_name, reset_name = _HEADER_NAMES["tokens"]
        headers[limit_name], headers[remaining_name], headers[reset_name] = tightest
    return headers


def refusal_headers(
    buckets: dict[str, TokenBucket], limits: Limits, refusal: Refusal, now: float
) -> dict[str, str]:
    """The rate-limit headers of a refusal: as they stand, but no request left when the request
    rate refused (a request takes one: none was there for it). Limits shared between proxies
    refuse what this proxy could not take although its view of the pools may show some left
    (it comes back from another proxy within a round). A token rate's remaining stays as it
    stands: a prompt may need more tokens than are left."""
    headers = rate_headers(buckets, limits, now)
    remaining = _HEADER_NAMES["requests"][1]
    if refusal.limit == "requests_per_minute" and remaining in headers:
        headers[remaining] = "0"
    return headers


def duration_text(seconds: float) -> str:
    """A reset time as OpenAI writes it: "20ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def day_start(now: float) -> float:
    moment = datetime.fromtimestamp(now, UTC)
    return moment.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


def month_start(now: float) -> float:
    moment = datetime.fromtimestamp(now, UTC)
    return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def seconds_to_next_day(now: float) -> float:
    return day_start(now) + 86400 - now


def seconds_to_next_month(now: float) -> float:
    first = datetime.fromtimestamp(month_start(now), UTC)
    following = (first + timedelta(days=32)).replace(day=1)
    return following.timestamp() - now
