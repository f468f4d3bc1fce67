"""The edge's events: every observer hears each event, a failing one fails nothing else; a
frame only moves forward through its stages."""

from __future__ import annotations

import logging

import pytest

from ddnn.edge.events import EVENTS, EdgeEvents, EventRunner
from ddnn.edge.frame import DONE, FEATURES, SCORES, Frame
from ddnn.edge.metrics import EdgeMetrics
from tests.support.events import RecordedEvents


class Broken(EdgeEvents):
    """An observer with a bug in one event."""

    def __init__(self) -> None:
        self.calls = 0

    def on_audit(self, exit: str) -> None:
        self.calls += 1
        raise ValueError("a bug")


def test_every_observer_hears_each_event_and_a_failing_one_is_logged_once(caplog):
    broken, metrics, recorded = Broken(), EdgeMetrics(), RecordedEvents()
    runner = EventRunner([broken, *metrics.observers(), recorded])
    with caplog.at_level(logging.ERROR, logger="ddnn.edge.events"):
        for _ in range(3):
            runner.on_audit("edge")
    assert broken.calls == 3  # called every time, its failure caught every time
    assert metrics.learning.audits.value(exit="edge") == 3  # the observers after it still hear
    assert recorded.of("on_audit") == [("edge",)] * 3
    assert len([r for r in caplog.records if "Broken" in r.getMessage()]) == 1


def test_the_metrics_count_what_the_events_say():
    metrics = EdgeMetrics()
    runner = EventRunner(metrics.observers())
    runner.on_dropped("late", "cam1", 0.3)
    runner.on_dropped("scores", "cam2")
    runner.on_dropped("ahead", "cam2")  # a frame id beyond the window: not the device's conduct
    runner.on_refused("cam0", "ahead")  # a held view that ran ahead: its device's conduct
    assert metrics.dropped.value(reason="late") == 1 and metrics.late.value(device="cam1") == 1
    assert metrics.refused.value(device="cam2", reason="scores") == 1
    assert metrics.refused.value(device="cam2", reason="ahead") == 0
    assert metrics.refused.value(device="cam0", reason="ahead") == 1
    assert metrics.dropped.value(reason="ahead") == 2


def test_every_event_is_a_no_op_of_the_protocol():
    events = EdgeEvents()
    assert EVENTS and all(name.startswith("on_") for name in EVENTS)
    assert len(set(EVENTS)) == len(EVENTS)
    assert events.on_settled(0) is None


def test_a_frame_only_moves_forward():
    f = Frame(1, captured=0.0, opened=0.0)
    assert f.stage is SCORES
    f.move(FEATURES)
    with pytest.raises(ValueError, match="cannot go from features to scores"):
        f.move(SCORES)
    f.move(DONE)
    f.move(DONE)  # done again is nothing (the cloud stage may answer a finished frame)
    with pytest.raises(ValueError):
        f.move(FEATURES)
    with pytest.raises(RuntimeError, match="no bundle version"):
        _ = f.runs_on
