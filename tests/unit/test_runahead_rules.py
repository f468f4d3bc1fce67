"""Devices that run ahead of the others, in simulated time: held, joined or refused, flagged.

The end-to-end runs with real processes are tests/e2e/test_runahead.py; these cover the rules
one by one, camera frame ids (capture time × fps) included.
"""

import numpy as np

from ddnn.edge.assembler import Drop, FrameAssembler, FrameBounds
from ddnn.edge.runahead import HOLD
from tests.support.events import RecordedEvents

S = np.zeros(3, np.float32)
CAMERA0 = 1_750_000_000 * 25  # a camera's frame id: its capture time's slot at 25 fps


class Clock:
    """A deployment's devices in simulated time: ``send`` one view at ``t`` seconds."""

    def __init__(self, a: FrameAssembler):
        self.a, self.answered, self.late = a, {}, []

    def send(self, view: int, frame: int, t: float, captured: float | None = None) -> None:
        try:
            f = self.a.add_scores(view, frame, S, t if captured is None else captured, now=t)
        except Drop as d:
            assert d.reason == "late", d
            self.late.append((view, frame))
            return
        if f is not None:
            self.done(f)

    def tick(self, t: float) -> None:
        for f in self.a.expire(now=t):
            self.done(f)

    def done(self, f) -> None:
        self.answered[f.id] = set(f.scores)
        self.a.finish(f)


def replay(clock: Clock, views, frames, t0: float, fps: float = 25.0, first: int = 0,
           tick: bool = True):
    """``views`` send ``frames`` together at ``fps`` from ``t0``; deadlines checked between."""
    for k in range(frames):
        t = t0 + k / fps
        if tick:
            clock.tick(t)
        for v in views:
            clock.send(v, first + k, t)


def test_a_device_that_joins_ahead_is_held_refused_and_flagged():
    events = RecordedEvents()
    a = FrameAssembler(6, deadline=0.2, max_wait=1.0, events=events,
                       devices=[f"cam{v}" for v in range(6)])
    c = Clock(a)
    replay(c, range(5), 50, 0.0)  # frames 0..49 in 2 s (cam5 silent: soon not waited for)
    for k in range(100):  # at 2 s: frames 100..199 at 5000 fps
        c.send(5, 100 + k, 2.0 + k / 5000)
    assert not any(f in c.answered or a.knows(f) for f in range(100, 200)), "it opened none"
    replay(c, range(5), 150, 2.0, first=50)  # the others go on, to frame 199
    c.tick(10.0)
    assert sorted(c.answered) == list(range(200))
    assert all(c.answered[f] == {0, 1, 2, 3, 4} for f in range(50, 200)), "none of its views"
    assert events.of("on_flag") == [("cam5", "ahead", True)]
    assert events.of("on_refused").count(("cam5", "ahead")) == 100
    assert a.roster.flagged() == {5: ["ahead"]} and 5 not in a.roster.expected()
    assert a.roster.late_views() == []  # the honest devices were never late


def test_two_devices_together_are_not_ahead_of_a_third_that_lags():
    # cam2 replays the same frames 20 frames (0.8 s) behind cam0 and cam1: the two that run
    # together open every frame and are never held; cam2's views come late and are not fused.
    a = FrameAssembler(3, deadline=0.3, max_wait=0.3)
    c = Clock(a)
    for k in range(200):
        t = k / 25
        c.tick(t)
        c.send(0, k, t)
        c.send(1, k, t)
        if k >= 20:
            c.send(2, k - 20, t)
    c.tick(20.0)
    assert sorted(c.answered) == list(range(200))
    assert all(c.answered[f] == {0, 1} for f in range(200)) and a.roster.flagged() == {}


def test_a_device_that_starts_first_opens_one_frame_at_most():
    a = FrameAssembler(6, deadline=0.2, max_wait=1.0)
    c = Clock(a)
    for k in range(200):  # alone, at 5000 fps: faster than any camera
        c.send(5, k, k / 5000)
    c.tick(3.0)
    assert sorted(c.answered) == [0]  # its first view: nothing was known of it yet
    replay(c, range(5), 200, 3.0)  # the others, three seconds later, from frame 0
    c.tick(20.0)
    assert sorted(c.answered) == list(range(200))
    assert all(c.answered[f] == {0, 1, 2, 3, 4} for f in range(1, 200))
    assert a.roster.flagged() == {5: ["ahead"]}
    # Frame 0 was answered from it alone; the others' views of it were late, but their lag
    # (its three-second lead) was not learnt, so no later frame stopped waiting for them.
    assert max(a.roster.lag.estimate[:5]) < a.max_wait


def test_cameras_numbered_by_capture_time():
    # A camera whose clock is four seconds ahead numbers its frames 100 slots ahead of the
    # others, at their pace: held once the others report, and flagged.
    a = FrameAssembler(4, deadline=0.2, max_wait=1.0)
    c = Clock(a)
    for k in range(200):
        t = 100.0 + k / 25
        c.tick(t)
        for v in range(3):
            c.send(v, CAMERA0 + k, t)
        c.send(3, CAMERA0 + 100 + k, t, captured=t + 4.0)
    c.tick(200.0)
    assert all(c.answered[CAMERA0 + k] == {0, 1, 2} for k in range(10, 200))
    assert a.roster.flagged() == {3: ["ahead"]}


