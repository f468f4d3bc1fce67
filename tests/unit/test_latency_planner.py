"""The latency objective's parts: moving windows of costs, the predicted percentile of an
operating point, and the planner's choice (ddnn.edge.latency, ddnn.edge.planner)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ddnn.edge.latency import MovingWindow, PathCosts, mixture_quantile
from ddnn.edge.planner import HOLD, HOLD_MAX, LatencyPlanner, curve_points
from ddnn.edge.settings import EdgeSettings, LatencyObjective
from ddnn.errors import ConfigError
from ddnn.exits import ExitPolicy
from ddnn.result import result_for
from tests.support.events import RecordedEvents

# level, T_local, T_edge, accuracy, local / edge / cloud shares
CURVE = [(0, 1.0, 0.0, 0.50, 1.0, 0.0, 0.0),  # the local exit alone
         (0, 0.6, 1.0, 0.60, 0.5, 0.5, 0.0),  # the edge answers what the local exit leaves
         (0, 0.6, 0.3, 0.70, 0.5, 0.2, 0.3),  # the cloud answers some
         (0, 0.4, 0.0, 0.45, 0.2, 0.0, 0.8)]  # less accurate than the local exit alone


def manifest(curve=CURVE, version="1"):
    keys = ("level", "local_threshold", "edge_threshold", "accuracy", "local_fraction",
            "edge_fraction", "cloud_fraction")
    table = {k: [row[i] for row in curve] for i, k in enumerate(keys)}
    table["bytes_per_frame"] = [10.0 * i for i in range(len(curve))]
    return SimpleNamespace(name="m", version=version, escalation_level=0, escalated=None,
                           calibration={"curve": table, "accuracy": 0.7})


class Pipeline:
    """What the planner reads of the pipeline new frames run on."""

    def __init__(self, m, local=0.6, edge=0.3):
        self.manifest, self.policy = m, ExitPolicy({"local": local, "edge": edge})


def costs_of(now, *, arrival=0.005, wait=0.001, pull=0.01, cloud=0.3, n=200):
    costs = PathCosts(horizon=2.0)
    for i in range(n):
        t = now - 1.0 + i / n
        costs.parts["arrival"].add(arrival, t)
        costs.parts["wait"].add(wait, t)
        costs.parts["pull"].add(pull, t)
        costs.cloud["cloud"].add(cloud, t)
    return costs


def planner(costs, pipeline, slo=100.0, **kw):
    deadlines = []
    p = LatencyPlanner(LatencyObjective(latency_slo_ms=slo), costs, lambda: pipeline,
                       deadlines=deadlines.append, pull_deadline=0.5, **kw)
    return p, deadlines


def test_moving_window_forgets_old_values_but_keeps_the_last_few():
    w = MovingWindow(1.0, keep=2)
    for t, v in enumerate([1.0, 2.0, 3.0, 4.0]):
        w.add(v, now=float(t))
    assert w.values(now=2.5).tolist() == [3.0, 4.0]
    assert w.quantile(1.0, now=2.5) == 4.0
    assert w.values(now=100.0).tolist() == [3.0, 4.0]  # nobody walks it: its last costs stay
    w.add(5.0, now=101.0)
    assert w.values(now=101.0).tolist() == [5.0]  # a newer one: the old ones go
    assert MovingWindow(1.0).quantile(0.5) is None
    with pytest.raises(ValueError):
        MovingWindow(0.0)


def test_a_small_slow_share_stays_out_of_the_percentile_a_larger_one_sets_it():
    paths = {"local": np.full(100, 0.01), "cloud": np.full(100, 0.3)}
    assert mixture_quantile(paths, {"local": 0.995, "cloud": 0.005}, 0.99) == 0.01
    assert mixture_quantile(paths, {"local": 0.98, "cloud": 0.02}, 0.99) == 0.3
    assert mixture_quantile(paths, {"local": 0.5, "cloud": 0.5}, 0.5) == 0.01


def test_path_costs_come_from_the_events_and_add_up_along_a_path():
    costs = PathCosts()
    for stage, seconds in (("arrival", 0.004), ("wait", 0.001), ("pull", 0.02), ("local", 9.0)):
        costs.on_stage(stage, seconds)
    paths = costs.paths()
    assert paths["cloud"] is None  # never called: unknown, not free
    assert costs.predict({"local": 1.0, "edge": 0.0, "cloud": 0.0}, 0.99, paths) == \
        pytest.approx(0.005)
    assert costs.predict({"local": 0.5, "edge": 0.2, "cloud": 0.3}, 0.99, paths) is None
    costs.on_cloud_call("ok", 0.3)
    costs.on_cloud_call("unknown_version")  # says nothing of the link
    costs.on_cloud_call("ok", 5.0, model="escalated")
    paths = costs.paths()
    assert costs.predict({"local": 0.5, "edge": 0.2, "cloud": 0.3}, 0.99, paths) == \
        pytest.approx(0.325)
    assert costs.paths("escalated")["cloud"].max() == pytest.approx(5.025)
    r = result_for(frame=1, scores=[1.0, 0.0], classes=["a", "b"], exit="local", entropy=0.1,
                   views=["cam0"], latency_ms=12.0)
    costs.on_answered(r, "local", 0.012)
    assert costs.measured.quantile(0.99) == pytest.approx(0.012)


def test_the_candidates_are_never_less_accurate_than_the_local_exit_alone():
    points = curve_points(manifest())
    assert [p.accuracy for p in points] == [0.5, 0.6, 0.7]
    with pytest.raises(ConfigError, match="no operating curve"):
        curve_points(SimpleNamespace(name="m", version="1", calibration={}))


def test_a_slow_cloud_moves_the_point_to_the_most_accurate_one_that_meets_the_objective():
    m, now = manifest(), 100.0
    pipeline, events = Pipeline(m), RecordedEvents()
    p, deadlines = planner(costs_of(now), pipeline, events=events)
    assert p.point.accuracy == 0.7  # the configured point, as calibrated
    plan = p.tick(now)
    assert plan.met and plan.point.accuracy == 0.6  # the edge answers the rest
    assert plan.predicted <= 0.1 and p.replans == 1
    assert pipeline.policy.thresholds == {"local": 0.6, "edge": 1.0}
    assert events.of("on_thresholds")[-1] == ({"local": 0.6, "edge": 1.0},)
    # the pull deadline is what the objective leaves after the local path (and the edge exit)
    assert deadlines[-1] == pytest.approx(0.1 * 0.9 - 0.006)
    assert events.of("on_latency_plan")[-1][1:] == (0.1, plan.predicted, None, True)


def test_the_cloud_recovers_and_the_point_goes_back_after_the_hold():
    m, now = manifest(), 100.0
    costs = costs_of(now)
    p, _ = planner(costs, Pipeline(m))
    p.tick(now)
    later = now + 3.0  # the slow calls are out of the window: the cloud answers in 20 ms
    for i in range(100):
        costs.cloud["cloud"].add(0.02, later - 0.5 + i / 200)
        for part in ("arrival", "wait", "pull"):
            costs.parts[part].add({"arrival": 0.005, "wait": 0.001, "pull": 0.01}[part],
                                  later - 0.5 + i / 200)
    assert p.tick(now + 0.5).point.accuracy == 0.6  # (the slow calls are still in the window)
    p.since = later - HOLD / 2  # as if the point in force had been taken a moment ago
    assert p.tick(later).point.accuracy == 0.6  # held HOLD seconds first
    plan = p.tick(later + HOLD / 2)
    assert plan.point.accuracy == 0.7 and plan.met and p.replans == 2


def calls(costs, t, cloud, n=100):
    """Half a second of frames before ``t`` whose cloud calls took ``cloud`` seconds."""
    for i in range(n):
        at = t - 0.5 + i / (2 * n)
        costs.cloud["cloud"].add(cloud, at)
        for part, cost in (("arrival", 0.005), ("wait", 0.001), ("pull", 0.01)):
            costs.parts[part].add(cost, at)


def test_a_point_that_misses_after_a_climb_is_barred_for_a_back_off_that_doubles():
    m, now = manifest(), 100.0
    costs = costs_of(now)
    p, _ = planner(costs, Pipeline(m))
    assert p.tick(now).point.accuracy == 0.6 and p.backoff == HOLD  # (from the start: no climb)

    def at(t, cloud):
        calls(costs, t, cloud)
        return p.tick(t).point.accuracy

    assert at(now + 3, 0.02) == 0.7  # lone calls look fast ...
    missed = now + 4
    assert at(missed, 0.3) == 0.6  # ... but the frames it sends up queue in front of the cloud
    assert p.backoff == 2 * HOLD  # (this miss barred it HOLD seconds)
    assert at(missed + 3, 0.02) == 0.7  # the bar is over
    missed += 4
    assert at(missed, 0.3) == 0.6 and p.backoff == 4 * HOLD
    assert at(missed + 3, 0.02) == 0.6  # held 3 s, but barred 2 * HOLD
    assert p.tick(missed + 2 * HOLD).point.accuracy == 0.7
    held = missed + 2 * HOLD + HOLD_MAX
    assert at(held, 0.02) == 0.7 and p.backoff == HOLD  # it held: the back-off is reset
    assert p.status()["backoff_s"] == HOLD and p.replans == 6


def test_an_objective_nothing_meets_takes_the_fastest_point_and_says_so():
    m, now = manifest(), 100.0
    p, _ = planner(costs_of(now, arrival=0.2), Pipeline(m))
    plan = p.tick(now)
    assert not plan.met and plan.point.accuracy == 0.5  # the local exit alone is fastest
    assert "cannot be met" in p.reason()
    assert p.status()["met"] is False and p.status()["point"]["accuracy"] == 0.5


def test_unknown_costs_keep_the_configured_point():
    p, _ = planner(PathCosts(), Pipeline(manifest()))
    plan = p.tick(100.0)
    assert plan.point.accuracy == 0.7 and plan.predicted is None and p.replans == 0
    assert p.reason() is None


def test_the_objective_overrules_the_drift_monitor_and_says_so():
    m, now = manifest(), 100.0
    pipeline = Pipeline(m)
    drift = {"adapt": True, "thresholds": {"local": 0.2, "edge": 0.1}}
    p, _ = planner(costs_of(now), pipeline, drift=lambda: drift)
    p.tick(now)
    pipeline.policy = pipeline.policy.with_overrides(local=0.2, edge=0.1)  # the drift monitor
    p.tick(now + 0.5)
    assert pipeline.policy.thresholds == {"local": 0.6, "edge": 1.0}
    assert "accuracy budget" in p.drift_reason()
    drift["thresholds"] = {"local": 0.6, "edge": 1.0}
    p.tick(now + 1.0)
    assert p.drift_reason() is None


def test_probes_go_up_while_the_point_keeps_frames_from_the_cloud():
    m, now = manifest(), 100.0
    p, _ = planner(costs_of(now), Pipeline(m), seed=1)
    frame = SimpleNamespace(id=7)
    assert not p.probe(frame)  # the configured point sends 30 % up: no probe needed
    p.tick(now)  # the edge now answers everything the local exit leaves
    assert p.probe(frame)  # (the first is due at once)
    assert p.probed(frame) > 0 and p.probed(frame) == 0.0
    drawn = sum(p.probe(SimpleNamespace(id=i)) for i in range(2000))
    assert 0 < drawn < 400  # a small share


def test_a_bundle_update_plans_afresh_on_its_curve():
    m, now = manifest(), 100.0
    pipeline = Pipeline(m)
    p, _ = planner(costs_of(now), pipeline)
    p.tick(now)
    pipeline.manifest = manifest(CURVE[:1], version="2")
    pipeline.policy = ExitPolicy({"local": 1.0, "edge": 0.0})
    assert p.tick(now + 0.5).point.accuracy == 0.5 and p.version == "2"


def test_the_objective_settings_are_checked():
    s = EdgeSettings(bundle="b", broker="mqtt://h:1", latency_slo=100, latency_percentile=95)
    assert s.latency.slo == 0.1 and s.latency.quantile == 0.95
    assert EdgeSettings(bundle="b", broker="mqtt://h:1").latency.slo is None
    for bad in ({"latency_slo": 0}, {"latency_slo": -5}, {"latency_percentile": 100},
                {"latency_percentile": 10}):
        with pytest.raises(ConfigError):
            EdgeSettings(bundle="b", broker="mqtt://h:1", **bad)
