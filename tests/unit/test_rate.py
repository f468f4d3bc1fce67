"""The per-client rate of ddnn.plumbing.rate, on a clock the test moves."""

from __future__ import annotations

from ddnn.plumbing.rate import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_per_client():
    clock = Clock()
    limit = RateLimiter(rate=10, burst=20, clock=clock)
    assert [limit.allow("a") for _ in range(21)] == [True] * 20 + [False]
    assert limit.allow("b")  # another client has its own bucket
    clock.now += 0.5  # five tokens back, no more than the burst ever
    assert [limit.allow("a") for _ in range(6)] == [True] * 5 + [False]
    clock.now += 100
    assert sum(limit.allow("a") for _ in range(30)) == 20


def test_the_buckets_kept_are_bounded():
    limit = RateLimiter(rate=1, burst=1, max_clients=3, clock=Clock())
    for client in ("a", "b", "c", "d"):
        assert limit.allow(client)
    assert len(limit._buckets) == 3 and "a" not in limit._buckets
    assert not limit.allow("d")
