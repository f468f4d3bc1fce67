"""Where each sample exits, what the hierarchy answers, and what it costs on the uplink.

These functions turn per-exit scores into the hierarchy's outcome; calibration, ``ddnn evaluate``
and the live edge aggregator all use them, so the accounting agrees everywhere.

**Escalation levels.** At level 0 a frame that passes the edge exit reaches the cloud with the
edge features alone (the ``cloud`` segment). At level 1 the edge also pulls every present
camera's *detail* for it (its view at reduced resolution, or its stem's activations: the device
segment's ``detail`` output) and the cloud answers with the ``escalated`` segment, which reads
both; the details count in the frame's uplink bytes. A bundle without an ``escalated`` segment
has level 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddnn.bundle import Manifest
from ddnn.codec import FeatureCodec
from ddnn.deflate import wire_size
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


def cloud_exit(exits: dict[str, np.ndarray], level: int = 0) -> np.ndarray:
    """The cloud's scores at an escalation level: the ``escalated`` exit at level 1."""
    return exits["escalated"] if level >= 1 else exits["cloud"]


def hierarchy_predictions(exits: dict[str, np.ndarray], policy: ExitPolicy, level: int = 0
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's class as the hierarchy answers it, and the tier that answers (0/1/2)."""
    tier = exit_tiers(entropy_of_logits(exits["local"]), entropy_of_logits(exits["edge"]), policy)
    preds = [np.argmax(s, axis=-1) for s in (exits["local"], exits["edge"],
                                             cloud_exit(exits, level))]
    return np.choose(tier, preds), tier


@dataclass(frozen=True)
class UplinkCost:
    """Bytes one device sends per frame: its scores always, its features when pulled, and its
    detail when the frame escalates (level 1)."""

    scores: int
    features: int
    single_view: bool  # with one view the device decides its own exit and sends no scores
    detail: int = 0  # one device's detail payload; 0 where the bundle cannot escalate
    detail_views: int = 0  # devices that send it: the k surest present ones; 0: every one

    @classmethod
    def of(cls, manifest: Manifest) -> UplinkCost:
        c = manifest.num_classes
        feat_shape = manifest.devices[0].output("features").sample_shape
        detail = 0
        if manifest.escalated is not None:
            shape = manifest.devices[0].output("detail").sample_shape
            detail = FeatureCodec(manifest.codec["device_detail"]).payload_size((1, *shape))
        return cls(
            scores=FeatureCodec(manifest.codec["scores"]).payload_size((1, c)),
            features=FeatureCodec(manifest.codec["device_features"]).payload_size((1, *feat_shape)),
            single_view=manifest.views == 1,
            detail=detail,
            detail_views=manifest.escalation_views,
        )

    @property
    def sent_scores(self) -> int:
        return 0 if self.single_view else self.scores

    def detail_senders(self, present_views: np.ndarray) -> np.ndarray:
        """How many devices send their detail for an escalated frame."""
        if not self.detail_views:
            return present_views
        return np.minimum(present_views, self.detail_views)

    def details(self, exits: dict[str, np.ndarray], present_views: np.ndarray) -> np.ndarray:
        """The detail payload bytes each frame's senders send if it escalates: as sent (the
        devices deflate details, so :meth:`BundleRuntime.all_exits` measures them in
        ``exits["detail_bytes"]``), else the codec's size per sender."""
        if "detail_bytes" in exits:
            return np.asarray(exits["detail_bytes"], np.int64)
        return self.detail_senders(present_views) * self.detail

    def per_frame(self, present_views: np.ndarray, tier: np.ndarray, level: int = 0,
                  details: np.ndarray | None = None) -> np.ndarray:
        """Payload bytes each frame puts on the device uplink (message envelopes excluded);
        ``details``: each frame's detail bytes if it escalates (default: :meth:`details` by
        the codec's size)."""
        past_local = (tier > LOCAL).astype(np.int64)
        if details is None:
            details = self.detail_senders(present_views) * self.detail
        escalated = (tier > EDGE) & (level >= 1)
        return (present_views * (self.sent_scores + past_local * self.features)
                + escalated * details)


def detail_sizes(details: np.ndarray, codec: FeatureCodec) -> np.ndarray:
    """The payload bytes of each of ``details`` (N, ...) as a device sends it: coded by
    ``codec``, then deflated where that is shorter (:mod:`ddnn.deflate`) → (N,)."""
    details = np.asarray(details, np.float32)
    row = codec.row_bytes((1, *details.shape[1:]))
    return np.array([wire_size(codec.encode(d[None]), row) for d in details], np.int64)


def surest_views(detail: np.ndarray, scores: np.ndarray, present: np.ndarray, k: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The details (B, V, ...) of the ``k`` present views whose devices are surest (lowest
    entropy of their scores (B, V, C); ties to the lower view index), in that order, and which
    of the ``k`` slots hold one (B, k): whom the edge pulls details from when a bundle
    escalates only ``k`` views (``Manifest.escalation_views``)."""
    entropy = np.where(present, entropy_of_logits(scores), np.inf)
    order = np.argsort(entropy, axis=1, kind="stable")[:, :k]
    rows = np.arange(len(detail))[:, None]
    return detail[rows, order], present[rows, order]


def raw_offload_bytes(present_views: np.ndarray, input_shape: tuple[int, ...]) -> np.ndarray:
    """Bytes per frame if every present view were sent to the cloud as an 8-bit image."""
    return present_views * int(np.prod(input_shape))


def summarize(
    exits: dict[str, np.ndarray],
    labels: np.ndarray,
    view_labels: np.ndarray,
    manifest: Manifest,
    policy: ExitPolicy,
    level: int | None = None,
) -> dict:
    """The ``ddnn evaluate --json`` object for per-exit scores of a labelled dataset.

    ``level``: the escalation level (default: the manifest's). Frames that no view saw are
    counted in ``samples`` and ``no_view``, answered by nobody and left out of accuracy and
    exit shares; they cost no byte.
    """
    level = manifest.escalation_level if level is None else level
    present = view_labels >= 0
    n_present = present.sum(axis=1)
    seen = n_present > 0
    overall, tier = hierarchy_predictions(exits, policy, level)
    preds = {"local": exits["local"], "edge": exits["edge"], "cloud": cloud_exit(exits, level)}
    device_pred = np.argmax(exits["device"], axis=-1)
    cost = UplinkCost.of(manifest)
    details = cost.details(exits, n_present)
    ddnn_bytes = cost.per_frame(n_present, tier, level, details)
    raw = raw_offload_bytes(n_present, manifest.input_shape)

    def accuracy(pred: np.ndarray) -> float:
        return float((pred == labels)[seen].mean()) if seen.any() else 0.0

    out = {
        "samples": len(labels),
        "no_view": int((~seen).sum()),
        "accuracy": {
            "device": float((device_pred == view_labels)[present].mean()) if present.any() else 0.0,
            **{k: accuracy(np.argmax(v, axis=-1)) for k, v in preds.items()},
            "overall": accuracy(overall),
        },
        "exit_fraction": {t: float((tier == i)[seen].mean()) if seen.any() else 0.0
                          for i, t in enumerate(EXIT_TIERS)},
        "bytes_per_frame": {"ddnn": float(ddnn_bytes.mean()), "raw_offload": float(raw.mean())},
        "thresholds": {t: policy.threshold(t) for t in EXIT_TIERS[:-1]},
        # each upper exit's weight on its own answer (ddnn.stacking); None: they answer alone
        "stacking": manifest.stacking.to_dict() if manifest.stacking is not None else None,
    }
    if manifest.escalated is not None:
        senders = int(cost.detail_senders(n_present).sum())
        out["escalation"] = {
            "level": level,
            "detail_bytes_per_view": cost.detail,  # the codec's size; deflated as sent:
            "detail_bytes_per_view_sent": float(details.sum() / senders) if senders else 0.0,
            "cloud_accuracy": [accuracy(np.argmax(cloud_exit(exits, v), axis=-1))
                               for v in (0, 1)],
        }
    return out
