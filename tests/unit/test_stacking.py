"""Stacked exits (ddnn.stacking) and how training fits their weights (fit_stacking)."""

from __future__ import annotations

import numpy as np
import pytest

from ddnn.errors import BundleError
from ddnn.stacking import Stacking, log_probs, stack

C = 4


def _scores(labels: np.ndarray, right: np.ndarray, rng: np.random.Generator,
            margin: float = 2.0) -> np.ndarray:
    """Logits whose argmax is the label where ``right``, another class elsewhere."""
    x = rng.normal(0, 0.5, (len(labels), C)).astype(np.float32)
    wrong = (labels + 1 + rng.integers(0, C - 1, len(labels))) % C
    x[np.arange(len(labels)), np.where(right, labels, wrong)] += margin
    return x


def test_the_weights_ends_are_the_tiers_own_answers():
    rng = np.random.default_rng(0)
    below, own = rng.normal(size=(5, C)), rng.normal(size=(5, C)) * 3
    np.testing.assert_allclose(stack(below, own, 1.0), log_probs(own), atol=1e-6)
    np.testing.assert_allclose(stack(below, own, 0.0), log_probs(below), atol=1e-6)
    half = stack(below, own, 0.5)  # a geometric mean of the two distributions
    np.testing.assert_allclose(half, 0.5 * (log_probs(below) + log_probs(own)), atol=1e-6)
    assert stack(None, own, 1.0).shape == own.shape  # the tier's own: nothing below is read
    with pytest.raises(ValueError, match="tier below"):
        stack(None, own, 0.5)


def test_apply_stacks_each_tier_on_the_stacked_answer_below():
    rng = np.random.default_rng(1)
    exits = {k: rng.normal(size=(6, C)).astype(np.float32)
             for k in ("device", "local", "edge", "cloud", "escalated")}
    s = Stacking(edge=0.4, cloud=0.7, escalated=0.2)
    out = s.apply(exits)
    edge = stack(exits["local"], exits["edge"], 0.4)
    np.testing.assert_allclose(out["edge"], edge, atol=1e-6)
    np.testing.assert_allclose(out["cloud"], stack(edge, exits["cloud"], 0.7), atol=1e-6)
    np.testing.assert_allclose(out["escalated"], stack(edge, exits["escalated"], 0.2),
                               atol=1e-6)
    assert out["local"] is exits["local"] and out["device"] is exits["device"]


@pytest.mark.parametrize("bad", [{"edge": 1.5}, {"cloud": -0.1}, {"edge": True},
                                 {"edge": "0.5"}, {"fog": 0.5}])
def test_bad_weights_are_refused(bad):
    with pytest.raises(BundleError):
        Stacking.from_dict(bad)


def test_round_trip_and_missing_tiers_answer_on_their_own():
    assert Stacking.from_dict({"edge": 0.25}) == Stacking(edge=0.25, cloud=1.0, escalated=1.0)
    s = Stacking(0.1, 0.2, 0.3)
    assert Stacking.from_dict(s.to_dict()) == s


def test_an_evaluation_says_what_each_upper_exit_stands_on():
    from ddnn.tools.evaluate import format_table

    s = Stacking(edge=0.85, cloud=0.0, escalated=0.95)
    assert s.describe(escalates=True) == ("stacked exits: edge = 0.85 own + 0.15 local; "
                                          "cloud = 0 own + 1 edge; escalated cloud = 0.95 own"
                                          " + 0.05 edge")
    assert "escalated" not in Stacking().describe() and "+" not in Stacking().describe()
    from ddnn.stacking import summary_line

    assert summary_line({"stacking": None}) is None and summary_line({}) is None
    assert summary_line({"stacking": s.to_dict(), "escalation": {}}) == s.describe(True)
    result = {"samples": 2, "accuracy": dict.fromkeys(("device", "local", "edge", "cloud",
                                                       "overall"), 1.0),
              "exit_fraction": {"local": 1.0, "edge": 0.0, "cloud": 0.0},
              "thresholds": {"local": 0.5, "edge": 0.5},
              "bytes_per_frame": {"ddnn": 10.0, "raw_offload": 100.0}}
    assert "stacked exits" not in format_table({**result, "stacking": None})
    assert "edge = 0.85 own + 0.15 local; cloud = 0 own + 1 edge\n" in format_table(
        {**result, "stacking": s.to_dict()})


