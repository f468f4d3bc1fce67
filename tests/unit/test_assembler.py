"""Frame assembly: deadlines, absent and dead devices, duplicates and late views."""

import numpy as np
import pytest

from ddnn.edge.assembler import FEATURES, SCORES, Drop, FrameAssembler, FrameBounds
from ddnn.edge.roster import DeviceRules

S = np.zeros(3, np.float32)
F = np.zeros((1, 4, 2, 2), np.float32)


def test_a_frame_is_ready_when_every_view_reported():
    a = FrameAssembler(3, deadline=1.0)
    assert a.add_scores(0, 5, S, 10.0, now=0.0) is None
    assert a.add_scores(2, 5, None, 9.0, now=0.1) is None  # absent
    f = a.add_scores(1, 5, S, 11.0, now=0.2)
    assert f is not None and f.present == [0, 1] and f.absent == {2}
    assert f.captured == 9.0 and f.stage == SCORES


def test_a_view_its_device_skipped_is_not_waited_for_and_says_why():
    # A device that fell behind its source says "skipped" instead of sending scores late.
    a = FrameAssembler(3, deadline=1.0)
    assert a.add_scores(0, 5, S, 10.0, now=0.0) is None
    assert a.add_scores(1, 5, None, 10.0, now=0.05, skipped=True) is None
    f = a.add_scores(2, 5, S, 10.0, now=0.1)  # ready at once: nobody waits for view 1
    assert f is not None and f.present == [0, 2] and f.skipped == {1}
    assert a.roster.why_missing(f, (0, 2)) == {1: "skipped"}
    with pytest.raises(Drop, match="twice"):
        a.add_scores(1, 6, None, 10.0, now=0.2, skipped=True) or a.add_scores(
            1, 6, S, 10.0, now=0.2)


def test_a_missing_view_never_blocks_a_frame():
    a = FrameAssembler(3, deadline=0.5)
    a.add_scores(0, 1, S, 0.0, now=0.0)
    assert a.expire(now=0.4) == []
    (f,) = a.expire(now=0.6)
    assert f.present == [0] and f.missing == {1, 2}


def test_an_offline_device_is_not_waited_for():
    a = FrameAssembler(2, deadline=5.0)
    a.roster.set_online(1, False)
    f = a.add_scores(0, 1, S, 0.0, now=0.0)
    assert f is not None and f.present == [0]
    a.add_scores(1, 2, S, 0.0, now=0.0)  # any message revives it
    assert a.roster.expected() == [0, 1]


def test_a_silent_device_becomes_suspect_after_missed_deadlines():
    a = FrameAssembler(2, deadline=0.1, rules=DeviceRules(suspect_after=2))
    for frame in range(2):  # (captured a second apart, like the frames' arrivals)
        a.add_scores(0, frame, S, float(frame), now=frame)
        (f,) = a.expire(now=frame + 0.2)
        a.finish(f)
    assert a.roster.expected() == [0]
    assert a.add_scores(0, 2, S, 2.0, now=3.0) is not None  # no wait any more


def test_duplicates_and_late_views_are_dropped():
    a = FrameAssembler(2, deadline=0.1)
    a.add_scores(0, 1, S, 0.0, now=0.0)
    with pytest.raises(Drop) as d:
        a.add_scores(0, 1, S, 0.0, now=0.0)
    assert d.value.reason == "duplicate"
    (f,) = a.expire(now=1.0)
    with pytest.raises(Drop) as d:
        a.add_scores(1, 1, S, 0.0, now=1.0)  # taken by the worker already
    assert d.value.reason == "late"
    a.finish(f)
    with pytest.raises(Drop) as d:
        a.add_scores(1, 1, S, 0.0, now=1.0)
    assert d.value.reason == "late"


def test_forgotten_frames_are_late_not_new():
    a = FrameAssembler(1, deadline=0.1, bounds=FrameBounds(history=2))
    for frame in range(4):
        a.finish(a.add_scores(0, frame, S, 0.0, now=0.0))
    with pytest.raises(Drop, match="already answered"):
        a.add_scores(0, 0, S, 0.0, now=0.0)


