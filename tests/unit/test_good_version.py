"""A restart runs the version the tier last knew good (ddnn.plumbing.good_version): the one it
accepted over the air, or the one it rolled back to, not its ``--bundle`` again; a newer
``--bundle`` (the operator redeploying) wins; a record that names something else is ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddnn.bundle import load_bundle
from ddnn.plumbing.good_version import resume, staging_root
from ddnn.plumbing.probation import Look, UpdateGuard, good_record
from tests.support.data import version_copy

GOOD, BAD = Look(worked=True), Look(problems=("frames failed",))


def staged(src: Path, dst: Path, version: str):
    return load_bundle(version_copy(src, dst, version))


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


class Probe:
    next = GOOD

    def begin(self) -> None:
        pass

    def look(self) -> Look:
        return self.next


@pytest.fixture
def versions(tiny_bundle, tmp_path):
    root = tmp_path / ".ddnn-ota"
    return (staged(tiny_bundle, tmp_path / "tiny", "1"),
            staged(tiny_bundle, root / "tiny-2-edge0", "2"),
            staged(tiny_bundle, root / "tiny-3-edge0", "3"), root)


def guard(running, root, probe, clock):
    return UpdateGuard(running, lambda b: None, root=root, tag="edge0", window=8.0, probe=probe,
                       clock=clock)


def test_an_accepted_version_runs_after_a_restart(versions):
    v1, v2, _, root = versions
    probe, clock = Probe(), Clock()
    g = guard(v1, root, probe, clock)
    g.applied(v2)
    assert resume(v1, tag="edge0").ref == "tiny:1", "on probation: not yet good"
    clock.now += 8.0
    g.check()  # passes
    assert resume(v1, tag="edge0").path == v2.path
    assert staging_root(v2) == root == staging_root(v1), "a resumed bundle stages beside it"
    assert resume(v1, tag="cam0").ref == "tiny:1", "each tier its own record"


def test_the_version_rolled_back_to_runs_after_a_restart(versions):
    v1, v2, v3, root = versions
    probe, clock = Probe(), Clock()
    g = guard(v1, root, probe, clock)
    g.applied(v2)
    clock.now += 8.0
    g.check()  # 2 passes
    g.applied(v3)
    probe.next = BAD
    for _ in range(3):
        clock.now += 1.0
        back = g.check()
    assert back is not None and back.ref == "tiny:2"
    assert resume(v1, tag="edge0").ref == "tiny:2", "not --bundle, not the rolled-back 3"


def test_a_newer_bundle_from_the_operator_wins(versions, tiny_bundle, tmp_path):
    v1, v2, _, root = versions
    clock = Clock()
    g = guard(v1, root, Probe(), clock)
    g.applied(v2)
    clock.now += 8.0
    g.check()
    assert resume(v1, tag="edge0").ref == "tiny:2"
    newer = staged(tiny_bundle, tmp_path / "tiny-9", "9")
    assert resume(newer, tag="edge0", root=root).ref == "tiny:9"
    assert not good_record(root, "edge0").exists(), "the operator's redeploy is the new start"


def test_a_record_that_names_anything_else_is_ignored(versions, tmp_path):
    v1, v2, _, root = versions
    record = good_record(root, "edge0")
    for data in ({"version": "tiny:2", "path": str(tmp_path / "elsewhere")},  # outside staging
                 {"version": "tiny:3", "path": str(v2.path)},  # holds another version
                 {"version": "tiny:2", "path": str(root / "gone")},  # deleted
                 ["junk"]):
        record.write_text(json.dumps(data))
        assert resume(v1, tag="edge0").ref == "tiny:1"
    record.write_text("{not json")
    assert resume(v1, tag="edge0").ref == "tiny:1"
    (v2.path / "manifest.json").write_text("{}")  # tampered with since
    record.write_text(json.dumps({"version": "tiny:2", "path": str(v2.path)}))
    assert resume(v1, tag="edge0").ref == "tiny:1"
