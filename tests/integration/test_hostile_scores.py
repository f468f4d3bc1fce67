"""A device that sends huge class scores outvotes nobody (issue 25 item 8).

The local exit averages the devices' logits: one device sending ±50 would outvote the others.
Real broker, a real edge in this process, honest devices replaying their views; the hostile
one publishes scores far beyond the bound the bundle recorded from calibration.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddnn import envelope as env
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.edge.score_bounds import ScoreBounds
from ddnn.envelope import MessageType
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.evaluate import evaluate
from ddnn.topics import Topics
from tests.support.hierarchy import REPLAY_WAIT, Edge, run_devices
from tests.support.polling import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")


def test_huge_scores_are_refused_and_their_device_flagged(mosquitto, tiny_bundle, tiny_data,
                                                          tmp_path):
    m = load_bundle(tiny_bundle).manifest
    assert ScoreBounds.of(m.calibration).limit < 50, "the bundle records its devices' bound"
    hostile, n = f"cam{m.views - 1}", 120
    # Every frame at the local exit, where the scores are fused (no cloud needed).
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment="scores", local_threshold=1.0,
                edge_threshold=1.0)
    pub = MqttClient(mosquitto.url, "vandal", MqttOptions()).start()
    try:
        assert pub.wait_connected(10)
        huge = np.full((1, m.num_classes), -50.0, np.float32)
        huge[0, 0] = 50.0  # class 0, whatever the scene
        for frame in range(n):
            payload = env.encode(env.pack(
                MessageType.SCORES, frame=frame, tensor=huge, codec=m.codec["scores"],
                model=m.name, version=m.version, deployment="scores", device=hostile))
            pub.publish(Topics("scores").device(hostile, "scores"), payload, 1)
        a = edge.agg.metrics
        wait_for(lambda: a.dropped.value(reason="scores") >= n, REPLAY_WAIT, "refused")
        run_devices(tiny_bundle, tiny_data.test, mosquitto.url, deployment="scores",
                    views=range(m.views - 1))
        wait_for(lambda: edge.agg.answered >= n, REPLAY_WAIT, f"{n} results")
    finally:
        pub.stop()
        edge.stop()
    results = list(edge.agg.results)
    assert sorted(r["frame"] for r in results) == list(range(n))
    assert all(hostile not in r["views"] and r["missing"][hostile] == "refused"
               for r in results)
    assert a.flagged.value(device=hostile, reason="scores") == 1
    assert a.refused.value(device=hostile, reason="scores") == n
    assert a.flagged.value(device="cam0", reason="scores") == 0
    # Live accuracy: that of the hierarchy without the hostile view (offline, same exits), on
    # the frames where an honest view saw something.
    d = dict(np.load(tiny_data.test))
    d["X"][:, m.views - 1] = 0.0
    d["y"][:, m.views - 1] = -1
    seen = np.flatnonzero((d["y"] >= 0).any(axis=1))
    np.savez_compressed(tmp_path / "honest.npz",
                        **{k: v if k == "classes" else v[seen] for k, v in d.items()})
    offline = evaluate(tiny_bundle, tmp_path / "honest.npz", 1.0, 1.0)["accuracy"]["overall"]
    label, by_frame = load_dataset(tiny_data.test).label, {r["frame"]: r for r in results}
    live = np.mean([by_frame[k]["class"] == label[k] for k in seen])
    assert live >= offline - 0.05, (live, offline)