def test_feature_pull_completes_or_expires():
    a = FrameAssembler(2, deadline=1.0, feature_deadline=0.5)
    a.add_scores(0, 1, S, 0.0, now=0.0)
    f = a.add_scores(1, 1, S, 0.0, now=0.0)
    assert a.await_features(f, [0, 1], now=0.0) is None
    assert f.stage == FEATURES
    assert a.add_features(0, 1, F, 0.0, now=0.1) is None
    (g,) = a.expire(now=0.6)
    assert g is f and g.missing == {1}
    with pytest.raises(Drop) as d:
        a.add_features(1, 1, F, 0.0, now=0.7)
    assert d.value.reason == "late"


def test_pushed_features_wait_for_the_decision():
    a = FrameAssembler(1, deadline=1.0)
    f = a.add_scores(0, 3, S, 0.0, now=0.0)
    assert a.add_features(0, 3, F, 0.0, now=0.0) is None  # push mode: kept, not ready
    assert a.await_features(f, [0], now=0.0) is f  # nothing to pull


def test_unrequested_features_are_dropped():
    a = FrameAssembler(2, deadline=1.0)
    with pytest.raises(Drop) as d:
        a.add_features(0, 1, F, 0.0, now=0.0)
    assert d.value.reason == "unrequested"


def test_single_view_features_make_a_frame_ready():
    a = FrameAssembler(1, single_view=True)
    f = a.add_features(0, 4, F, 0.0, now=0.0)
    assert f is not None and f.stage == FEATURES and f.requested == (0,) and f.present == [0]


def test_extend_deadlines_after_an_outage():
    a = FrameAssembler(2, deadline=0.1)
    a.add_scores(0, 1, S, 0.0, now=0.0)
    a.extend_deadlines(now=5.0)
    assert a.expire(now=5.05) == []
    assert len(a.expire(now=5.2)) == 1


def test_frames_wait_for_a_device_that_usually_lags_within_the_budget():
    a = FrameAssembler(2, deadline=0.1, max_wait=1.0)
    # Frame 1: view 1 comes 0.5 s after view 0, past the 0.1 s deadline: late, but learnt.
    a.add_scores(0, 1, S, 0.0, now=0.0)
    (f,) = a.expire(now=0.15)
    a.finish(f)
    with pytest.raises(Drop) as d:
        a.add_scores(1, 1, S, 0.0, now=0.5)
    assert (d.value.reason, d.value.view, d.value.lag) == ("late", 1, pytest.approx(0.5))
    # Frame 2 now waits for view 1 about that long (with a margin), so it is fused whole.
    a.add_scores(0, 2, S, 0.0, now=1.0)
    assert a.expire(now=1.4) == []
    f = a.add_scores(1, 2, S, 0.0, now=1.5)
    assert f is not None and f.present == [0, 1] and not f.missing


def test_the_wait_never_exceeds_the_budget():
    a = FrameAssembler(2, deadline=0.1, max_wait=0.3)
    a.roster.lag.observe(1, 0.28)  # lags 0.28 s: with the margin, more than the budget
    a.add_scores(0, 1, S, 0.0, now=0.0)
    assert a.expire(now=0.29) == []
    (f,) = a.expire(now=0.31)
    assert f.missing == {1}


def test_a_device_lagging_past_the_budget_is_not_waited_for():
    a = FrameAssembler(2, deadline=0.1, max_wait=1.0)
    a.roster.lag.observe(1, 10.0)  # 10 s behind: its views come after their frames are answered
    f = a.add_scores(0, 1, S, 0.0, now=0.0)
    assert f is not None and f.present == [0]  # no wait at all
    assert a.roster.why_missing(f, f.present) == {1: "late"}


def test_a_fixed_deadline_without_a_budget():
    a = FrameAssembler(2, deadline=0.1)  # max_wait defaults to the deadline
    a.roster.lag.observe(1, 0.09)  # with the margin it would wait 0.13 s: the deadline caps it
    a.add_scores(0, 1, S, 0.0, now=0.0)
    assert a.expire(now=0.09) == []
    assert len(a.expire(now=0.11)) == 1


