"""A device that cannot keep up with its source stays current instead of falling behind without
bound: slowed to 70 % of its frame rate, it drops the frames it can no longer deliver on time
and says so (``skipped``), so the edge fuses every view it sends, reports the others as missing
``skipped`` and never waits for them (a real broker, the edge and three devices in threads)."""

from __future__ import annotations

import time

from tests.support.hierarchy import Edge, run_devices
from tests.support.polling import wait_for

FPS = 20.0


def slowed(service, share: float = 0.7) -> None:
    """Make ``service``'s frames take 1/share of a frame period (70 %: 1.43 periods)."""
    agent, process = service.agent, service.agent.process
    cost = 1 / (FPS * share)

    def slow(frame, image, captured=None):
        t0 = time.perf_counter()
        process(frame, image, captured)
        time.sleep(max(cost - (time.perf_counter() - t0), 0.0))

    agent.process = slow


def test_a_device_at_70_percent_of_its_frame_rate_skips_frames_and_nobody_waits(
        mosquitto, tiny_bundle, stream_data):
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment="slow")
    try:
        services = run_devices(tiny_bundle, stream_data, mosquitto.url, deployment="slow",
                               fps=FPS, limit=120,
                               prepare=lambda s: slowed(s) if s.settings.view == 1 else None)
        wait_for(lambda: edge.agg.answered >= 120, 60, "every frame answered")
    finally:
        edge.stop()
    slow = services[1].agent.stats
    assert slow.skipped > 0.15 * 120 and slow.frames == 120  # ~30 % dropped, each said
    results = edge.agg.results
    assert sorted(r["frame"] for r in results) == list(range(120))
    skipped = [r for r in results if r["missing"].get("cam1") == "skipped"]
    # Every view the slow device sent was fused; the ones it skipped are reported as such,
    # never as late: no frame waited for it.
    assert len(skipped) == slow.skipped
    for r in results:
        assert "cam1" in r["views"] or r["missing"].get("cam1") in ("skipped", "absent"), r
        assert r["missing"].get("cam1") != "late"
    assert edge.agg.metrics.skipped.value(device="cam1") == slow.skipped
    # The devices that keep up skip (next to) nothing: a stall of the whole machine past
    # --max-lag-ms makes any device skip a frame (seen once on a loaded CI machine); the slow
    # device's skipping is its own.
    fast = services[0].agent.stats
    assert fast.skipped * 4 <= slow.skipped and fast.frames == 120
