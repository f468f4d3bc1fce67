"""A peer's JSON is measured before it is parsed: its nesting in linear time, without
recursion, so that no body can run ``json.loads`` into the interpreter's recursion limit."""

import json
import random
import sys
import threading

import pytest

from ddnn.bounded_json import MAX_DEPTH, JsonDepthError, loads, nesting_depth


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _random_json(rng: random.Random, depth: int) -> object:
    kind = rng.choice("lds0" if depth < 12 else "s0")
    if kind == "l":
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "d":
        return {rng.choice(["[", "{", '"', "\\", "a]"]) * rng.randrange(3):
                _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == "s":
        return "".join(rng.choice('[]{}"\\é\n x') for _ in range(rng.randrange(8)))
    return rng.choice([0, -1.5, True, None])


def test_the_depth_is_the_parsed_values_whatever_its_strings_hold():
    rng = random.Random(7)
    for _ in range(500):
        value = _random_json(rng, 0)
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
            assert nesting_depth(text) == nesting_depth(text.encode()) == _depth(value), text
            assert loads(text, max_depth=12) == value


def test_a_body_deeper_than_the_bound_is_refused_before_json_loads_recurses():
    for body in (b"[" * 50_000, b'{"a": ' * 50_000, b'[' * 33 + b']' * 33):
        with pytest.raises(JsonDepthError, match="more than 32"):
            loads(body)
    assert issubclass(JsonDepthError, ValueError)  # callers' ``except ValueError`` still holds
    nested: object = 1
    for _ in range(MAX_DEPTH):
        nested = [nested]
    assert loads(json.dumps(nested)) == nested


def test_the_measure_never_recurses():
    # A thread with a tiny stack would crash on recursion; the scan is a loop.
    done: list[int] = []
    limit = sys.getrecursionlimit()
    thread = threading.Thread(target=lambda: done.append(nesting_depth(b"[{" * 400_000)))
    thread.start()
    thread.join(timeout=30)
    assert done == [800_000] and sys.getrecursionlimit() == limit


def test_unterminated_strings_and_stray_escapes_are_scanned_in_one_pass():
    assert nesting_depth(b'["[[[') == 1  # the string runs to the end: json.loads stops there
    assert nesting_depth(b'"\\"' * 30_000) == 0  # quadratic for a scan that backtracks
    assert nesting_depth(b"[\\[") == 2  # a backslash outside a string: json.loads fails on it
    with pytest.raises(ValueError):
        loads(b"[\\[")
    assert nesting_depth(b"\xff[") == 1 and nesting_depth(b"") == 0
