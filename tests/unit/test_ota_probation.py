"""Probation of an over-the-air update (ddnn.plumbing.probation), on a fake clock: when a
version counts as failing, passes or is rolled back; what is kept, deleted and remembered on
disk; a crash during probation condemns the version at the next start, a clean stop does not.
Also the tiers' probes: what the edge and a device count against the version they run."""

from __future__ import annotations

import json
import shutil
import time
import types
from pathlib import Path

import pytest

from ddnn.bundle import load_bundle
from ddnn.device.health import DeviceVersionProbe, SourceWatch
from ddnn.edge.health import EdgeHealth, EdgeVersionProbe
from ddnn.edge.settings import EdgeSettings
from ddnn.plumbing.probation import (
    CRASHED,
    FAILED,
    PASSED,
    PENDING,
    Look,
    Probation,
    RolledBack,
    UpdateGuard,
)
from tests.support.stubs import Agg

BAD = Look(problems=("3 frames failed",))
GOOD = Look(worked=True)
QUIET = Look()


def verdicts(p: Probation, looks: list[tuple[float, Look]]) -> list[str]:
    return [p.observe(look, t) for t, look in looks]


def test_failing_for_a_quarter_of_the_window_fails():
    p = Probation("tiny:2", window=8.0, started=0.0)  # sustained: 2 s
    assert verdicts(p, [(1, BAD), (2, BAD), (3, BAD)]) == [PENDING, PENDING, FAILED]
    assert p.problems == ("3 frames failed",)


def test_a_look_that_saw_it_work_ends_a_failing_run():
    p = Probation("tiny:2", window=8.0, started=0.0)
    assert verdicts(p, [(1, BAD), (2, GOOD), (2.5, BAD), (4, BAD), (4.5, BAD)]) == \
        [PENDING] * 4 + [FAILED]


def test_quiet_looks_neither_end_a_failing_run_nor_let_it_pass():
    p = Probation("tiny:2", window=2.0, started=0.0)  # sustained: 0.5 s
    assert verdicts(p, [(0.2, BAD), (0.4, QUIET), (3.0, QUIET)]) == [PENDING] * 3, \
        "failing at the end of the window: not passed"
    assert p.status(3.0)["failing_s"] == 2.8
    assert verdicts(p, [(3.1, GOOD)]) == [PASSED]


def test_it_passes_once_the_window_is_over_if_not_failing():
    p = Probation("tiny:2", window=8.0, started=0.0)
    assert verdicts(p, [(1, GOOD), (4, QUIET), (7.9, GOOD), (8.0, QUIET)]) == \
        [PENDING, PENDING, PENDING, PASSED]


def test_the_rolled_back_record_keeps_the_newest(tmp_path, monkeypatch):
    import ddnn.plumbing.probation as probation

    monkeypatch.setattr(probation, "KEEP", 2)
    record = RolledBack(tmp_path / "rb.json")
    for v in ("2", "3", "4"):
        record.add(f"tiny:{v}", f"why {v}")
        time.sleep(0.002)  # distinct timestamps: the record is ordered by them
    again = RolledBack(tmp_path / "rb.json")
    assert again.why("tiny:2") is None and again.why("tiny:4") == "why 4"
    assert again.last()[0] == "tiny:4"  # type: ignore[index]
    (tmp_path / "bad.json").write_text("{not json")
    assert RolledBack(tmp_path / "bad.json").last() is None


# --- the guard ---------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Probe:
    def __init__(self):
        self.next = QUIET
        self.begun = 0

    def begin(self) -> None:
        self.begun += 1

    def look(self) -> Look:
        return self.next


def staged(src: Path, dst: Path, version: str):
    shutil.copytree(src, dst)
    mf = dst / "manifest.json"
    d = json.loads(mf.read_text())
    d["model"]["version"] = version
    mf.write_text(json.dumps(d))
    return load_bundle(dst)


@pytest.fixture
def tiers(tiny_bundle, tmp_path):
    """The tier's own bundle (version 1), its staging directory with versions 2 and 3 in it,
    and a maker of guards over them on a fake clock."""
    root = tmp_path / ".ddnn-ota"
    v1 = staged(tiny_bundle, tmp_path / "tiny", "1")
    v2 = staged(tiny_bundle, root / "tiny-2-edge0", "2")
    v3 = staged(tiny_bundle, root / "tiny-3-edge0", "3")
    clock, applied, rollbacks = Clock(), [], []

    def guard(running=v1, probe=None, window=8.0) -> UpdateGuard:
        return UpdateGuard(running, applied.append, root=root, tag="edge0", window=window,
                           probe=probe, clock=clock,
                           on_rollback=lambda ref, why: rollbacks.append((ref, why)))

    return types.SimpleNamespace(v1=v1, v2=v2, v3=v3, root=root, clock=clock, guard=guard,
                                 applied=applied, rollbacks=rollbacks)


def step(t, guard: UpdateGuard, seconds: float):
    t.clock.now += seconds
    return guard.check()


def test_a_failing_version_is_rolled_back_and_remembered(tiers):
    t, probe = tiers, Probe()
    g = t.guard(probe=probe)
    g.arm(t.v2)
    assert json.loads(g.marker.read_text())["version"] == "tiny:2"
    g.applied(t.v2)
    assert probe.begun == 1 and g.status()["probation"]["version"] == "tiny:2"
    probe.next = BAD
    assert step(t, g, 0.5) is None and step(t, g, 1.0) is None
    back = step(t, g, 1.0)  # failing for 2 s: a quarter of 8
    assert back is not None and back.ref == "tiny:1" and [b.ref for b in t.applied] == ["tiny:1"]
    assert back.path == t.v1.path, "the tier's own bundle, verified again"
    assert t.rollbacks[0][0] == "tiny:2" and "3 frames failed" in t.rollbacks[0][1]
    assert not g.marker.exists() and not t.v2.path.exists(), "the bad copy is deleted"
    assert g.status()["probation"] is None and g.status()["rolled_back_from"] == "tiny:2"
    assert t.guard().rolled_back.why("tiny:2"), "remembered by the next process"


