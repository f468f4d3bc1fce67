"""Status messages bounded before parsing, and their times checked on use (issue 25 items 5,
11, 17)."""

import json
import time

from ddnn.status import (
    FUTURE_TOLERANCE,
    MAX_STATUS_BYTES,
    MAX_STATUS_DEPTH,
    status_fields,
    status_time,
)


def test_nesting_beyond_the_bound_is_unreadable_but_brackets_in_strings_do_not_count():
    ok = {"state": "online", "devices": {"cam0": {"state": "online", "note": "[[[[{{{{" * 9}}}
    assert status_fields(json.dumps(ok).encode()) == ok
    nested: object = []
    for _ in range(MAX_STATUS_DEPTH):
        nested = [nested]
    assert status_fields(json.dumps({"state": "online", "x": nested}).encode()) == {}
    assert status_fields(b"[" * 100_000) == {}


def test_a_status_larger_than_the_bound_is_not_parsed():
    body = json.dumps({"state": "online", "pad": "x" * MAX_STATUS_BYTES}).encode()
    assert status_fields(body) == {}
    assert status_fields(b"online") == {"state": "online"}


def test_times_must_be_finite_positive_and_not_in_the_future():
    now = time.time()
    assert status_time({"since": now - 3600}, "since") == now - 3600
    assert status_time({"since": now + FUTURE_TOLERANCE / 2}, "since") is not None
    for bad in (now + 2 * FUTURE_TOLERANCE, 1e308, float("nan"), -1.0, 0, True, "1", None):
        assert status_time({"since": bad}, "since") is None, bad
