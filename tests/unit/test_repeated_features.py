"""A view's features are taken once per frame: a device answering one pull many times gains
nothing. (The device side, answering a flood of pulls once:
tests/integration/test_hostile_pulls.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from ddnn.edge.assembler import Drop, FrameAssembler

S = np.array([0.2, 0.8], np.float32)
F = np.zeros((1, 4), np.float32)


def test_features_answering_one_pull_twice_are_dropped_and_counted_by_reason():
    a = FrameAssembler(2, deadline=1.0, feature_deadline=0.5)
    a.add_scores(0, 1, S, 0.0, now=0.0)
    f = a.add_scores(1, 1, S, 0.0, now=0.0)
    assert a.await_features(f, [0, 1], now=0.0) is None
    assert a.add_features(0, 1, F, 0.0, now=0.1) is None
    with pytest.raises(Drop) as d:  # the same view again, while the frame waits
        a.add_features(0, 1, F, 0.0, now=0.1)
    assert d.value.reason == "duplicate"
    assert a.add_features(1, 1, F, 0.0, now=0.1) is f  # the frame goes on with one of each
    for view in (0, 1):  # and once it is taken, more are never fused into it
        with pytest.raises(Drop) as d:
            a.add_features(view, 1, F, 0.0, now=0.2)
        assert d.value.reason in ("duplicate", "unrequested", "late")
    assert {v: x.shape for v, x in f.features.items()} == {0: (1, 4), 1: (1, 4)}
