"""Stacked exits: each tier up the hierarchy answers with what the tier below said, and adds.

An upper segment reads poorer inputs than the devices did (their features as a few bits each),
so on its own it can answer worse than the local exit, whose devices saw the whole view. A
stacked tier's answer is the weighted geometric mean of its own class probabilities and the
answer of the tier below it:

    edge'  = (1 − a) · log p(local) + a · log p(edge)
    cloud' = (1 − b) · edge'        + b · log p(cloud)      (or the escalated segment's, with c)

The weights are fitted on held-out data at training (``ddnn.models.calibrate.fit_stacking``) and
kept in the manifest's ``stacking`` object; a weight of 1 is the tier's own answer (what a
bundle without the object does), 0 repeats the answer below. Every upper tier then answers in
log probabilities up to a constant (a geometric mean is not normalised), whose argmax and
entropy the exit policy reads as it reads logits: through a softmax.

The edge stacks as it answers (it holds the frame's local answer), and it stacks the cloud's
answer onto its own when the cloud's scores come back: the cloud service returns its segment's
own scores, so an Open Inference Protocol client that calls it directly gets those.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddnn.errors import BundleError

# Which segment's answer stacks on which (the edge's answer below the cloud's is stacked too).
BELOW = {"edge": "local", "cloud": "edge", "escalated": "edge"}


def log_probs(scores: np.ndarray) -> np.ndarray:
    """log softmax along the last axis, in float32 as every exit's scores are."""
    z = np.asarray(scores, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return (z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np.float32)


def stack(below: np.ndarray | None, own: np.ndarray, weight: float) -> np.ndarray:
    """The stacked answer: ``(1 − weight) · log p(below) + weight · log p(own)`` (``below``
    is not read at weight 1)."""
    if weight == 1.0:
        return log_probs(own)
    if below is None:
        raise ValueError("a stacked exit needs the answer of the tier below it")
    return ((1.0 - weight) * log_probs(below) + weight * log_probs(own)).astype(np.float32)


@dataclass(frozen=True)
class Stacking:
    """Each upper segment's weight on its own answer against the stacked answer below it."""

    edge: float = 1.0
    cloud: float = 1.0
    escalated: float = 1.0

    def __post_init__(self) -> None:
        for tier in BELOW:
            w = getattr(self, tier)
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0.0 <= w <= 1.0:
                raise BundleError(f"stacking weight {tier!r} must lie in [0, 1], got {w!r}")

    def weight(self, tier: str) -> float:
        return float(getattr(self, tier))

    def to_dict(self) -> dict[str, float]:
        return {tier: self.weight(tier) for tier in BELOW}

    @classmethod
    def from_dict(cls, d: Any) -> Stacking:
        if not isinstance(d, Mapping):
            raise BundleError(f"stacking must be an object of weights, got {d!r:.80}")
        unknown = set(d) - set(BELOW)
        if unknown:
            raise BundleError(f"stacking names unknown tiers {sorted(unknown)}")
        return cls(**{tier: d[tier] for tier in BELOW if tier in d})

    def describe(self, escalates: bool = False) -> str:
        """One line for people: what each upper exit's answer is made of, as weights of log
        probabilities: ``cloud = 0 own + 1 edge`` passes the (stacked) edge's answer up."""
        tiers = ("edge", "cloud", "escalated") if escalates else ("edge", "cloud")
        names = {"escalated": "escalated cloud"}
        parts = [f"{names.get(t, t)} = {self.weight(t):g} own"
                 + ("" if self.weight(t) == 1 else f" + {1 - self.weight(t):g} {BELOW[t]}")
                 for t in tiers]
        return "stacked exits: " + "; ".join(parts)

    def apply(self, exits: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every exit's answer stacked (``exits``: each segment's own scores, as
        :meth:`ddnn.runtime.BundleRuntime.all_exits` computes them)."""
        out = dict(exits)
        out["edge"] = stack(exits["local"], exits["edge"], self.edge)
        for tier in ("cloud", "escalated"):
            if tier in exits:
                out[tier] = stack(out["edge"], exits[tier], self.weight(tier))
        return out


def summary_line(summary: Mapping[str, Any]) -> str | None:
    """The :meth:`Stacking.describe` line of an evaluation summary
    (``ddnn.hierarchy.summarize``), or None where the bundle does not stack its exits."""
    weights = summary.get("stacking")
    if not weights:
        return None
    return Stacking.from_dict(weights).describe("escalation" in summary)
