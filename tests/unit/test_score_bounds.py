"""The bounds on devices' class scores (issue 25 item 8): what the bundle records decides."""

import math

from ddnn.edge.score_bounds import MARGIN, ScoreBounds


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
