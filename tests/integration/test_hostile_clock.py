"""A device whose capture times are off by 29 s (within the edge's old ±30 s tolerance)
falsifies no latency (issue 25 item 15). Real broker, the edge and three devices in this
process; one device stamps every frame 29 s in the past.
"""

from __future__ import annotations

import time

import pytest

from ddnn.dataset import load_dataset
from tests.support.hierarchy import REPLAY_WAIT, Edge, run_devices
from tests.support.polling import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

OFF = 29.0  # seconds behind: the edge's clock-skew check alone (30 s) lets it through


def behind(service) -> None:
    """``service``'s device stamps its frames OFF seconds in the past, if it runs view 2."""
    if service.settings.view != 2:
        return
    process = service.agent.process
    service.agent.process = lambda frame, image, captured=None: process(
        frame, image, time.time() - OFF)


def test_capture_times_far_from_the_other_views_are_flagged_and_not_trusted(
        mosquitto, tiny_bundle, tiny_data):
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment="clock", local_threshold=1.0,
                edge_threshold=1.0)
    try:
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment="clock",
                    prepare=behind)
        wait_for(lambda: edge.agg.answered >= 120, REPLAY_WAIT, "120 results")
    finally:
        edge.stop()
    results = list(edge.agg.results)
    m = edge.agg.metrics
    assert sorted(r["frame"] for r in results) == list(range(120))
    # Its lie is in no answer's latency (an honest one here is well under a second or two).
    assert max(r["latency_ms"] for r in results) < OFF * 1000 / 2
    assert m.flagged.value(device="cam2", reason="clock") == 1
    assert m.flagged.value(device="cam0", reason="clock") == 0
    # Its views are still fused: only its capture times are not trusted.
    saw = load_dataset(tiny_data.test).present[:, 2]
    fused = [r for r in results if saw[r["frame"]] and "cam2" in r["views"]]
    assert len(fused) >= 0.9 * saw.sum()
