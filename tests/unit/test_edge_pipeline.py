"""The edge's exit pipeline on its own: frames in, decisions out; no broker, no threads."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ddnn.aggregation import aggregate
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.edge.pipeline import GUARD, Exit, ExitPipeline, Pull, ToCloud, local_avg, local_max
from ddnn.exits import ExitPolicy, entropy_of_logits
from ddnn.runtime import BundleRuntime, transmit
from ddnn.stacking import Stacking, stack


@pytest.fixture(scope="module")
def runtime(tiny_bundle) -> BundleRuntime:
    return BundleRuntime(load_bundle(tiny_bundle), threads=1)


@pytest.fixture(scope="module")
def wire(runtime, tiny_data):
    """Per sample and view, the device's scores (C,) and features (1, ...) as the edge receives
    them, and every exit ``ddnn evaluate`` computes for the same samples."""
    ds = load_dataset(tiny_data.test)
    X, present = ds.X[:24], ds.present[:24]
    scores, features = {}, {}
    for v in range(X.shape[1]):
        s, f = runtime.device(v, X[:, v])
        s, f = transmit(s, runtime.scores_codec), transmit(f, runtime.device_codec)
        for i in np.flatnonzero(present[:, v]):
            scores[i, v], features[i, v] = s[i], f[i : i + 1]
    return scores, features, present, runtime.all_exits(X, present)


def frame(wire, i):
    """Sample ``i``'s present views: their scores and their features."""
    scores, features, present, _ = wire
    views = np.flatnonzero(present[i])
    return {v: scores[i, v] for v in views}, {v: features[i, v] for v in views}


class Computed(EdgeEvents):
    """The steps whose compute time the pipeline reported."""

    def __init__(self, steps: list[str]):
        self.steps = steps

    def on_computed(self, step: str, seconds: float) -> None:
        self.steps.append(step)


def pipeline(runtime, local: float, edge: float, events=NO_EVENTS) -> ExitPipeline:
    return ExitPipeline(runtime, ExitPolicy({"local": local, "edge": edge}),
                        events=events)


def test_a_confident_frame_exits_at_the_local_exit(runtime, wire):
    timings = []
    p = pipeline(runtime, 1.0, 0.0, events=Computed(timings))
    for i in range(24):
        scores, _ = frame(wire, i)
        decision = p.local(scores)
        assert isinstance(decision, Exit) and decision.tier == "local"
        expected = wire[3]["local"][i]
        np.testing.assert_allclose(decision.scores, expected, rtol=1e-6)
        assert decision.entropy == pytest.approx(float(entropy_of_logits(expected[None])[0]))
        assert decision.views == tuple(sorted(scores))
    assert timings == ["local"] * 24  # reported through the hook, once per run


def test_an_unconfident_frame_pulls_the_present_views_that_do_not_push(runtime, wire):
    p = pipeline(runtime, 0.0, 0.0)  # threshold 0: nothing is confident enough
    _, _, present, _ = wire
    i = next(i for i in range(24) if present[i].sum() >= 2 and not present[i].all())
    scores, _ = frame(wire, i)
    views = tuple(sorted(scores))
    decision = p.local(scores)
    assert isinstance(decision, Pull)
    assert decision.views == views and decision.ask == views  # never an absent view
    pushing, arrived = {views[0]}, {views[-1]}
    decision = p.local(scores, pushing=pushing, arrived=arrived)
    assert decision.views == views
    assert decision.ask == tuple(v for v in views if v not in pushing | arrived)


def test_thresholds_decide_where_a_frame_exits(runtime, wire):
    scores, features = frame(wire, 0)
    local = pipeline(runtime, 1.0, 1.0).local(scores)
    eta = local.entropy
    assert isinstance(pipeline(runtime, np.nextafter(eta, 1), 0.0).local(scores), Exit)
    assert isinstance(pipeline(runtime, eta, 0.0).local(scores), Pull)  # exits where η < T
    below = local.scores  # (the stacked edge's answer stands on the local one)
    edge_eta = pipeline(runtime, 0.0, 1.0).edge(features, below=below).entropy
    assert isinstance(pipeline(runtime, 0.0, np.nextafter(edge_eta, 1)).edge(features,
                                                                             below=below), Exit)
    assert isinstance(pipeline(runtime, 0.0, edge_eta).edge(features, below=below), ToCloud)


