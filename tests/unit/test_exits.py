"""Normalized entropy and the exit policy."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ddnn.errors import ConfigError
from ddnn.exits import ExitPolicy, entropy_of_logits, normalized_entropy, softmax


def test_entropy_is_zero_for_one_hot_and_one_for_uniform():
    assert normalized_entropy(np.array([1.0, 0.0, 0.0])) == pytest.approx(0.0)
    assert normalized_entropy(np.full(7, 1 / 7)) == pytest.approx(1.0)


def test_entropy_is_normalized_by_class_count():
    # Two equally likely classes out of four: log 2 / log 4 = 0.5.
    assert normalized_entropy(np.array([0.5, 0.5, 0.0, 0.0])) == pytest.approx(0.5)


@given(arrays(np.float32, (5, 4), elements=st.floats(-50, 50, width=32)))
def test_entropy_of_any_logits_lies_in_unit_interval(logits):
    h = entropy_of_logits(logits)
    assert h.shape == (5,) and np.all((h >= 0) & (h <= 1))
    np.testing.assert_allclose(softmax(logits).sum(-1), 1.0, rtol=1e-9)


def test_policy_exits_below_threshold_only():
    policy = ExitPolicy({"local": 0.3, "edge": 0.5})
    np.testing.assert_array_equal(
        policy.exits("local", np.array([0.1, 0.3, 0.6])), [True, False, False]
    )
    assert policy.exits("cloud", np.array([0.99])).all()
    assert not ExitPolicy().exits("edge", np.array([0.0])).any()  # no threshold: never early


def test_policy_overrides_and_validation():
    policy = ExitPolicy({"local": 0.3, "edge": 0.5}).with_overrides(local=0.1, edge=None)
    assert policy.threshold("local") == 0.1 and policy.threshold("edge") == 0.5
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        ExitPolicy({"local": 1.5})
    with pytest.raises(ConfigError, match="unknown exit"):
        ExitPolicy({"device": 0.2})
    with pytest.raises(ConfigError, match="number"):
        ExitPolicy({"local": "high"})
