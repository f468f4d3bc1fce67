"""The bounds on devices' class scores (issue 25 item 8): what the bundle records decides."""

import dataclasses
import math

import numpy as np

from ddnn import envelope as env
from ddnn.bundle import load_bundle
from ddnn.edge.assembler import FrameAssembler
from ddnn.edge.events import NO_EVENTS
from ddnn.edge.ingest import Ingest
from ddnn.edge.score_bounds import MARGIN, ScoreBounds
from ddnn.envelope import MessageType
from ddnn.topics import Topics


def test_logits_within_the_calibrated_bound_pass_and_beyond_are_refused():
    b = ScoreBounds.of({"scores": {"kind": "logits", "max_abs": 8.0}})
    assert b.limit == MARGIN * 8.0
    assert b.check((31.9, -31.9, 0.0)) is None
    assert "beyond" in b.check((50.0, -50.0, -50.0))
    assert "beyond" in b.check((0.0, -32.5, 0.0))


def test_values_that_are_not_finite_are_refused_whatever_the_bundle():
    for b in (ScoreBounds.of({}), ScoreBounds.of({"scores": {"kind": "logits", "max_abs": 8}})):
        assert "finite" in b.check((math.nan, 0.0, 0.0))
        assert "finite" in b.check((0.0, math.inf, 0.0))


def test_a_bundle_without_a_record_bounds_nothing_else():
    assert ScoreBounds.of({}).check((1e4, -1e4, 0.0)) is None
    assert ScoreBounds.of({"scores": {"kind": "logits", "max_abs": "x"}}).limit == math.inf


def test_log_probabilities_must_be_normalized():
    b = ScoreBounds.of({"scores": {"kind": "log_probs"}})
    p = [0.7, 0.2, 0.1]
    assert b.check(tuple(math.log(x) for x in p)) is None
    assert "normalized" in b.check(tuple(math.log(x) + 1.0 for x in p))
    assert "normalized" in b.check((50.0, -50.0, -50.0))


class Unscheduled:
    """Stands in for the scheduler: ready frames go nowhere (only the ingest is tested)."""

    def ready(self, f) -> None:
        pass


def test_during_an_update_each_version_is_held_to_its_own_bounds(tiny_bundle):
    old = load_bundle(tiny_bundle).manifest
    old = dataclasses.replace(old, calibration={"scores": {"kind": "logits", "max_abs": 10.0}})
    new = dataclasses.replace(old, version="2",
                              calibration={"scores": {"kind": "logits", "max_abs": 1.0}})
    ingest = Ingest(FrameAssembler(old.views), Topics(), ["cam0", "cam1", "cam2"], old,
                    scheduler=Unscheduled(), events=NO_EVENTS)
    ingest.serve(new)

    def scores(version: str, frame: int) -> bytes:
        x = np.full((1, old.num_classes), 5.0, np.float32)
        return env.encode(env.pack(MessageType.SCORES, version=version, frame=frame, tensor=x,
                                   codec=old.codec["scores"]))

    assert ingest.accept(scores("1", 0), "cam0") is None  # within the old version's 20
    assert ingest.accept(scores("2", 1), "cam0") == "scores"  # beyond the new one's 2
