"""A device that sends its scores and features but never answers detail pulls is passed over
for details as a silent scorer is (ddnn.edge.detail_suspects): flagged, left out of the pulls
(no escalated frame waits the detail deadline for it), asked again now and then, and cleared by
any detail it sends."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ddnn.edge.detail_suspects import PROBE_EVERY, SUSPECT_AFTER, DetailSuspects
from ddnn.edge.escalation import DetailPulls
from ddnn.edge.pipeline import Exit, ToCloud
from tests.support.events import RecordedEvents

DEVICES = ("cam0", "cam1", "cam2")
SHAPE = (3, 4, 4)


class Cloud:
    """The cloud stage's side DetailPulls hands frames to."""

    def __init__(self):
        self.sent = []

    def put(self, frame, sent, since=None):
        self.sent.append((frame.id, sent))


def manifest():
    output = SimpleNamespace(sample_shape=SHAPE)
    return SimpleNamespace(views=3, escalation_views=0, version="1",
                           devices=[SimpleNamespace(output=lambda name: output)] * 3)


def escalate(pulls, frame_id):
    f = SimpleNamespace(id=frame_id, scores={v: np.zeros(3, np.float32) for v in range(3)})
    sent = ToCloud(np.zeros((1, 8), np.float32), "1",
                   Exit("edge", np.zeros(3, np.float32), 0.9, (0, 1, 2)))
    f.runs_on = SimpleNamespace(manifest=manifest())
    pulls._escalate(f, sent, f.runs_on.manifest)
    return f


def test_a_device_that_never_answers_detail_pulls_is_passed_over_and_comes_back():
    requests, cloud, events = [], Cloud(), RecordedEvents()
    pulls = DetailPulls(lambda topic, payload, qos: requests.append(payload), "req", events,
                        0.5, cloud, devices=DEVICES)
    detail = np.zeros((1, *SHAPE), np.float32)
    for frame in range(SUSPECT_AFTER):  # cam2 answers none of them
        escalate(pulls, frame)
        pulls.add(0, frame, detail)
        pulls.add(1, frame, detail)
        assert len(cloud.sent) == frame  # the frame waits for cam2's detail ...
        pulls.expire(1e9)  # ... until the deadline
    assert pulls.flagged() == {2: ["details"]}
    assert ("cam2", "details", True) in events.of("on_flag")
    # Now an escalated frame goes up as soon as the others' details are in: nobody waits.
    escalate(pulls, 100)
    pulls.add(0, 100, detail)
    pulls.add(1, 100, detail)
    assert cloud.sent[-1][0] == 100
    # ... but for a probe now and then, whose answer clears the flag.
    probe = 99 + PROBE_EVERY  # frame 100 was the first passed over
    for frame in range(101, probe + 1):
        escalate(pulls, frame)
        pulls.add(0, frame, detail)
        pulls.add(1, frame, detail)
    assert cloud.sent[-1][0] == probe - 1  # the probe waits for cam2 again
    pulls.add(2, probe, detail)
    assert cloud.sent[-1][0] == probe and not pulls.flagged()
    assert ("cam2", "details", False) in events.of("on_flag")


def test_suspects_alone():
    events = RecordedEvents()
    s = DetailSuspects(DEVICES, events, suspect_after=2, probe_every=3)
    s.missed([1])
    assert s.ask([0, 1]) == (0, 1)
    s.missed([1])
    assert s.suspect(1) and s.ask([0, 1]) == (0,) and s.ask([1]) == ()
    assert s.ask([1]) == (1,)  # the third: a probe
    s.answered(1)
    assert not s.suspect(1) and s.ask([1]) == (1,)