def test_frame_ids_far_ahead_are_refused():
    a = FrameAssembler(1, deadline=0.1, bounds=FrameBounds(window=100))
    a.add_scores(0, 10, S, 0.0, now=0.0)
    with pytest.raises(Drop) as d:
        a.add_scores(0, 2**64 - 1, S, 0.0, now=0.0)
    assert d.value.reason == "ahead"
    a.add_scores(0, 110, S, 0.0, now=0.0)  # within the window: fine, and it moves it
    a.add_scores(0, 210, S, 0.0, now=0.0)


def test_one_huge_frame_id_cannot_make_later_frames_late():
    # The window admits it (nothing came before); forgetting smallest-first keeps it harmless.
    a = FrameAssembler(1, deadline=0.1, bounds=FrameBounds(history=4))
    a.finish(a.add_scores(0, 2**63, S, 0.0, now=0.0))
    for frame in range(20):
        f = a.add_scores(0, frame, S, 0.0, now=0.0)
        assert f is not None, f"frame {frame} was refused"
        a.finish(f)
    with pytest.raises(Drop, match="already answered"):
        a.add_scores(0, 3, S, 0.0, now=0.0)  # genuinely old frames are still late


def test_open_frames_are_bounded():
    a = FrameAssembler(2, deadline=10.0, bounds=FrameBounds(max_open=3))
    for frame in range(3):  # a camera at 25 fps
        a.add_scores(0, frame, S, frame / 25, now=0.0)
    with pytest.raises(Drop) as d:
        a.add_scores(0, 3, S, 3 / 25, now=0.0)
    assert d.value.reason == "overload"
    a.add_scores(1, 0, S, 0.0, now=0.0)  # views of open frames are still taken


def test_a_device_late_for_most_views_is_systematically_late():
    a = FrameAssembler(2, deadline=0.1)
    for frame in range(12):  # (captured a second apart, like the frames' arrivals)
        # Once it is known to lag past the budget, frames no longer wait for it at all.
        f = (a.add_scores(0, frame, S, float(frame), now=float(frame))
             or a.expire(now=frame + 0.2)[0])
        a.finish(f)
        with pytest.raises(Drop):
            a.add_scores(1, frame, S, 0.0, now=frame + 0.3)
    assert a.roster.late_views() == [1]


def test_a_fast_answer_to_a_pull_does_not_look_like_push_mode():
    a = FrameAssembler(2, deadline=1.0)
    a.add_scores(0, 1, S, 0.0, now=0.0)
    f = a.add_scores(1, 1, S, 0.0, now=0.0)  # taken by the worker, which pulls view 0...
    assert a.add_features(0, 1, F, 0.0, now=0.01) is None  # ...whose answer beats the stage
    assert a.roster.pushing == [False, False]
    assert a.await_features(f, [0, 1], now=0.02) is None  # view 0 arrived, view 1 awaited
    assert a.add_features(1, 1, F, 0.0, now=0.03) is f


def test_a_capture_time_far_from_the_other_views_is_not_trusted_and_flags_its_device():
    a = FrameAssembler(3, deadline=0.2)
    for frame in range(12):
        t = 100.0 + frame
        a.add_scores(0, frame, S, t, now=t)
        a.add_scores(1, frame, S, t + 0.01, now=t)
        f = a.add_scores(2, frame, S, t - 29.0, now=t)  # its clock 29 s behind
        assert f.captured == t and f.present == [0, 1, 2]  # fused, not trusted for latency
        a.finish(f)
    assert a.roster.flagged() == {2: ["clock"]} and a.roster.expected() == [0, 1, 2]


def test_two_views_cannot_tell_which_clock_is_off():
    a = FrameAssembler(2, deadline=0.2)
    a.add_scores(0, 0, S, 100.0, now=100.0)
    f = a.add_scores(1, 0, S, 71.0, now=100.0)
    assert f.captured == 71.0 and a.roster.flagged() == {}
