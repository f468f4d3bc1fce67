"""One retry policy for every client that talks to a peer which may be away for a while.

The device's HTTP fallback, the edge's results callback and its cloud client all do the same
thing when the peer fails: keep what they were sending, wait a delay that doubles from
``initial`` up to ``maximum``, and try again; one success resets the delay. Which HTTP answers
mean "later" rather than "never" is part of the policy too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ddnn.errors import ConfigError

# Answers that mean "not now": the peer is overloaded, restarting or timed out. A retry can
# succeed; any other 4xx refuses the request itself, and sending it again cannot help.
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff between attempts, and the HTTP statuses worth another attempt."""

    initial: float = 0.25  # seconds before the first retry
    maximum: float = 10.0  # the delay doubles up to this many seconds
    retry_statuses: frozenset[int] = RETRY_STATUSES

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ConfigError(f"retry delays need 0 < initial <= maximum, got {self.initial}"
                              f" and {self.maximum}")

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row (``failures`` >= 1)."""
        return min(self.initial * 2.0 ** max(failures - 1, 0), self.maximum)

    def retryable(self, status: int) -> bool:
        """Whether an HTTP answer with ``status`` is worth sending again later."""
        return status in self.retry_statuses

    def backoff(self) -> Backoff:
        """A fresh retry state for one loop."""
        return Backoff(self)


class Backoff:
    """The state of one retry loop: failures in a row and when the next attempt may go.

    Not thread-safe: each loop owns its own (the callers hold their own locks).
    """

    def __init__(self, policy: RetryPolicy):
        self.policy = policy
        self.failures = 0
        self.retry_at = 0.0  # monotonic time before which no attempt should go

    def failed(self) -> float:
        """Count one failure; returns the delay before the next attempt."""
        self.failures += 1
        delay = self.policy.delay(self.failures)
        self.retry_at = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        """One attempt went through: the next failure starts from ``initial`` again."""
        self.failures, self.retry_at = 0, 0.0

    def ready(self) -> bool:
        """True when the delay since the last failure has run out."""
        return time.monotonic() >= self.retry_at
