"""Aggregation over the views present, and its torch twin used in training."""

import numpy as np
import pytest

from ddnn.aggregation import aggregate, parse_scheme
from ddnn.errors import ConfigError


def test_max_and_avg_ignore_absent_views():
    x = np.array([[[1.0, 5.0], [9.0, -9.0], [3.0, 1.0]]])  # (B=1, V=3, C=2)
    present = np.array([[True, False, True]])
    np.testing.assert_array_equal(aggregate(x, present, "max"), [[3.0, 5.0]])
    np.testing.assert_array_equal(aggregate(x, present, "avg"), [[2.0, 3.0]])


def test_concat_zero_fills_absent_views_in_their_slot():
    x = np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)  # (B, V, F, w)
    out = aggregate(x, np.array([[True, False, True]]), "concat")
    assert out.shape == (1, 6, 2)
    np.testing.assert_array_equal(out[0, 2:4], 0.0)
    np.testing.assert_array_equal(out[0, 4:6], x[0, 2])


def test_no_view_present_gives_zeros():
    x = np.ones((2, 3, 4), np.float32)
    none = np.zeros((2, 3), bool)
    for op in ("max", "avg", "concat"):
        assert not aggregate(x, none, op).any()


def test_bad_arguments():
    with pytest.raises(ConfigError, match="unknown aggregation"):
        aggregate(np.ones((1, 2, 3)), np.ones((1, 2), bool), "median")
    with pytest.raises(ConfigError, match="expects"):
        aggregate(np.ones((1, 2, 3)), np.ones((1, 3), bool), "max")
    with pytest.raises(ConfigError, match="unknown aggregation scheme"):
        parse_scheme("XX")
    assert parse_scheme("mp-cc") == ("max", "concat")


@pytest.mark.parametrize("op", ["max", "avg", "concat"])
def test_torch_twin_matches_numpy(op):
    torch = pytest.importorskip("torch")
    from ddnn.models.network import aggregate as torch_aggregate

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4, 3, 5, 5)).astype(np.float32)
    present = rng.random((8, 4)) < 0.6
    present[0] = False  # a sample with no view at all
    expected = aggregate(x, present, op)
    got = torch_aggregate(torch.from_numpy(x), torch.from_numpy(present), op).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
