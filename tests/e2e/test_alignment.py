"""Live answers under skew and load: devices started one after another on a busy machine.

As a user follows the README: an edge, then one ``ddnn device`` process per view started a
second apart, while two CPU-bound processes compete for the two cores. Then one device is
paused (SIGSTOP) for 3 s and resumed, then another is killed. Every frame is answered once;
while all devices run, the answers match the offline evaluation (within a point) and are whole;
frames answered while a device was away say so (``partial``, the view in ``missing``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.hierarchy import hierarchy_predictions
from ddnn.runtime import BundleRuntime
from tests.support.data import STREAM, mixed_thresholds
from tests.support.processes import Deployment, frames_of

FPS = 20


def offline_predictions(bundle, data, thresholds) -> np.ndarray:
    """What ``ddnn evaluate`` answers for each frame, with these thresholds."""
    b = load_bundle(bundle)
    ds = load_dataset(data)
    exits = BundleRuntime(b).run_dataset(ds.X, ds.present)
    return hierarchy_predictions(exits, b.manifest.policy.with_overrides(**thresholds))[0]


def busy_cpus(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def answered_up_to(d: Deployment) -> int:
    return max((r["frame"] for r in d.results()), default=-1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_skewed_starts_under_load_pause_and_kill(mosquitto, tiny_bundle, stream_data, cloud_url,
                                                 tmp_path):
    thresholds = mixed_thresholds(tiny_bundle, stream_data)
    d = Deployment(tmp_path, tiny_bundle, mosquitto.url, cloud_url, thresholds=thresholds,
                   deadline_ms=200, feature_deadline_ms=500, deployment="skew")
    burners = busy_cpus(2)
    try:
        d.start_edge()
        for v in range(3):  # one after another, as a user types them (the scenario, not a wait)
            d.start_device(v, stream_data, FPS)
            time.sleep(1.0)
        d.wait(lambda r: len(r) >= 80, "80 results with every device running")
        paused_from = answered_up_to(d)
        d.devices[1].send_signal(signal.SIGSTOP)
        time.sleep(3.0)  # the pause itself
        d.devices[1].send_signal(signal.SIGCONT)
        resumed_at = answered_up_to(d)
        d.wait(lambda r: max((x["frame"] for x in r), default=0) >= resumed_at + 60,
               "60 frames after the resume")
        killed_at = answered_up_to(d)
        killed = d.devices.pop(2)  # (its exit status is the point, not a failure)
        killed.kill()
        killed.wait()
        d.wait(lambda r: len(r) >= STREAM, f"{STREAM} results", timeout=180)
        for proc in d.devices[:2]:
            assert proc.wait(60) == 0
    finally:
        for b in burners:
            b.kill()
            b.wait()
        d.stop()
    results = d.results()
    assert frames_of(results) == list(range(STREAM)), "every frame answered exactly once"
    by_frame = {r["frame"]: r for r in results}
    ds = load_dataset(stream_data)

    # While every device runs: whole answers, as accurate as the offline evaluation.
    before = range(paused_from)
    partial = [f for f in before if by_frame[f]["partial"]]
    assert len(partial) <= 0.02 * len(before), f"partial before the pause: {partial}"
    live = np.array([by_frame[f]["class"] for f in before])
    offline = offline_predictions(tiny_bundle, stream_data, thresholds)[: len(before)]
    labels = ds.label[: len(before)]
    assert abs(float((live == labels).mean()) - float((offline == labels).mean())) <= 0.01

    # The pause: frames answered without cam1 say so.
    without_cam1 = [r for r in results if "cam1" in r["missing"]
                    and r["missing"]["cam1"] != "absent"]
    assert len(without_cam1) >= 10, "the 3 s pause left frames without cam1"
    # (late or offline; no_features when its scores came just before the pause and its
    # features were pulled while it was stopped)
    wrong = [(r["frame"], r["partial"], r["missing"]["cam1"]) for r in without_cam1
             if not r["partial"] or r["missing"]["cam1"] not in ("late", "offline", "no_features")]
    assert not wrong, f"frames without cam1 not flagged so: {wrong}"
    assert all(paused_from - 5 <= r["frame"] <= resumed_at + 30 for r in without_cam1), \
        "cam1 was missing only around its pause"

    # After the resume, whole again until the kill; after the kill, cam2 is missing, flagged.
    whole = range(resumed_at + 30, killed_at)
    assert whole and all(not by_frame[f]["partial"] for f in whole)
    after_kill = [by_frame[f] for f in range(killed_at + 40, STREAM)]
    assert after_kill and all("cam2" not in r["views"] for r in after_kill)
    assert all(r["partial"] for r in after_kill if ds.present[r["frame"], 2])
    assert all(not r["degraded"] for r in results if r["frame"] < paused_from)
