"""Learning in the field, live: devices, a real broker, the edge and the cloud on a bundle
trained on one domain, replaying that domain and then a drifted one (``ddnn data synth
--drift``). The edge's exits, checked against the cloud on an audit sample, raise the drift
alarm and tighten their thresholds; the edge records its experience, which
:func:`ddnn.experience.read_experience` (and so ``ddnn federate --site``) reads.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from ddnn.experience import chunks, read_experience
from tests.support.data import domain_change
from tests.support.hierarchy import REPLAY_WAIT, Edge, run_devices
from tests.support.polling import wait_for

BEFORE, AFTER = 200, 300  # frames of the bundle's domain, then of the drifted one
LOCAL = 0.99  # the configured local threshold (the edge's override; most frames exit there)
# Half the early exits audited, 2 % of disagreement allowed: on the bundle's own domain (under
# 1 % of its early answers disagree) a false alarm would take 8 disagreements in some 100
# audits; on the drifted one (some 12 %) the alarm rises within a few dozen audits.
AUDIT, BUDGET = 0.5, 0.02


@pytest.fixture(scope="module")
def field(tmp_path_factory, drift_home_bundle):
    root = tmp_path_factory.mktemp("field")
    return drift_home_bundle, domain_change(root / "replay.npz", BEFORE, AFTER)


def test_a_domain_change_raises_the_drift_alarm_and_tightens_the_exits(
        mosquitto, cloud_server, field, tmp_path):
    bundle, replay = field
    cloud = cloud_server(bundle=bundle, poll_interval=0, max_queue_delay_ms=5.0)
    recorded = tmp_path / "experience"
    edge = Edge(bundle, mosquitto.url, cloud, deployment="drift", local_threshold=LOCAL,
                edge_threshold=0.0, audit_rate=AUDIT, agreement_budget=BUDGET,
                adapt_thresholds=True,
                experience=recorded, experience_max_mb=64.0)
    with contextlib.ExitStack() as stack:
        stack.callback(edge.stop)
        agg, series = edge.agg, edge.agg.metrics.learning

        run_devices(bundle, replay, mosquitto.url, deployment="drift", limit=BEFORE)
        wait_for(lambda: agg.answered == BEFORE, REPLAY_WAIT, "the first domain answered")
        wait_for(lambda: series.audits.value(exit="local") > 0, 10, "audits sent up")
        before = agg.snapshot().drift
        assert before is not None and not before["alarm"], before
        assert before["thresholds"]["local"] == LOCAL  # the exits agree: nothing to tighten

        run_devices(bundle, replay, mosquitto.url, deployment="drift", start=BEFORE)
        wait_for(lambda: agg.answered == BEFORE + AFTER, REPLAY_WAIT, "the drifted domain")
        status = wait_for(lambda: (s := agg.snapshot().drift)["alarm"] and s, 10,
                          "the drift alarm")
        # (within the AFTER frames of the drifted domain: the replay holds no more)
        assert BEFORE < status["alarm_raised_at_frame"] <= BEFORE + AFTER
        assert status["thresholds"]["local"] < LOCAL, status  # tightened within the budget
        assert status["agreement_configured"] < 1 - BUDGET, status  # under the floor
        assert status["agreement"] >= status["agreement_configured"], status
        assert series.drift_alarm.get() == 1
        assert series.threshold_changes.value(direction="tighten") >= 1
        check = edge.service.health.readiness()  # named, and the edge still serves
        assert not any(r.startswith("drift:") for r in check.reasons)
        assert any(w.startswith("drift:") and "--agreement-budget" in w
                   for w in check.details["warnings"])
        assert agg.pipeline.policy.threshold("local") == status["thresholds"]["local"]
        # Every answer went out once: audits add cloud calls, never results.
        frames = sorted(r["frame"] for r in agg.results)
        assert frames == sorted(set(frames))

    # The experience the edge recorded: every frame the cloud answered, in the format
    # ddnn federate reads, labelled with the cloud's answers.
    wait_for(lambda: chunks(recorded), 10, "experience chunks")
    exp = read_experience(recorded)
    assert exp.num_samples == series.experience.value(outcome="recorded") > 0
    assert series.experience.value(outcome="dropped") == 0
    assert exp.features.shape[1:3] == (3, agg.manifest.devices[0].output("features")
                                       .sample_shape[0])
    assert np.allclose(exp.soft_label.sum(1), 1, atol=1e-3) and exp.present.any(1).all()
    # Each frame with its chance of being recorded (for the stream sample ddnn federate
    # calibrates on): an early exit audited at the audit rate (or above it, investigating), a
    # frame the exits sent up for sure.
    assert exp.chance is not None and np.isclose(exp.chance.min(), AUDIT)
    assert (exp.chance <= 1).all() and (exp.chance == 1).any()
    assert series.experience_bytes.get() == sum(p.stat().st_size for p in chunks(recorded))
