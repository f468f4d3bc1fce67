"""Scores messages as a bundle's devices publish them, for tests that feed an edge directly."""

from __future__ import annotations

import numpy as np

from ddnn import envelope as env
from ddnn.edge.aggregator import EdgeAggregator
from ddnn.envelope import MessageType
from ddnn.topics import Topics


def messages(agg: EdgeAggregator, frames: int) -> list[tuple[str, bytes]]:
    """Every view's scores for ``frames`` frames, as they come over MQTT."""
    m, rng = agg.manifest, np.random.default_rng(3)
    bound = m.calibration.get("scores", {}).get("max_abs", 3.0)  # (what the edge takes)
    return [(Topics().device(d, "scores"), env.encode(env.pack(
        MessageType.SCORES, version=m.version, frame=n, codec=m.codec["scores"],
        tensor=np.clip(rng.normal(size=(1, m.num_classes)) * 3, -bound, bound
                       ).astype(np.float32))))
        for n in range(frames) for d in agg.devices]
