"""Operators' feedback, live: devices and an edge in this process on a real Mosquitto broker.

An operator labels answered frames over ``POST /v1/feedback``: a frame the local exit answered
(the edge never had its features: it pulls them from the devices, which keep their last
``--keep`` frames) and one that went past it (the edge has them). Both are recorded with their
hard labels in the experience ``ddnn federate`` reads; a device's token, no token, an unknown
frame and a second label are refused with their reasons.
"""

from __future__ import annotations

import contextlib
import threading

import httpx
import numpy as np
import pytest

from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.experience import read_experience
from tests.support.data import mixed, mixed_thresholds
from tests.support.hierarchy import REPLAY_WAIT, Edge
from tests.support.polling import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

OPERATOR = "operator-0123456789abcdef"
DEVICE = "device-0123456789abcdef"
FRAMES = 40


def test_an_operator_labels_answered_frames_and_the_edge_records_them(
        mosquitto, tiny_bundle, tiny_data, tmp_path):
    recorded = tmp_path / "experience"
    thresholds = mixed_thresholds(tiny_bundle, tiny_data.test)
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment="feedback", http_port=0,
                experience=recorded, operator_token=OPERATOR, http_token=DEVICE,
                **mixed(thresholds))
    with contextlib.ExitStack() as stack:
        stack.callback(edge.stop)
        views = edge.agg.manifest.views
        # Devices that linger after their replay (their features kept for pulls).
        devices = [stack.enter_context(DeviceService.from_settings(DeviceSettings(
            bundle=tiny_bundle, view=v, broker=mosquitto.url, deployment="feedback",
            data=tiny_data.test, limit=FRAMES, grace=120, drain_timeout=120, keepalive=5,
            reconnect_max=1, peers=tuple(f"cam{i}" for i in range(views)), wait_peers=20)))
            for v in range(views)]
        threads = [threading.Thread(target=d.run) for d in devices]
        for t in threads:
            t.start()
        for d, t in zip(devices, threads, strict=True):
            stack.callback(t.join, 30)
            stack.callback(d.stop_event.set)
        wait_for(lambda: edge.agg.answered == FRAMES, REPLAY_WAIT, "every frame answered")
        by_exit: dict[str, list[int]] = {}
        for r in edge.agg.results:
            by_exit.setdefault(r["exit"], []).append(r["frame"])
        local, further = by_exit["local"][0], (by_exit.get("edge") or by_exit["cloud"])[0]
        classes = edge.agg.manifest.classes
        url = f"{edge.service.http.url}/v1/feedback"

        def post(frame, label, token=OPERATOR):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return httpx.post(url, json={"frame": frame, "label": label}, headers=headers,
                              timeout=30)

        first = post(local, classes[2])
        assert first.status_code == 201, first.text
        assert first.json()["pulled"] == [f"cam{v}" for v in range(views)]  # all pulled
        second = post(further, 1)
        assert second.status_code == 201, second.text
        assert second.json()["pulled"] == [] and second.json()["label"] == classes[1]

        assert post(local, 0).status_code == 409
        unknown = post(10_000, 0)
        assert unknown.status_code == 404 and "not been answered" in unknown.json()["error"]
        assert post(local, "no such class").status_code == 400
        assert post(further, 1, token=DEVICE).status_code == 403  # a device's token
        assert post(further, 1, token=None).status_code == 401
        series = edge.agg.metrics.learning.feedback
        assert series.value(outcome="recorded") == 2
        assert series.value(outcome="forbidden") == series.value(outcome="unauthorized") == 1

    exp = read_experience(recorded, classes=tuple(classes))  # (the edge wrote them at its stop)
    assert exp.num_samples == 2 and exp.labelled.all()
    assert sorted(exp.label.tolist()) == [1, 2]
    assert exp.present.any(axis=1).all() and np.abs(exp.features).sum() > 0
