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


def audited_stream(m, n, rng, *, early_share, wrong_when_early, rate_of=None):
    """``n`` frames through ``m`` as the edge samples them: a frame the local exit takes (its
    entropy under the configured threshold) is observed with the monitor's audit rate of the
    moment (weight 1/rate), every other frame is forwarded (weight 1). An early answer
    disagrees with the cloud with chance ``wrong_when_early``. Returns the early exits audited.
    ``early_share(i)``: the local exit's share at frame i."""
    audits = 0
    for i in range(n):
        early = rng.random() < early_share(i)
        e = float(rng.uniform(0.0, 0.5) if early else rng.uniform(0.5, 1.0))
        m.frame(e)
        if early:
            rate = m.audit_rate
            if rng.random() >= rate:
                continue
            audits += 1
            o = Observation(e, not rng.random() < wrong_when_early, 0.9, True, 1.0 / rate)
        else:
            o = Observation(e, True, 0.2, True, 1.0)
        if m.observe(o):
            m.apply(m.decide(*m.window()))
    return audits


def test_a_share_that_keeps_shifting_cannot_postpone_the_alarm():
    # The local exit's share toggles every 50 frames (0.9 <-> 0.4), so each 50 frames look like
    # a new domain; 30 % of the early answers are wrong. Restarting the window at every shift
    # kept it under the 100 frames a decision needs: no alarm, ever, and every early exit
    # audited. Now restarts stop shrinking a window that has not decided for a while.
    for seed in range(3):
        rng = np.random.default_rng(5 + seed)
        m = AgreementMonitor(DriftPolicy(audit_rate=0.1), CONFIGURED)
        audits = audited_stream(m, 2000, rng, wrong_when_early=0.3,
                                early_share=lambda i: 0.9 if (i // 50) % 2 == 0 else 0.4)
        assert m.alarm, seed
        # Investigations (every early exit audited) are bounded: one per 900 frames, 600 long.
        assert m.ignored_shifts > 5 and m.shifts <= 3, seed
        assert audits < 0.8 * 2000 * 0.65, seed


def test_a_domain_change_still_raises_the_alarm_within_300_frames():
    # 1000 frames of the home domain (the local exit takes 80 %, all right), then the cameras
    # see another: the local exit takes 50 %, and 15 % of its answers are wrong. At an audit
    # rate of 0.2 and the default budget (1 %), the shift's investigation sees it quickly.
    for seed in range(10):
        rng = np.random.default_rng(100 + seed)
        m = AgreementMonitor(DriftPolicy(audit_rate=0.2), CONFIGURED)
        audited_stream(m, 1000, rng, early_share=lambda i: 0.8, wrong_when_early=0.0)
        assert not m.alarm, seed
        audited_stream(m, 300, rng, early_share=lambda i: 0.5, wrong_when_early=0.15)
        assert m.alarm and m.raised_at > 1000, seed
        assert m.shifts >= 1
