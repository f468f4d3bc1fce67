"""The one poll of the test suite: wait on a condition, never on a guessed duration."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

EVERY = 0.01  # seconds between two looks


def wait_for(condition: Callable[[], T], timeout: float = 20.0, what: str = "condition",
             procs: Iterable[subprocess.Popen] = ()) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail after
    ``timeout`` seconds, or as soon as one of ``procs`` exits with an error."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"{what}: {p.args[3:5]} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(EVERY)
    return result
