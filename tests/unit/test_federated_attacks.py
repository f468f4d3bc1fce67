"""A hostile site against the strategies, on a model where the attack means something: a
softmax classifier of four classes, trained by each site with numpy from the shared weights.
The hostile site swaps two classes in its labels and keeps its step within what the update
guard lets through (a few times an honest step); it either claims an absurd number of
examples or really holds four times the others' data. Fixed seeds throughout."""

from __future__ import annotations

import numpy as np
import pytest

from ddnn.models.federated.strategy import (
    Combiner,
    DynamicAveraging,
    FedAvg,
    Reply,
    capped_counts,
    coordinate_median,
    count_problem,
    metrics_problem,
    trimmed_mean,
)

CLASSES, FEATURES = 4, 8
CENTRES = np.random.default_rng(0).normal(0, 1.5, (CLASSES, FEATURES))
SWAPPED = (0, 1)  # the classes the hostile site swaps


def samples(n: int, seed: int, swap: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    x = (CENTRES[y] + rng.normal(0, 1.0, (n, FEATURES))).astype(np.float32)
    if swap:
        a, b = SWAPPED
        y = np.where(y == a, b, np.where(y == b, a, y))
    return x, y


def train(weights: dict, x: np.ndarray, y: np.ndarray, steps: int = 20, lr: float = 0.5) -> dict:
    """Full-batch gradient descent on the cross-entropy, from ``weights``."""
    w, b = weights["fc.weight"].astype(np.float64), weights["fc.bias"].astype(np.float64)
    target = np.eye(CLASSES)[y]
    for _ in range(steps):
        z = x @ w.T + b
        p = np.exp(z - z.max(1, keepdims=True))
        g = (p / p.sum(1, keepdims=True) - target) / len(y)
        w, b = w - lr * g.T @ x, b - lr * g.sum(0)
    return {"fc.weight": w.astype(np.float32), "fc.bias": b.astype(np.float32)}


def step_norm(a: dict, b: dict) -> float:
    return float(np.sqrt(sum(np.square(a[k] - b[k]).sum() for k in a)))


TEST = samples(2000, 99)
START = train({"fc.weight": np.zeros((CLASSES, FEATURES), np.float32),
               "fc.bias": np.zeros(CLASSES, np.float32)}, *samples(100, 5), steps=50)


def class_accuracy(weights: dict) -> list[float]:
    """Per class, the share of its test samples the model calls by that class."""
    x, y = TEST
    predicted = (x @ weights["fc.weight"].T + weights["fc.bias"]).argmax(1)
    return [float((predicted[y == c] == c).mean()) for c in range(CLASSES)]


def federate(strategy, rounds: int = 10, hostile: bool = True, claim: int | None = None,
             data: int = 1, stealth: float = 3.0) -> list:
    """Three honest sites of 200 samples and a fourth holding ``data`` times that with two
    classes swapped (``hostile``: claiming ``claim`` examples, its step scaled to at most
    ``stealth`` times the one its data would honestly take); returns each round's outcome."""
    sites = {n: samples(200, 10 + n) for n in range(3)}
    sites[3] = samples(200 * data, 20, swap=hostile)
    outcomes = []
    for rnd in range(1, rounds + 1):
        plan = strategy.configure(rnd, list(sites))
        replies = []
        for node, (x, y) in sites.items():
            start = plan[node].weights
            weights, examples = train(start, x, y), len(y)
            if node == 3 and hostile:
                honest = train(start, *samples(200 * data, 20))
                scale = stealth * step_norm(honest, start) / step_norm(weights, start)
                if scale < 1:  # under the guard's outlier test
                    weights = {k: start[k] + (v - start[k]) * scale for k, v in weights.items()}
                examples = claim if claim is not None else examples
            replies.append(Reply(node, weights, examples))
        outcomes.append(strategy.aggregate(rnd, replies))
    return outcomes


def honest_federation() -> list[float]:
    strategy = FedAvg(START)
    federate(strategy, hostile=False)
    return class_accuracy(strategy.model)


def test_the_start_and_the_honest_federation_know_every_class():
    assert min(class_accuracy(START)) > 0.9 and min(honest_federation()) > 0.9


def test_an_absurd_example_count_is_refused_and_leaves_the_classes_right():
    """The issue's attack: 2**62 examples, a step that passes the norm screens."""
    strategy = FedAvg(START)
    outcomes = federate(strategy, claim=2**62)
    assert all("out of range" in o.refused[3] and o.accepted == (0, 1, 2) for o in outcomes)
    a, b = SWAPPED
    honest = honest_federation()
    assert class_accuracy(strategy.model)[a] == pytest.approx(honest[a], abs=0.02)
    assert class_accuracy(strategy.model)[b] == pytest.approx(honest[b], abs=0.02)


def test_an_inflated_example_count_is_capped_and_cannot_swap_two_classes():
    """A claim within range (a billion examples) passes every screen: uncapped it swaps the
    two classes; capped at twice the round's median claim, each class stays itself."""
    uncapped = FedAvg(START, combiner=Combiner(weight_ratio=float("inf")))
    outcomes = federate(uncapped, claim=10**9)
    assert all(3 in o.accepted for o in outcomes)  # no screen stopped it
    assert max(class_accuracy(uncapped.model)[c] for c in SWAPPED) < 0.1  # swapped

    capped = FedAvg(START)
    outcomes = federate(capped, claim=10**9)
    assert all(3 in o.accepted and o.capped == {3: 400} for o in outcomes)
    assert min(class_accuracy(capped.model)[c] for c in SWAPPED) > 0.8


@pytest.mark.parametrize("rule", ["mean", "trimmed-mean", "median"])
def test_a_site_with_four_times_the_data_and_two_classes_swapped_moves_neither(rule):
    """Weighted by its true count (4/7 of the examples) the site swaps the classes; capped
    (the default, ``mean``) it weighs two sites' worth and each class stays itself; the
    coordinate-wise rules count it once and leave the honest sites' model."""
    uncapped = FedAvg(START, combiner=Combiner(weight_ratio=float("inf")))
    federate(uncapped, data=4)
    assert max(class_accuracy(uncapped.model)[c] for c in SWAPPED) < 0.1

    strategy = FedAvg(START, combiner=Combiner(rule))
    outcomes = federate(strategy, data=4)
    assert all(3 in o.accepted for o in outcomes)  # its step passes the guard every round
    accuracy, honest = class_accuracy(strategy.model), honest_federation()
    assert min(accuracy[c] for c in SWAPPED) > 0.8
    if rule != "mean":  # as if the site were not there
        assert accuracy == pytest.approx(honest, abs=0.02)


def test_dma_combines_its_full_synchronization_by_the_rule():
    one = {"fc.bias": np.ones(4, np.float32)}
    far = {"fc.bias": np.full(4, 1.4, np.float32)}  # 4x the others' step: not an outlier
    for rule, expected in (("mean", (10 * 1.1 + 10 * 1.1 + 20 * 1.4) / 40), ("median", 1.1)):
        s = DynamicAveraging(one, threshold=1e-6, combiner=Combiner(rule))
        s.configure(1, [1, 2, 3])
        near = {"fc.bias": np.full(4, 1.1, np.float32)}
        out = s.aggregate(1, [Reply(1, near, 10), Reply(2, near, 10), Reply(3, far, 1000)])
        assert out.synchronized == "full" and out.capped == {3: 20}
        np.testing.assert_allclose(s.model["fc.bias"], expected, rtol=1e-6)


def test_capped_counts_hold_each_claim_to_twice_the_lower_median():
    assert capped_counts([100, 120, 2**40, 90]) == [100, 120, 200, 90]
    assert capped_counts([100, 10**9]) == [100, 200]  # one of two cannot raise its own bar
    assert capped_counts([50]) == [50] and capped_counts([]) == []


def test_robust_rules_are_coordinate_wise():
    models = [{"w": np.array([v, -v], np.float32)} for v in (1.0, 2.0, 3.0, 100.0)]
    np.testing.assert_allclose(coordinate_median(models)["w"], [2.5, -2.5])
    np.testing.assert_allclose(trimmed_mean(models)["w"], [2.5, -2.5])  # one cut at each end
    np.testing.assert_allclose(trimmed_mean(models[:2])["w"], [1.5, -1.5])  # two: the mean
    assert trimmed_mean(models)["w"].dtype == np.float32
    with pytest.raises(ValueError, match="unknown aggregate"):
        Combiner("krum")


@pytest.mark.parametrize("count, problem", [
    (10, None), (10.0, None), (2**40, None), (0, "out of range"), (-3.0, "out of range"),
    (2**62, "out of range"), (2**80, "out of range"), (np.int64(7), None),
    (np.float32(2.5), "whole number"), (2.5, "whole number"), (float("nan"), "whole number"),
    (float("inf"), "whole number"), ([10.0], "not a number"), ("10", "not a number"),
    (True, "not a number"), (None, "not a number")])
def test_an_example_count_must_be_a_whole_number_in_range(count, problem):
    found = count_problem(count)
    assert found is None if problem is None else problem in found


def test_metrics_must_be_finite_numbers():
    assert metrics_problem({"examples": 10.0, "steps": 3}) is None
    assert "list" in metrics_problem({"loss": [1.0]})
    assert "nan" in metrics_problem({"loss": float("nan")})
    assert "str" in metrics_problem({"loss": "low"})
    assert metrics_problem({"steps": 2**80, "loss": np.float32(0.5)}) is None  # whole, finite
