"""How much clock skew live cameras tolerate: capture-time slots under offset clocks.

Cameras number frames by their capture time's slot at the frame rate
(:func:`ddnn.device.sources.frame_slot`), so cameras agree on frame ids through their clocks.
Simulated here: two cameras capture at the same instants, one clock ``skew`` seconds ahead,
over many capture phases (where in a slot the captures fall). Every capture still gets a slot
on both, so every frame still gets one view from each camera (nothing becomes partial); a share
``skew × fps`` of frames pairs views captured one frame period apart. docs/edge-and-devices.md
quotes these numbers.
"""

import numpy as np
import pytest

from ddnn.device.sources import frame_slot


def paired_one_period_apart(skew: float, fps: float, phases: int = 400, n: int = 20) -> float:
    rng = np.random.default_rng(0)
    offsets = []
    for t0 in 1.8e9 + rng.uniform(0, 1 / fps, phases):  # where in a slot the captures fall
        captures = t0 + np.arange(n) / fps
        a = [frame_slot(t, fps) for t in captures]
        b = {frame_slot(t + skew, fps): j for j, t in enumerate(captures)}
        # Frame k gets camera A's capture i and camera B's capture j whose slots are both k.
        pairs = [(i, b[k]) for i, k in enumerate(a) if k in b]
        assert len(pairs) >= n - 1, "every frame still gets both views"
        offsets += [i != j for i, j in pairs]
    return float(np.mean(offsets))


@pytest.mark.parametrize(("skew_ms", "fps"), [(0, 10), (1, 10), (10, 10), (50, 10), (10, 25)])
def test_a_share_skew_times_fps_of_frames_pairs_views_one_period_apart(skew_ms, fps):
    share = paired_one_period_apart(skew_ms / 1000, fps)
    assert share == pytest.approx(min(1.0, skew_ms / 1000 * fps), abs=0.05)
