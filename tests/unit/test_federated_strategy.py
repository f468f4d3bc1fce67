"""The aggregation strategies as pure policy: plain arrays in, decisions out, no network."""

from __future__ import annotations

import numpy as np
import pytest

from ddnn.models.federated.strategy import (
    DynamicAveraging,
    FedAvg,
    Reply,
    UpdateGuard,
    distance2,
    make_strategy,
    weighted_average,
)


def model(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"conv.weight": np.full((2, 3), value, dtype=np.float32),
            "fc.bias": np.full((4,), value, dtype=np.float32)}


def moved(base: dict, delta: float) -> dict:
    return {k: (v + delta).astype(v.dtype) for k, v in base.items()}


def test_fedavg_weights_replies_by_their_examples():
    s = FedAvg(model(1.0))
    plan = s.configure(1, [7, 8])
    assert set(plan) == {7, 8} and all(i.weights is s.model for i in plan.values())
    out = s.aggregate(1, [Reply(7, model(1.2), 20), Reply(8, model(1.6), 10)])
    assert out.accepted == (7, 8) and not out.refused and not out.capped
    np.testing.assert_allclose(s.model["conv.weight"], 4 / 3, rtol=1e-6)  # (1.2*20+1.6*10)/30
    assert s.model["conv.weight"].dtype == np.float32


@pytest.mark.parametrize("bad, reason", [
    ({"conv.weight": np.full((2, 3), np.nan, np.float32),
      "fc.bias": np.ones(4, np.float32)}, "NaN"),
    ({"conv.weight": np.full((2, 3), np.inf, np.float32),
      "fc.bias": np.ones(4, np.float32)}, "NaN or infinite"),
    ({"conv.weight": np.ones((3, 2), np.float32), "fc.bias": np.ones(4, np.float32)},
     "expected float32[2, 3]"),
    ({"conv.weight": np.ones((2, 3), np.float32)}, "missing ['fc.bias']"),
    ({**model(), "extra": np.ones(1, np.float32)}, "unexpected ['extra']"),
    (model(50.0), "exceeds"),  # moves the model far more than its own norm
])
def test_bad_updates_are_refused_with_a_reason_and_the_rest_averaged(bad, reason, caplog):
    s = FedAvg(model(1.0))
    out = s.aggregate(1, [Reply(1, model(1.2), 10), Reply(2, bad, 10)])
    assert out.accepted == (1,)
    assert reason in out.refused[2]
    assert "refused the update of site 2" in caplog.text
    np.testing.assert_allclose(s.model["fc.bias"], 1.2, rtol=1e-6)


def test_honest_steps_a_little_over_the_models_norm_are_averaged():
    """After a drift, six local epochs moved the benchmark's model by up to 1.10 x its own
    norm in the first round: a guard of 1 x refused such an honest site."""
    s = FedAvg(model(1.0))
    replies = [Reply(i, model(-0.1 - 0.05 * i), 10) for i in range(3)]  # 1.1-1.2 x the norm
    out = s.aggregate(1, replies)
    assert out.accepted == (0, 1, 2) and not out.refused
    np.testing.assert_allclose(s.model["fc.bias"], -0.15, rtol=1e-6)


def test_an_outlying_norm_is_refused_against_the_rounds_median():
    s = FedAvg(model(1.0), guard=UpdateGuard(max_relative_update=100.0, max_norm_ratio=5.0))
    replies = [Reply(i, moved(model(1.0), 0.01 * (i + 1)), 10) for i in range(3)]
    replies.append(Reply(9, moved(model(1.0), 0.5), 10))  # 25x the median step
    out = s.aggregate(1, replies)
    assert set(out.accepted) == {0, 1, 2} and "outlier" in out.refused[9]


def test_a_lying_example_count_is_refused():
    out = FedAvg(model()).aggregate(1, [Reply(1, model(1.1), 0), Reply(2, model(1.1), 5)])
    assert out.accepted == (2,) and "example count" in out.refused[1]


def test_too_few_good_replies_leave_the_model_unchanged():
    s = FedAvg(model(1.0), min_sites=2)
    out = s.aggregate(1, [Reply(1, model(1.5), 10)])  # the other site dropped out
    assert out.accepted == () and out.synchronized == "none"
    np.testing.assert_array_equal(s.model["fc.bias"], 1.0)


def test_dma_sends_the_reference_once_then_only_what_changed():
    s = DynamicAveraging(model(1.0), threshold=0.01)
    first = s.configure(1, [1, 2, 3])
    assert all(i.weights is not None and i.reference for i in first.values())
    quiet = s.aggregate(1, [Reply(n, None, 10) for n in (1, 2, 3)])
    assert quiet.synchronized == "none" and quiet.requests == ()
    assert all(i.weights is None for i in s.configure(2, [1, 2, 3]).values())


