"""Which way a frame goes up (ddnn.edge.escalation.DetailPulls.send_up): a frame the edge exit
left goes to the escalated model with its cameras' details, and so do an audit (checked against
the cloud's best answer) and a latency probe (the planner measures the way a frame sent up
goes); at level 0 (calibration chose the plain cloud for answers) only an audit takes them.
The cloud stage times a frame from its hand-over, details included."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from ddnn.edge.escalation import DetailPulls
from ddnn.edge.pipeline import Exit, ToCloud
from tests.support.events import RecordedEvents

SHAPE = (3, 4, 4)


class Cloud:
    def __init__(self):
        self.sent = []

    def put(self, frame, sent, since=None):
        self.sent.append((frame.id, sent, since))


def frame(frame_id, level=1):
    output = SimpleNamespace(sample_shape=SHAPE)
    m = SimpleNamespace(views=3, escalation_views=0, version="1", escalation_level=level,
                        escalated=object(),
                        devices=[SimpleNamespace(output=lambda name: output)] * 3)
    return SimpleNamespace(id=frame_id, runs_on=SimpleNamespace(manifest=m),
                           scores={v: np.zeros(3, np.float32) for v in range(3)})


SENT = ToCloud(np.zeros((1, 8), np.float32), "1",
               Exit("edge", np.zeros(3, np.float32), 0.9, (0, 1, 2)))


@pytest.mark.parametrize("sent, level, escalates", [
    (SENT, 1, True), (replace(SENT, audit=0.05), 1, True),
    (replace(SENT, audit=0.05, probe=True), 1, True),
    (SENT, 0, False), (replace(SENT, audit=0.05), 0, True),
    (replace(SENT, audit=0.05, probe=True), 0, False)],
    ids=["left", "audit", "probe", "left-level-0", "audit-level-0", "probe-level-0"])
def test_a_frame_goes_up_escalated_where_its_bundle_escalates(sent, level, escalates):
    requests, cloud = [], Cloud()
    pulls = DetailPulls(lambda topic, payload, qos: requests.append(payload), "req",
                        RecordedEvents(), 0.5, cloud, devices=("cam0", "cam1", "cam2"))
    handed = time.monotonic()
    pulls.send_up(frame(7, level), sent)
    if not escalates:
        assert not requests and cloud.sent == [(7, sent, None)]
        return
    assert len(requests) == 1 and not cloud.sent  # it waits for the details
    for v in range(3):
        pulls.add(v, 7, np.ones((1, *SHAPE), np.float32))
    (frame_id, up, since), = cloud.sent
    assert frame_id == 7
    assert up.detail is not None and up.detail.shape == (1, 9, 4, 4)
    assert up.audit == sent.audit and up.probe == sent.probe
    assert handed <= since <= time.monotonic()  # its cloud cost counts the details' wait
