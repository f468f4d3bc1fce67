"""Where each sample exits, what the hierarchy answers, and what it costs on the uplink.

These functions turn per-exit scores into the hierarchy's outcome; calibration, ``ddnn evaluate``
and the live edge aggregator all use them, so the accounting agrees everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddnn.bundle import Manifest
from ddnn.codec import FeatureCodec
from ddnn.exits import EXIT_TIERS, ExitPolicy, entropy_of_logits

LOCAL, EDGE, CLOUD = range(3)


def exit_tiers(
    local_entropy: np.ndarray, edge_entropy: np.ndarray, policy: ExitPolicy
) -> np.ndarray:
    """Index of the tier (0 local, 1 edge, 2 cloud) where each sample leaves."""
    tier = np.full(np.shape(local_entropy), CLOUD, dtype=np.int64)
    tier[policy.exits("edge", edge_entropy)] = EDGE
    tier[policy.exits("local", local_entropy)] = LOCAL  # the lower exit wins
    return tier


def hierarchy_predictions(exits: dict[str, np.ndarray], policy: ExitPolicy
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's class as the hierarchy answers it, and the tier that answers (0/1/2)."""
    tier = exit_tiers(entropy_of_logits(exits["local"]), entropy_of_logits(exits["edge"]), policy)
    preds = [np.argmax(exits[k], axis=-1) for k in ("local", "edge", "cloud")]
    return np.choose(tier, preds), tier


@dataclass(frozen=True)
class UplinkCost:
    """Bytes one device sends per frame: its scores always, its features when pulled."""

    scores: int
    features: int
    single_view: bool  # with one view the device decides its own exit and sends no scores

    @classmethod
    def of(cls, manifest: Manifest) -> UplinkCost:
        c = manifest.num_classes
        feat_shape = manifest.devices[0].output("features").sample_shape
        return cls(
            scores=FeatureCodec(manifest.codec["scores"]).payload_size((1, c)),
            features=FeatureCodec(manifest.codec["device_features"]).payload_size((1, *feat_shape)),
            single_view=manifest.views == 1,
        )

    def per_frame(self, present_views: np.ndarray, tier: np.ndarray) -> np.ndarray:
        """Payload bytes each frame puts on the device uplink (message envelopes excluded)."""
        past_local = (tier > LOCAL).astype(np.int64)
        scores = 0 if self.single_view else self.scores
        return present_views * (scores + past_local * self.features)


def raw_offload_bytes(present_views: np.ndarray, input_shape: tuple[int, ...]) -> np.ndarray:
    """Bytes per frame if every present view were sent to the cloud as an 8-bit image."""
    return present_views * int(np.prod(input_shape))


def summarize(
    exits: dict[str, np.ndarray],
    labels: np.ndarray,
    view_labels: np.ndarray,
    manifest: Manifest,
    policy: ExitPolicy,
) -> dict:
    """The ``ddnn evaluate --json`` object for per-exit scores of a labelled dataset."""
    present = view_labels >= 0
    preds = {k: np.argmax(exits[k], axis=-1) for k in ("local", "edge", "cloud")}
    device_pred = np.argmax(exits["device"], axis=-1)
    overall, tier = hierarchy_predictions(exits, policy)
    n_present = present.sum(axis=1)
    cost = UplinkCost.of(manifest)
    ddnn_bytes = cost.per_frame(n_present, tier)
    raw = raw_offload_bytes(n_present, manifest.input_shape)
    return {
        "samples": len(labels),
        "accuracy": {
            "device": float((device_pred == view_labels)[present].mean()),
            **{k: float((v == labels).mean()) for k, v in preds.items()},
            "overall": float((overall == labels).mean()),
        },
        "exit_fraction": {t: float((tier == i).mean()) for i, t in enumerate(EXIT_TIERS)},
        "bytes_per_frame": {"ddnn": float(ddnn_bytes.mean()), "raw_offload": float(raw.mean())},
        "thresholds": {t: policy.threshold(t) for t in EXIT_TIERS[:-1]},
    }