def test_dma_full_sync_asks_the_quiet_sites_and_resyncs_everyone():
    s = DynamicAveraging(model(1.0), threshold=0.001)
    s.configure(1, [1, 2, 3])
    out = s.aggregate(1, [Reply(1, model(1.5), 10), Reply(2, None, 10), Reply(3, None, 10)])
    assert out.synchronized == "full" and set(out.requests) == {2, 3}
    done = s.complete(1, [Reply(2, model(1.0), 10), Reply(3, model(1.0), 20)])
    assert set(done.accepted) == {1, 2, 3}
    np.testing.assert_allclose(s.model["fc.bias"], (1.5 * 10 + 10 + 20) / 40)
    plan = s.configure(2, [1, 2, 3])
    assert all(i.reference and i.weights is s.model for i in plan.values())


def test_dma_balances_violators_whose_average_stays_within_the_threshold():
    s = DynamicAveraging(model(1.0), threshold=0.01)
    s.configure(1, [1, 2, 3])
    up, down = moved(model(1.0), 0.2), moved(model(1.0), -0.2)  # each past it, mean at r
    out = s.aggregate(1, [Reply(1, up, 10), Reply(2, down, 10), Reply(3, None, 10)])
    assert out.synchronized == "balanced" and out.requests == ()
    plan = s.configure(2, [1, 2, 3])
    np.testing.assert_allclose(plan[1].weights["fc.bias"], 1.0, atol=1e-6)
    assert not plan[1].reference and plan[3].weights is None
    np.testing.assert_array_equal(s.model["fc.bias"], 1.0)  # the reference is unchanged


def test_dma_resends_the_reference_to_a_site_that_did_not_answer():
    s = DynamicAveraging(model(1.0), threshold=0.01)
    s.configure(1, [1, 2])
    s.aggregate(1, [Reply(1, None, 10)])  # site 2 dropped out this round
    plan = s.configure(2, [1, 2])
    assert plan[1].weights is None and plan[2].reference


def test_dma_divergence_is_relative_squared_distance():
    s = DynamicAveraging(model(2.0))
    assert s.divergence(model(3.0)) == pytest.approx(0.25)
    assert distance2(model(1.0), model(3.0)) == pytest.approx(40.0)


def test_weighted_average_and_make_strategy():
    avg = weighted_average([model(0.0), model(4.0)], [3, 1])
    np.testing.assert_allclose(avg["fc.bias"], 1.0)
    assert make_strategy("fedavg", model(), threshold=1.0).name == "fedavg"
    assert make_strategy("dma", model(), threshold=0.5).threshold == 0.5
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("fedprox", model())


def test_server_momentum_keeps_a_share_of_the_last_step():
    """FedAvgM: the first step is the plain average's; the next adds beta times the last one
    (Flower's FedAvgM with a server learning rate of 1); a round without good replies leaves
    the model and the velocity as they were."""
    s = make_strategy("fedavg", model(1.0), momentum=0.5)
    s.aggregate(1, [Reply(7, model(1.2), 10), Reply(8, model(1.4), 10)])
    np.testing.assert_allclose(s.model["fc.bias"], 1.3, rtol=1e-6)  # step 0.3
    s.aggregate(2, [Reply(7, model(1.4), 10), Reply(8, model(1.4), 10)])
    np.testing.assert_allclose(s.model["fc.bias"], 1.3 + 0.1 + 0.5 * 0.3, rtol=1e-6)
    before = {k: v.copy() for k, v in s.model.items()}
    s.aggregate(3, [Reply(7, moved(s.model, np.nan), 10)])  # refused: no step at all
    np.testing.assert_array_equal(s.model["fc.bias"], before["fc.bias"])
    assert s.model["fc.bias"].dtype == np.float32
    plain = make_strategy("fedavg", model(1.0))
    plain.aggregate(1, [Reply(7, model(1.2), 10), Reply(8, model(1.4), 10)])
    plain.aggregate(2, [Reply(7, model(1.4), 10), Reply(8, model(1.4), 10)])
    np.testing.assert_allclose(plain.model["fc.bias"], 1.4, rtol=1e-6)  # no memory
    with pytest.raises(ValueError, match="momentum"):
        FedAvg(model(), momentum=1.0)
    with pytest.raises(ValueError, match="FedAvg's"):
        make_strategy("dma", model(), momentum=0.5)
