"""The gateway's coalescer: a frame's messages go together, complete or at the window's end."""

from __future__ import annotations

import threading
import time

from ddnn.device.gateway.coalescer import Coalescer


def _collect():
    sent, event = [], threading.Event()

    def flush(groups):
        sent.extend(groups)
        event.set()
    return sent, event, flush


def test_a_group_goes_as_soon_as_every_expected_device_sent():
    sent, _, flush = _collect()
    c = Coalescer(60.0, lambda key: {"cam0", "cam1"}, flush)
    c.add(("scores", 7), "cam0", b"a", "tag-a")
    assert sent == [] and len(c) == 1
    c.add(("scores", 8), "cam0", b"c")
    c.add(("scores", 7), "cam1", b"b", "tag-b")
    assert [g.key for g in sent] == [("scores", 7)]
    assert sent[0].entries == [("cam0", b"a", "tag-a"), ("cam1", b"b", "tag-b")]
    assert len(c) == 1  # frame 8 still waits for cam1


def test_an_incomplete_group_goes_when_its_window_ends():
    sent, event, flush = _collect()
    c = Coalescer(0.05, lambda key: {"cam0", "cam1"}, flush)
    runner = threading.Thread(target=c.run)
    runner.start()
    start = time.monotonic()
    c.add(("features", 3), "cam1", b"f")
    assert event.wait(5)
    waited = time.monotonic() - start
    c.stop()
    runner.join(5)
    assert [g.key for g in sent] == [("features", 3)] and waited >= 0.05


def test_nothing_expected_means_the_window_decides_and_stop_sends_the_rest():
    sent, _, flush = _collect()
    c = Coalescer(60.0, lambda key: set(), flush)
    runner = threading.Thread(target=c.run)
    runner.start()
    c.add(("scores", 1), "cam0", b"x")
    c.add(("scores", 1), "cam1", b"y")
    assert sent == []
    c.stop()
    runner.join(5)
    assert len(sent) == 1 and len(sent[0].entries) == 2


def test_held_groups_are_bounded():
    sent, _, flush = _collect()
    c = Coalescer(60.0, lambda key: {"cam0", "cam1"}, flush, max_groups=3)
    for frame in range(5):
        c.add(("scores", frame), "cam0", b"x")
    assert len(c) == 3 and [g.key[1] for g in sent] == [0, 1]