def test_a_confident_frame_exits_at_the_edge_with_its_features(runtime, wire):
    p = pipeline(runtime, 0.0, 1.0)
    for i in range(24):
        scores, features = frame(wire, i)
        local = p.local(scores)
        assert isinstance(local, Pull)
        decision = p.edge(features, below=local.answer.scores)
        assert isinstance(decision, Exit) and decision.tier == "edge"
        np.testing.assert_allclose(decision.scores, wire[3]["edge"][i], rtol=1e-5, atol=1e-6)
        assert decision.views == tuple(sorted(features))


def test_a_frame_for_the_cloud_carries_its_edge_features_as_transmitted(runtime, wire):
    p = pipeline(runtime, 0.0, 0.0)
    sent = []
    for i in range(24):
        scores, features = frame(wire, i)
        decision = p.edge(features, below=p.local(scores).answer.scores)
        assert isinstance(decision, ToCloud)
        assert decision.version == runtime.manifest.version
        assert decision.fallback.tier == "edge"  # the answer when the cloud cannot give one
        np.testing.assert_allclose(decision.fallback.scores, wire[3]["edge"][i], rtol=1e-5,
                                   atol=1e-6)
        sent.append(decision)
    # What the cloud receives is the edge codec's output: the offline cloud exit follows,
    # stacked on the edge's answer where the bundle stacks its exits.
    cloud = runtime.cloud(np.concatenate([d.features for d in sent]))
    answers = ExitPipeline.cloud(cloud, sent)
    np.testing.assert_allclose([a.scores for a in answers], wire[3]["cloud"][:24], rtol=1e-5,
                               atol=1e-5)
    assert [a.tier for a in answers] == ["cloud"] * 24
    assert [a.views for a in answers] == [d.fallback.views for d in sent]


def test_a_frame_with_missing_features_fuses_only_those_that_arrived(runtime, wire):
    _, _, present, _ = wire
    i = next(i for i in range(24) if present[i].sum() >= 2)
    scores, features = frame(wire, i)
    arrived = dict(list(features.items())[:-1])  # the last view's features never came
    p = pipeline(runtime, 0.0, 1.0)
    below = p.local(scores).answer.scores
    decision = p.edge(arrived, below=below)
    assert decision.views == tuple(sorted(arrived))
    mask = np.zeros((1, runtime.manifest.views), bool)
    x = np.zeros((1, runtime.manifest.views, *features[min(features)].shape[1:]), np.float32)
    for v, f in arrived.items():
        mask[0, v], x[0, v] = True, f[0]
    expected, _ = runtime.edge(x, mask)
    stacking = runtime.manifest.stacking or Stacking()
    np.testing.assert_allclose(decision.scores, stack(below[None], expected, stacking.edge)[0],
                               rtol=1e-6)


def test_an_unconfident_frame_keeps_its_local_answer_and_never_fuses_nothing(runtime, wire):
    p = pipeline(runtime, 0.0, 0.0)
    scores, _ = frame(wire, 0)
    decision = p.local(scores)
    assert isinstance(decision, Pull)
    # The local exit's own answer travels with the pull: the fallback when no features come.
    assert decision.answer.tier == "local" and decision.answer.views == tuple(sorted(scores))
    np.testing.assert_allclose(decision.answer.scores, wire[3]["local"][0], rtol=1e-6)
    with pytest.raises(ValueError, match="at least one view"):
        p.edge({})  # zeros are never classified


