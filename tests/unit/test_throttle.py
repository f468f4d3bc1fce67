"""LogThrottle: which of many repeated events get a log line."""

from __future__ import annotations

from ddnn.plumbing.throttle import LogThrottle


def lines(throttle: LogThrottle, events: int, key=None) -> list[tuple[int, int]]:
    """(event number, events the line speaks for) of each event that gets a line."""
    return [(n, said) for n in range(1, events + 1) if (said := throttle(key))]


def test_once_per_key_by_default():
    once = LogThrottle()
    assert lines(once, 5, "a") == [(1, 1)]
    assert lines(once, 3, "b") == [(1, 1)]
    assert once.seen("a") and not once.seen("c")
    once.forget("a")
    assert lines(once, 2, "a") == [(1, 1)]


def test_the_first_then_one_in_every():
    every = LogThrottle(every=1000)
    assert lines(every, 3000) == [(1, 1), (1000, 999), (2000, 1000), (3000, 1000)]


def test_at_each_doubling():
    doubling = LogThrottle(doubling=True)
    assert [n for n, _ in lines(doubling, 20)] == [1, 2, 4, 8, 16]


def test_one_line_per_period_counts_what_it_stood_for():
    now = [0.0]
    period = LogThrottle(period=10.0, clock=lambda: now[0])
    said = []
    for t in (0.0, 1.0, 2.0, 9.0, 10.5, 11.0, 25.0):
        now[0] = t
        said.append(period())
    assert said == [1, 0, 0, 0, 4, 0, 2]


def test_keys_are_bounded():
    bounded = LogThrottle(max_keys=2)
    assert [bounded(k) for k in "abc"] == [1, 1, 0]