def test_a_complementary_upper_exit_gets_a_weight_that_pays():
    """Two exits right on different halves of the frames, each unsure where it is wrong: the
    stacked answer beats both, so a weight strictly between 0 and 1 is chosen."""
    from ddnn.models.calibrate import fit_stacking

    rng = np.random.default_rng(2)
    n = 2000
    labels = rng.integers(0, C, n)
    local_right = rng.random(n) < 0.75
    edge_right = ~local_right | (rng.random(n) < 0.6)
    local = _scores(labels, local_right, rng, np.where(local_right, 3.0, 0.8))
    edge = _scores(labels, edge_right, rng, np.where(edge_right, 3.0, 0.8))
    s = fit_stacking({"local": local, "edge": edge, "cloud": edge}, labels, views=3)
    assert 0 < s.edge < 1
    acc = lambda x: (x.argmax(1) == labels).mean()  # noqa: E731
    assert acc(stack(local, edge, s.edge)) > max(acc(local), acc(edge))
    assert s.cloud == 0.0  # the same answer again adds nothing: it is passed up unchanged


def test_an_upper_exit_no_better_than_chance_passes_the_answer_below_up():
    from ddnn.models.calibrate import fit_stacking

    rng = np.random.default_rng(3)
    labels = rng.integers(0, C, 600)
    local = _scores(labels, rng.random(600) < 0.8, rng)
    noise = rng.normal(0, 1, (600, C)).astype(np.float32)
    s = fit_stacking({"local": local, "edge": noise, "cloud": noise}, labels, views=3)
    assert s == Stacking(edge=0.0, cloud=0.0)


def test_a_one_view_edge_answers_on_its_own():
    """One camera decides its own local exit and sends no scores: nothing to stack on."""
    from ddnn.models.calibrate import fit_stacking

    rng = np.random.default_rng(4)
    labels = rng.integers(0, C, 300)
    local = _scores(labels, rng.random(300) < 0.9, rng)
    s = fit_stacking({"local": local, "edge": local, "cloud": local}, labels, views=1)
    assert s.edge == 1.0