def test_a_camera_at_5000_fps_that_starts_first_cannot_fill_the_edge():
    # Its frame ids are slots at 5000 fps: no honest camera shares them. Alone, it opens one
    # frame; its views wait, bounded, and are refused; the edge keeps room for the others.
    a = FrameAssembler(4, deadline=0.2, max_wait=1.0, bounds=FrameBounds(max_open=64))
    c = Clock(a)
    for k in range(3000):
        t = k / 5000
        c.send(3, CAMERA0 * 200 + k, t)
    assert len(a) <= 1 and a.roster.runahead.holding <= HOLD
    replay(c, range(3), 100, 2.0, first=CAMERA0)
    c.tick(10.0)
    # (Silent while it was alone, the others were not waited for: the first view of each
    # revives only its own device, so their first frame is answered without the other two.)
    assert all(c.answered[CAMERA0 + k] == {0, 1, 2} for k in range(1, 100))
    assert a.roster.flagged() == {3: ["ahead"]}


def test_honest_cameras_started_apart_are_not_flagged():
    # One camera starts ten seconds before the others: it numbers frames by time at 25 fps,
    # like them, so it is never ahead of them.
    a = FrameAssembler(3, deadline=0.2, max_wait=1.0)
    c = Clock(a)
    replay(c, [0], 250, 0.0, first=CAMERA0)
    replay(c, [0, 1, 2], 100, 10.0, first=CAMERA0 + 250)
    c.tick(20.0)
    # (their first frame comes while they are not waited for yet: see above)
    assert all(c.answered[CAMERA0 + 250 + k] == {0, 1, 2} for k in range(1, 100))
    assert a.roster.flagged() == {}


def test_replays_as_fast_as_possible_together_lose_nothing():
    # --fps 0: a thousand frames a second, the devices a few milliseconds apart. The first
    # one is alone for a moment, faster than any camera: its views are held, then joined.
    a = FrameAssembler(3, deadline=2.0, max_wait=2.0)
    c = Clock(a)
    for k in range(120):
        for v, late in ((0, 0.0), (1, 0.004), (2, 0.009)):
            c.tick(k / 1000 + late)
            c.send(v, k, k / 1000 + late)
    c.tick(10.0)
    assert sorted(c.answered) == list(range(120))
    assert all(views == {0, 1, 2} for views in c.answered.values())
    assert a.roster.flagged() == {}


def test_a_device_alone_goes_on_once_the_others_are_offline():
    # Its peers said offline: nobody to run ahead of, whatever its pace.
    a = FrameAssembler(3, deadline=0.2, max_wait=1.0)
    a.roster.set_online(1, False)
    a.roster.set_online(2, False)
    c = Clock(a)
    for k in range(50):
        c.send(0, k, k / 1000)
    assert sorted(c.answered) == list(range(50))


def test_a_one_view_deployment_is_never_held():
    a = FrameAssembler(1, deadline=0.2, single_view=False)
    c = Clock(a)
    for k in range(50):
        c.send(0, k, k / 5000)
    assert sorted(c.answered) == list(range(50))


def test_a_flagged_device_that_behaves_again_is_cleared():
    events = RecordedEvents()
    a = FrameAssembler(3, deadline=0.2, max_wait=1.0, events=events)
    c = Clock(a)
    replay(c, [0, 1], 25, 0.0)
    for k in range(30):  # two seconds ahead
        c.send(2, 75 + k, 1.0 + k / 5000)
    replay(c, [0, 1], 100, 1.0, first=25)
    assert a.roster.flagged() == {2: ["ahead"]}
    replay(c, [0, 1, 2], 100, 5.0, first=125)  # in step with the others now
    assert events.of("on_flag") == [("2", "ahead", True), ("2", "ahead", False)]
    assert all(c.answered[f] == {0, 1, 2} for f in range(200, 225))


def test_pushed_features_of_a_held_view_join_the_frame_with_its_scores():
    # Push mode at --fps 0: a device more than a few frames ahead sends scores, then features,
    # of a frame nobody opened yet; both are held, and both join when the other opens it.
    a = FrameAssembler(2, deadline=0.2, max_wait=1.0)
    c = Clock(a)
    replay(c, [0, 1], 5, 0.0, tick=False)
    for k in range(5, 15):
        c.send(1, k, 0.2)
    x = np.ones((1, 4), np.float32)
    c.send(1, 15, 0.2)
    assert a.add_features(1, 15, x, 0.2, now=0.2) is None and not a.knows(15)
    for k in range(5, 15):
        c.send(0, k, 0.25)
    f = a.add_scores(0, 15, S, 0.25, now=0.25)
    assert f is not None and f.present == [0, 1] and f.features[1] is x
    assert a.roster.pushing[1] and all(c.answered[k] == {0, 1} for k in range(15))


def test_a_device_seconds_behind_makes_no_honest_device_ahead():
    # Two and three views: one device replays the same frames two seconds behind the others.
    # It is late, not a reference: the others open every frame, nobody is flagged.
    for views in (2, 3):
        a = FrameAssembler(views, deadline=0.3, max_wait=1.0)
        c = Clock(a)
        on_time = list(range(views - 1))
        for k in range(150):
            t = k / 20
            c.tick(t)
            for v in on_time:
                c.send(v, k, t)
            if k >= 40:
                c.send(views - 1, k - 40, t)
        c.tick(20.0)
        assert sorted(c.answered) == list(range(150))
        assert all(c.answered[k] == set(on_time) for k in range(150)), views
        assert a.roster.flagged() == {}
