"""The drift policy alone (ddnn.edge.drift): estimates from weighted observations, the
thresholds it adapts within the budget, the alarm, the investigation of a shift."""

from __future__ import annotations

import numpy as np
import pytest

from ddnn.edge.drift import (
    INVESTIGATION_RATE,
    AgreementMonitor,
    DriftPolicy,
    Observation,
    Observations,
    Thresholds,
    best_within,
    estimate,
)
from ddnn.errors import ConfigError

CONFIGURED = Thresholds(0.5, 0.5)


def rows(n, rng, *, wrong_when_confident: float, weight=1.0):
    """Frames whose local entropy is uniform in [0, 1); a confident local exit (entropy < 0.3)
    disagrees with the cloud with the given chance, the edge agrees always."""
    out = []
    for _ in range(n):
        e = float(rng.random())
        agrees = not (e < 0.3 and rng.random() < wrong_when_confident)
        out.append(Observation(e, agrees, float(rng.random()), True, weight))
    return out


def test_the_policy_refuses_what_cannot_work():
    with pytest.raises(ConfigError):
        DriftPolicy(audit_rate=1.5)
    with pytest.raises(ConfigError):
        DriftPolicy(audit_rate=0.1, agreement_budget=0)
    with pytest.raises(ConfigError, match="needs --audit-rate"):
        DriftPolicy(adapt_thresholds=True)
    assert not DriftPolicy().monitoring  # off by default


def test_weighted_observations_stand_for_the_frames_they_were_drawn_from():
    # 10 forwarded frames (weight 1, all agree) and 2 audited at rate 0.1 (one wrong): the
    # audited ones stand for 20 frames, half of them wrong.
    obs = Observations.of(
        [Observation(0.9, True, 0.9, True, 1.0)] * 10
        + [Observation(0.1, False, 0.9, True, 10.0), Observation(0.1, True, 0.9, True, 10.0)])
    e = estimate(obs, Thresholds(0.5, 0.5))
    assert e.frames == 30 and e.local == pytest.approx(20 / 30)
    assert e.disagreement == pytest.approx(10 / 30)
    assert estimate(obs, Thresholds(0.0, 0.0)).disagreement == 0  # all to the cloud


def test_best_within_keeps_the_most_local_exits_the_budget_allows():
    rng = np.random.default_rng(0)
    obs = Observations.of(rows(2000, rng, wrong_when_confident=0.0)
                          + [Observation(0.05, False, 0.9, True, 1.0)] * 100)
    t = best_within(obs, CONFIGURED, budget=0.01)
    # Every observation under entropy 0.05 is wrong: the local threshold must stop at 0.05.
    assert t.local == pytest.approx(0.05) and t.edge == pytest.approx(0.5)
    assert estimate(obs, t).disagreement <= 0.01


def monitor(adapt=True):
    return AgreementMonitor(DriftPolicy(audit_rate=0.1, adapt_thresholds=adapt), CONFIGURED)


def feed(m, rows_):
    decision = None
    for o in rows_:
        m.frame(o.local_entropy)
        if m.observe(o):
            decision = m.decide(*m.window())
            m.apply(decision)
    return decision


def test_disagreement_over_the_budget_raises_the_alarm_and_tightens_then_relaxes():
    rng = np.random.default_rng(1)
    m = monitor()
    feed(m, rows(600, rng, wrong_when_confident=0.0))
    assert not m.alarm and m.thresholds == CONFIGURED
    feed(m, rows(1200, rng, wrong_when_confident=0.5))  # a domain the local exit misreads
    assert m.alarm and m.raised_at is not None
    assert m.thresholds.local < CONFIGURED.local
    assert m.last.in_force.disagreement < m.last.configured.disagreement
    feed(m, rows(3000, rng, wrong_when_confident=0.0))  # back to normal
    assert not m.alarm and m.thresholds == CONFIGURED  # relaxed, never past the configured


def test_without_adapting_the_alarm_rises_and_the_thresholds_stay():
    rng = np.random.default_rng(2)
    m = monitor(adapt=False)
    feed(m, rows(1500, rng, wrong_when_confident=0.5))
    assert m.alarm and m.thresholds == CONFIGURED


def test_a_shift_in_the_local_share_audits_every_early_exit_for_a_while():
    m = monitor()
    for _ in range(300):
        m.frame(0.1)  # the local exit takes every frame
    assert not m.investigating and m.audit_rate == 0.1
    for _ in range(60):
        m.frame(0.9)  # and then none
    assert m.shifts == 1 and m.investigating and m.audit_rate == INVESTIGATION_RATE