def _complementary(rng: np.random.Generator, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Local and edge exits right on different frames, and a cloud better than both."""
    labels = rng.integers(0, C, n)
    local_right = rng.random(n) < 0.7
    edge_right = ~local_right | (rng.random(n) < 0.5)
    cloud_right = ~(local_right & edge_right) | (rng.random(n) < 0.5)
    exits = {k: _scores(labels, r, rng, np.where(r, 3.0, 0.8)) for k, r in
             (("local", local_right), ("edge", edge_right), ("cloud", cloud_right),
              ("escalated", cloud_right | (rng.random(n) < 0.5)))}
    return exits, labels


def test_summed_tables_of_several_data_sets_fit_what_their_union_fits():
    """Federated learning refits the stacking from its sites' summed tables: the weights
    must be the ones training would fit on all their held-out frames at once."""
    from ddnn.models.calibrate import fit_stacking, pick_stacking, stacking_tables

    rng = np.random.default_rng(5)
    for views in (3, 1):
        exits, labels = _complementary(rng, 900)
        union = fit_stacking(exits, labels, views=views)
        assert union == pick_stacking(stacking_tables(exits, labels), views)
        parts = np.split(rng.permutation(900), [150, 520])
        tables = [stacking_tables({k: v[p] for k, v in exits.items()}, labels[p])
                  for p in parts]
        summed = {k: sum(t[k] for t in tables) for k in tables[0]}
        assert pick_stacking(summed, views) == union
        assert union.cloud > 0 and (views == 1 or 0 < union.edge < 1)  # nothing trivial
        # Any one part alone may fit other weights: the sum is what carries the union.
        assert tables[0]["cloud"].shape == (21, 21, 4) and tables[0]["edge"].shape == (1, 21, 4)


def test_where_accuracy_ties_the_likelihood_of_the_labels_decides():
    """An edge that answers as the local exit does, only far surer: every weight is right as
    often, so the held-out likelihood picks the weight (not the first, the tier's own)."""
    from ddnn.models.calibrate import _grid_weights, fit_stacking

    rng = np.random.default_rng(7)
    labels = rng.integers(0, C, 500)
    local = _scores(labels, rng.random(500) < 0.8, rng, 1.0)
    s = fit_stacking({"local": local, "edge": local * 4, "cloud": local * 4}, labels, views=3)
    likelihood = [log_probs(stack(local, local * 4, float(w)))[np.arange(500), labels].sum()
                  for w in _grid_weights(21)]
    assert s.edge == _grid_weights(21)[int(np.argmax(likelihood))] and 0 < s.edge < 1


SITE_TIERS = {"edge", "cloud", "escalated"}


def _two_sites(seed: int = 6):
    from ddnn.models.calibrate import stacking_tables

    rng = np.random.default_rng(seed)
    exits, labels = _complementary(rng, 400)
    halves = [stacking_tables({k: v[p] for k, v in exits.items()}, labels[p])
              for p in (slice(0, 200), slice(200, 400))]
    return exits, labels, halves


def test_a_refit_needs_every_site_that_held_data_out():
    from ddnn.models.calibrate import fit_stacking
    from ddnn.models.federated.calibration import refit_stacking

    exits, labels, (a, b) = _two_sites()
    union = fit_stacking(exits, labels, 3)
    assert refit_stacking([(1, 200, a), (2, 200, b), (3, 0, None)], 3, SITE_TIERS) == (
        union, {"refit": True, "sites": 2})
    stacking, info = refit_stacking([(1, 200, a), (2, 200, None)], 3, SITE_TIERS)
    assert stacking is None and info["refit"] is False and "site 2" in info["reason"]
    assert refit_stacking([(3, 0, None)], 3, SITE_TIERS)[0] is None


def _hostile(tables: dict[str, np.ndarray]) -> list[tuple[str, dict]]:
    def edited(tier, fn):
        return {**tables, tier: fn(tables[tier].copy())}

    def put(index, value):
        def fn(t):
            t[index] = value
            return t
        return fn

    return [
        ("NaN", edited("edge", lambda t: t * np.nan)),
        ("whole numbers", edited("cloud", put((0, 0, 0), -5.0))),
        ("whole numbers", edited("cloud", put((0, 0, 0), 1e9))),
        ("whole numbers", edited("edge", put((0, 3, 1), 0.5))),
        ("above 0", edited("edge", put((0, 3, 3), 12.0))),
        ("varying", edited("cloud", put((2, 5, 0), tables["cloud"][2, 5, 0] + 1))),
        ("shape", edited("edge", lambda t: t[0])),
        ("shape", edited("cloud", lambda t: t[:11, :11])),
        ("expected numbers", edited("edge", lambda t: t.astype(str))),
        ("expected", {k: v for k, v in tables.items() if k != "cloud"}),
    ]


def test_tables_that_cannot_be_true_are_left_out_and_cannot_steer_or_crash_the_refit(caplog):
    from ddnn.models.calibrate import stacking_tables_problem
    from ddnn.models.federated.calibration import refit_stacking

    _, _, (a, b) = _two_sites()
    assert stacking_tables_problem(a, 200, SITE_TIERS) is None  # honest tables pass
    honest, _ = refit_stacking([(1, 200, a)], 3, SITE_TIERS)
    for reason, bad in _hostile(b):
        assert reason in stacking_tables_problem(bad, 200, SITE_TIERS)
        stacking, info = refit_stacking([(1, 200, a), (2, 200, bad)], 3, SITE_TIERS)
        assert stacking == honest and info["sites"] == 1 and reason in info["left_out"]["2"]
    assert "left the stacking tables of site 2 out" in caplog.text
    stacking, info = refit_stacking([(2, 200, _hostile(b)[0][1])], 3, SITE_TIERS)
    assert stacking is None and info["refit"] is False  # nobody left to refit on
    for claim in (float("nan"), float("inf")):  # a sample count that would void every bound
        stacking, info = refit_stacking([(1, 200, a), (2, claim, _hostile(b)[2][1])], 3,
                                        SITE_TIERS)
        assert stacking == honest and "sample count" in info["left_out"]["2"]


def test_a_site_that_held_out_experience_refits_the_tiers_it_can_run_and_keeps_the_rest():
    """Experience holds no details: a site evaluating on it sends no escalated tables. The
    edge and cloud weights are refit on every site's tables, the escalated one stays the
    bundle's."""
    from ddnn.models.calibrate import fit_stacking
    from ddnn.models.federated.calibration import refit_stacking
    from ddnn.stacking import Stacking

    exits, labels, (a, b) = _two_sites()
    union = fit_stacking(exits, labels, 3)
    current = Stacking(edge=0.9, cloud=0.9, escalated=0.35)
    no_a = {k: v for k, v in a.items() if k != "escalated"}
    no_details = {k: v for k, v in b.items() if k != "escalated"}
    stacking, info = refit_stacking([(1, 200, no_a), (2, 200, no_details)], 3, SITE_TIERS,
                                    current, partial=(1, 2))
    assert info == {"refit": True, "sites": 2, "kept": ["escalated"]}
    assert (stacking.edge, stacking.cloud) == (union.edge, union.cloud)
    assert stacking.escalated == current.escalated
    # A site that held out data can run every tier: its tables must have them all.
    stacking, info = refit_stacking([(1, 200, a), (2, 200, no_details)], 3, SITE_TIERS,
                                    current, partial=(1,))
    assert info["sites"] == 1 and "expected" in info["left_out"]["2"]
