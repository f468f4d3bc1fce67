"""The edge's experience recorder (edge/recorder.py) alone: chunks in ddnn.experience's format,
a directory kept within its budget, a full queue dropping frames (counted), never blocking."""

from __future__ import annotations

import collections

import numpy as np

from ddnn.bundle import load_bundle
from ddnn.edge.events import EdgeEvents
from ddnn.edge.recorder import ExperienceRecorder, ExperienceRecording
from ddnn.experience import chunks, read_experience


class Counted(EdgeEvents):
    """The recorder's events: frames by outcome, and the directory's sizes."""

    def __init__(self, counts: collections.Counter, sizes: list[int]):
        self.counts, self.sizes = counts, sizes

    def on_experience(self, outcome: str, frames: int) -> None:
        self.counts.update({outcome: frames})

    def on_experience_size(self, size: int) -> None:
        self.sizes.append(size)


def frames(manifest, n, rng):
    shape = manifest.devices[0].output("features").sample_shape
    for _ in range(n):
        features = {v: rng.integers(0, 2, shape).astype(np.float32) for v in (0, 2)}
        scores = {v: rng.normal(size=manifest.num_classes).astype(np.float32)
                  for v in range(manifest.views)}
        yield features, scores, rng.normal(size=manifest.num_classes).astype(np.float32)


def test_recorded_frames_are_read_back_and_the_budget_holds(tiny_bundle, tmp_path):
    m = load_bundle(tiny_bundle).manifest
    counts, sizes = collections.Counter(), []
    budget_mb = 0.02
    recorder = ExperienceRecorder(
        ExperienceRecording(directory=tmp_path / "exp", max_mb=budget_mb),
        events=Counted(counts, sizes))
    recorder.start()
    rng = np.random.default_rng(0)
    for features, scores, cloud in frames(m, 600, rng):
        recorder.put(m, features, scores, cloud)
    recorder.stop()  # writes what is left
    assert counts["recorded"] == 600 and not counts["dropped"] and not counts["failed"]
    on_disk = sum(p.stat().st_size for p in chunks(tmp_path / "exp"))
    assert 0 < on_disk <= budget_mb * 1024 * 1024 and sizes[-1] == on_disk
    exp = read_experience(tmp_path / "exp", classes=tuple(m.classes))
    assert 0 < exp.num_samples < 600  # the oldest chunks went first
    assert exp.present[:, [0, 2]].all() and not exp.present[:, 1].any()
    assert exp.device_scores is not None and np.allclose(exp.soft_label.sum(1), 1, atol=1e-3)


def test_a_full_queue_drops_frames_and_counts_them(tiny_bundle, tmp_path):
    m = load_bundle(tiny_bundle).manifest
    counts = collections.Counter()
    recorder = ExperienceRecorder(ExperienceRecording(directory=tmp_path / "exp"),
                                  events=Counted(counts, []), queue_size=2)
    for features, scores, cloud in frames(m, 5, np.random.default_rng(1)):
        recorder.put(m, features, scores, cloud)  # not started: nothing takes them
    assert counts["dropped"] == 3


def test_each_frame_is_recorded_with_its_chance_of_being_recorded(tiny_bundle, tmp_path):
    """A frame sent up (chance 1), an audited early exit (the audit's rate) and an operator's
    label (0: no random draw chose it) keep their chances, for a sample of the stream."""
    m = load_bundle(tiny_bundle).manifest
    recorder = ExperienceRecorder(ExperienceRecording(directory=tmp_path / "exp"))
    recorder.start()
    (features, scores, cloud), (f2, s2, c2) = frames(m, 2, np.random.default_rng(2))
    recorder.put(m, features, scores, cloud)
    recorder.put(m, f2, s2, c2, chance=0.2)
    assert recorder.put_labelled(m, features, 1)
    recorder.stop()
    exp = read_experience(tmp_path / "exp")
    chances = exp.chance.astype(float).round(6).tolist()
    assert sorted(zip(chances, exp.label.tolist(), strict=True)) == [(0.0, 1), (0.2, -1),
                                                                     (1.0, -1)]


def test_the_edge_gives_a_frame_the_chance_a_random_draw_gave_it():
    """Audits are draws at their rate and frames sent up are sure to come, while the early
    exits are audited; a latency probe is timed, not drawn, and with audits off the early
    exits had no chance at all: neither stands for a sample of the stream (chance 0)."""
    from types import SimpleNamespace

    from ddnn.edge.answers import Answers
    from ddnn.edge.pipeline import ToCloud

    def chance(sent, auditing=True):
        answers = Answers.__new__(Answers)  # (only its audit is read)
        answers.audit = SimpleNamespace(on=auditing)
        return answers._chance(sent)

    up = ToCloud(np.zeros((1, 4)), "1", None)
    assert chance(up) == 1.0 and chance(up, auditing=False) == 0.0
    assert chance(ToCloud(np.zeros((1, 4)), "1", None, audit=0.2)) == 0.2
    assert chance(ToCloud(np.zeros((1, 4)), "1", None, audit=0.2, probe=True)) == 0.0