def test_a_passed_version_becomes_the_one_to_roll_back_to(tiers):
    t, probe = tiers, Probe()
    g = t.guard(probe=probe)
    g.arm(t.v2)
    g.applied(t.v2)
    probe.next = GOOD
    assert step(t, g, 8.0) is None and g.status()["probation"] is None and g.good is t.v2
    assert not g.marker.exists() and t.v1.path.exists(), "the tier's own bundle is kept"
    g.arm(t.v3)
    g.applied(t.v3)
    probe.next = BAD
    step(t, g, 1.0)
    assert step(t, g, 2.0).ref == "tiny:2"  # type: ignore[union-attr]
    assert t.v2.path.exists() and not t.v3.path.exists()


def test_a_version_passed_replaces_a_staged_one_which_is_deleted(tiers):
    t, probe = tiers, Probe()
    g = t.guard(running=t.v2, probe=probe)
    g.applied(t.v3)
    assert step(t, g, 8.0) is None and g.good is t.v3
    assert not t.v2.path.exists(), "the staged version it replaced is gone once it passed"


def test_a_crash_during_probation_rolls_the_version_back_at_the_next_start(tiers):
    t = tiers
    g = t.guard()
    g.arm(t.v2)
    g.applied(t.v2)
    g.stop(clean=False)  # or no stop at all: the process died
    again = t.guard()
    again.resume()
    assert t.rollbacks == [("tiny:2", CRASHED)] and again.rolled_back.why("tiny:2") == CRASHED
    assert not again.marker.exists()
    assert not t.v2.path.exists() and t.v1.path.exists(), "the staged copy is of no more use"


def test_a_clean_stop_during_probation_condemns_nothing(tiers):
    t = tiers
    g = t.guard()
    g.arm(t.v2)
    g.applied(t.v2)
    g.stop(clean=True)
    again = t.guard()
    again.resume()
    assert t.rollbacks == [] and again.rolled_back.why("tiny:2") is None


def test_a_version_not_applied_after_all_leaves_the_marker_to_the_one_on_probation(tiers):
    t = tiers
    g = t.guard()
    g.arm(t.v2)
    g.applied(t.v2)
    g.arm(t.v3)
    g.disarm()  # version 3 could not be applied
    assert json.loads(g.marker.read_text())["version"] == "tiny:2"


def test_without_probation_nothing_is_marked_and_the_update_is_good_at_once(tiers):
    t = tiers
    g = t.guard(running=t.v2, window=0.0)
    g.arm(t.v3)
    g.applied(t.v3)
    assert not g.marker.exists() and g.due_in() is None and g.good is t.v3
    assert not t.v2.path.exists()


def test_a_version_superseded_during_probation_is_not_rolled_back_to(tiers):
    t, probe = tiers, Probe()
    g = t.guard(probe=probe)
    g.applied(t.v2)
    g.applied(t.v3)  # a newer announcement came during the probation of version 2
    probe.next = BAD
    step(t, g, 1.0)
    assert step(t, g, 2.0).ref == "tiny:1"  # type: ignore[union-attr]
    assert not t.v2.path.exists() and not t.v3.path.exists()


# --- the tiers' probes ---------------------------------------------------------------------------


def test_the_edge_counts_failed_frames_and_unknown_versions_against_its_version(tmp_path):
    (tmp_path / "b").mkdir()
    agg = Agg()
    agg.manifest = types.SimpleNamespace(version="2")
    probe = EdgeVersionProbe(EdgeHealth(agg, EdgeSettings(bundle=tmp_path / "b", http_port=0),
                                        None))  # type: ignore[arg-type]
    agg.metrics.dropped.inc(reason="processing_failed")  # before the update: not counted
    probe.begin()
    assert probe.look() == QUIET
    agg.answered += 2
    assert probe.look() == GOOD
    agg.metrics.dropped.inc(2, reason="processing_failed")
    agg.metrics.cloud.inc(outcome="unknown_version")
    agg.answered += 1
    look = probe.look()
    assert look.worked and len(look.problems) == 2
    assert "2 frames failed in the edge's segments" in look.problems[0]
    assert "does not serve version 2" in look.problems[1]


def test_a_device_counts_a_frame_that_runs_too_long_not_a_silent_source():
    source = SourceWatch(iter([(0, None), (1, None)]))
    service = types.SimpleNamespace(agent=types.SimpleNamespace(stats=types.SimpleNamespace(
        frames=0)), source=source, settings=types.SimpleNamespace(stall_after=5.0, fps=10.0))
    probe = DeviceVersionProbe(service)
    frames = iter(source)
    next(frames)
    service.agent.stats.frames = 1
    assert probe.look() == GOOD, "a frame processed, none running for long"
    source.busy_since = time.monotonic() - 6  # the agent has been on this frame for 6 s
    look = probe.look()
    assert not look.worked and "one frame has been running for 6 s" in look.problems[0]
    source.busy_since = None  # waiting on the source, however long, is not the version's fault
    source.last = time.monotonic() - 60
    assert probe.look() == QUIET
