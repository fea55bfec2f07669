"""How many bytes of request bodies may be spilled at once, per tenant and in all.

A big body reserves its bytes before they are written: all of them at once when it says its
length (Content-Length), else as they arrive. Past a bound the request is refused at once,
never held: 429 when the tenant's own bound is reached (its other bodies are still being
received or served), 503 when the proxy's is. The bytes are given back when the request ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from cacheproxy.errors import ApiError

BODY_LIMIT_ERROR = "body_limit_error"
# the bodies held now end with their requests: a client may try again soon
RETRY_AFTER_S = "1"


class SpillBudget:
    """`refused(bound)` is told of each refusal: `tenant` (429) or `proxy` (503)."""

    def __init__(
        self,
        total_bytes: int,
        tenant_bytes: int,
        refused: Callable[[str], None] = lambda bound: None,
    ) -> None:
        self.total_bytes = total_bytes
        self.tenant_bytes = tenant_bytes
        self.refused = refused
        self.held = 0
        self.held_by: Counter[str] = Counter()

    def reserve(self, tenant: str, size: int) -> None:
        """Hold `size` more bytes for `tenant`'s body; ApiError (429, 503) past a bound."""
        if self.held_by[tenant] + size > self.tenant_bytes:
            self.refused("tenant")
            raise ApiError(
                429,
                f"too many request bodies of this tenant being received at once (over"
                f" {self.tenant_bytes} bytes); try again when they are done",
                BODY_LIMIT_ERROR,
                headers={"Retry-After": RETRY_AFTER_S},
            )
        if self.held + size > self.total_bytes:
            self.refused("proxy")
            raise ApiError(
                503,
                f"server busy: too many request bodies being received at once (over"
                f" {self.total_bytes} bytes)",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        self.held += size
        self.held_by[tenant] += size

    def release(self, tenant: str, size: int) -> None:
        self.held -= size
        self.held_by[tenant] -= size
        if self.held_by[tenant] <= 0:
            del self.held_by[tenant]