def test_the_local_exit_of_a_batch_is_the_local_exit_of_each_frame(runtime, wire):
    """Several frames in one call (a busy edge): bit for bit what they get one at a time."""
    _, _, present, _ = wire
    eta = pipeline(runtime, 1.0, 0.0).local(frame(wire, 0)[0]).entropy
    p = pipeline(runtime, eta, 0.0)  # some frames exit, some pull
    frames = [frame(wire, i)[0] for i in range(24) if present[i].any()]
    arrived = [set(list(s)[:1]) for s in frames]
    timings = []
    batched = pipeline(runtime, eta, 0.0, events=Computed(timings)).local_many(
        frames, arrived=arrived, pushing={1})
    assert timings == ["local"]  # one run for the batch
    for scores, here, b in zip(frames, arrived, batched, strict=True):
        one = p.local(scores, arrived=here, pushing={1})
        assert type(one) is type(b)
        a, c = (one, b) if isinstance(one, Exit) else (one.answer, b.answer)
        assert a.scores.tobytes() == c.scores.tobytes()
        assert a.entropy == pytest.approx(c.entropy, rel=0, abs=1e-12)  # (plain floats: ulps)
        assert a.views == c.views
        if isinstance(one, Pull):
            assert one.ask == b.ask and one.views == b.views
    assert {type(b) for b in batched} == {Exit, Pull}


def test_one_frame_in_plain_floats_decides_as_numpy_does():
    """The single-frame local exit (max over the views, no local segment) in plain floats:
    the same scores bit for bit, the entropy to a few ulps, and near the threshold no answer
    (numpy decides there)."""
    rng = np.random.default_rng(7)
    for _ in range(2000):
        views, classes = rng.integers(1, 7), rng.integers(2, 12)
        x = (rng.normal(size=(1, views, classes)) * rng.choice([0.1, 3, 30])).astype(np.float16)
        x = x.astype(np.float32)
        expected = aggregate(x, np.ones((1, views), bool), "max")
        eta = float(entropy_of_logits(expected)[0])
        agg, got = local_max(x[0].tolist(), threshold=2.0)
        assert np.array_equal(np.array(agg, np.float32), expected[0])
        assert got == pytest.approx(eta, rel=0, abs=1e-12)
        assert local_max(x[0].tolist(), threshold=got) is None
        assert local_max(x[0].tolist(), threshold=got + 2 * GUARD) is not None


def test_one_frame_averaged_in_plain_floats_is_numpy_bit_for_bit():
    """Under avg aggregation too: the views present (some absent, zeros and negative zeros
    among the scores) averaged in plain floats give numpy's float32 scores bit for bit."""
    rng = np.random.default_rng(8)
    for _ in range(2000):
        views, classes = rng.integers(1, 7), rng.integers(2, 12)
        # scales apart within a frame: float32 sums that round
        scale = rng.choice([1e-3, 0.1, 3, 3e3], size=(1, views, classes))
        x = (rng.normal(size=(1, views, classes)) * scale).astype(np.float16).astype(np.float32)
        x[rng.random(x.shape) < 0.1] = rng.choice([0.0, -0.0])
        present = rng.random((1, views)) < 0.7
        present[0, rng.integers(views)] = True
        expected = aggregate(x, present, "avg")
        eta = float(entropy_of_logits(expected)[0])
        agg, got = local_avg(x[0][present[0]].tolist(), threshold=2.0)
        assert np.array(agg, np.float32).tobytes() == expected[0].tobytes()
        assert got == pytest.approx(eta, rel=0, abs=1e-12)
        assert local_avg(x[0][present[0]].tolist(), threshold=got) is None


def test_an_averaging_bundle_answers_one_frame_as_its_batch_does(tiny_bundle, wire):
    """A bundle whose local exit averages: one frame in plain floats (its views come in any
    order) gives the batch's numpy scores bit for bit, the same views and entropy."""
    b = load_bundle(tiny_bundle)
    b = replace(b, manifest=replace(b.manifest, aggregation={**b.manifest.aggregation,
                                                             "local": "avg"}))
    p = pipeline(BundleRuntime(b, threads=1), 1.0, 0.0)
    assert p.plain_local
    frames = [dict(reversed(frame(wire, i)[0].items())) for i in range(24)]
    frames = [f for f in frames if f]
    for scores, batched in zip(frames, p.local_many(frames), strict=True):
        one = p.local(scores)
        assert one.scores.tobytes() == batched.scores.tobytes()
        assert one.entropy == pytest.approx(batched.entropy, rel=0, abs=1e-12)
        assert one.views == batched.views
