"""SCAFFOLD's option II: control variates derived from the models, none on the wire."""

import numpy as np
import pytest

from ddnn.bundle import load_bundle
from ddnn.models.federated import scaffold
from ddnn.models.federated.trainer import LocalTraining, fit, load_site
from ddnn.models.federated.weights import (
    architecture,
    build_model,
    model_from_bundle,
    model_weights,
)

NAMES = ("a", "b")


def _model(rng, scale=1.0):
    return {"a": rng.normal(size=(3, 4)).astype(np.float32) * scale,
            "b": rng.normal(size=5).astype(np.float32) * scale}


def test_the_shared_direction_is_the_mean_of_the_sites_directions_as_option_ii_sets_it():
    """With every site answering, the shared model's step per unit of span is the weighted
    mean of the sites' own variates (Karimireddy et al., option II): no variate need travel."""
    rng = np.random.default_rng(0)
    x = _model(rng)
    sites = 3
    w = np.array([300.0, 120.0, 500.0])  # examples: the weights of the average
    steps = np.array([30.0, 12.0, 50.0])  # more data, more steps; within 4x of the median
    lr = 0.002
    own_old = [_model(rng, 0.1) for _ in range(sites)]
    # The federation's variate as option II keeps it: the span-weighted mean of the sites'.
    v = w * steps / np.dot(w, steps)
    c = {n: sum(v[i] * own_old[i][n] for i in range(sites)) for n in NAMES}
    corr = [scaffold.step_correction(c, own_old[i]) for i in range(sites)]
    # Each site's round: its mean direction d_i plus the correction, times its span.
    d = [_model(rng, 0.5) for _ in range(sites)]
    y = [{n: x[n] - steps[i] * lr * (d[i][n] + corr[i][n]) for n in NAMES} for i in range(sites)]
    own = [scaffold.own_direction(x, y[i], steps[i] * lr, corr[i], NAMES) for i in range(sites)]
    for i in range(sites):  # a site reads its own uncorrected direction off its weights
        for n in NAMES:
            np.testing.assert_allclose(own[i][n], d[i][n], rtol=1e-4, atol=1e-5)
    new = {n: sum(w[i] * y[i][n] for i in range(sites)) / w.sum() for n in NAMES}
    span = lr * scaffold.round_span(list(steps), list(w))
    shared = scaffold.shared_direction(x, new, span, NAMES)
    for n in NAMES:
        np.testing.assert_allclose(shared[n], sum(v[i] * d[i][n] for i in range(sites)),
                                   rtol=1e-4, atol=1e-5)


def test_a_site_cannot_move_the_span_far_by_misreporting_its_steps():
    honest = scaffold.round_span([40.0, 50.0, 60.0], [1.0, 1.0, 1.0])
    assert honest == pytest.approx(50.0)
    # From three sites a claim of one step counts as a quarter of the median's, and one of
    # 1e9 as four times it.
    lying = scaffold.round_span([40.0, 50.0, 1.0], [1.0, 1.0, 1.0])
    assert lying == pytest.approx((40 + 50 + 10) / 3) and lying > honest / 2
    stretched = scaffold.round_span([1e9, 50.0, 60.0], [1.0, 1.0, 1.0])
    assert stretched == pytest.approx((4 * 60 + 50 + 60) / 3) and stretched < 3 * honest
    # Of two sites (the median is their mean) only the bound its example count sets holds an
    # inflated claim: at most the steps its counted examples allow.
    bounds = [float(scaffold.most_steps(n, 6.0, 64)) for n in (300, 600)]
    assert bounds == [30.0, 60.0]
    two = scaffold.round_span([30.0, 1e12], [300.0, 600.0], bounds)
    assert two == pytest.approx((300 * 30 + 600 * 60) / 900)
    assert scaffold.round_span([30.0, 1.0], [300.0, 300.0], bounds) >= 30 / 2 * 0.6
    assert scaffold.round_span([], []) == 0.0


def test_a_span_of_zero_has_no_shared_direction():
    rng = np.random.default_rng(1)
    x = _model(rng)
    with pytest.raises(ValueError, match="span"):
        scaffold.shared_direction(x, x, 0.0, NAMES)


def test_a_step_correction_moves_each_step_and_a_zero_one_changes_nothing(tiny_bundle,
                                                                          tiny_data):
    arch = architecture(load_bundle(tiny_bundle))
    start = model_weights(model_from_bundle(tiny_bundle))
    site = load_site(arch, tiny_data.train, holdout=0.25, seed=0)
    local = LocalTraining(epochs=0.5, lr=0.01, batch_size=32, augment=False)
    names = [n for n, _ in build_model(arch).named_parameters()]
    plain = fit(arch, start, site, local)
    zero = fit(arch, start, site, local,
               step_correction={n: np.zeros_like(start[n]) for n in names})
    for n in start:
        np.testing.assert_array_equal(plain.weights[n], zero.weights[n])
    # A correction far larger than Adam's unit-sized steps dominates where the site goes,
    # and the site's own direction, read off its weights, takes it out again.
    push = {n: np.full_like(start[n], 50.0) for n in names}
    pushed = fit(arch, start, site, local, step_correction=push)
    name = names[0]
    moved = (start[name] - pushed.weights[name]) / (pushed.steps * local.lr)
    assert float(np.mean(moved)) > 40.0
    own = scaffold.own_direction(start, pushed.weights, pushed.steps * local.lr, push, [name])
    assert float(np.abs(own[name]).mean()) < 5.0
