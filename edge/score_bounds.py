"""Class scores the edge takes from a device: finite, and within the bounds its bundle allows
(docs/security.md).

The local exit averages (or max-pools) the devices' class scores, so one device sending huge
logits (±50) would outvote five honest ones. The bundle records, from calibration, what its
devices send (``calibration.scores``, written by ``ddnn train``): ``{"kind": "logits",
"max_abs": M}``, the largest magnitude of any device's logit on the calibration data, or
``{"kind": "log_probs"}``, normalized log-probabilities. Scores beyond :data:`MARGIN` × M, or
log-probabilities that do not sum (in probability) to one, are refused, and the device is
judged for it (:mod:`ddnn.edge.conduct`). A bundle that records nothing (built before) is
checked for finite values only. The check is a few comparisons on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Honest logits on new data stay within a few times the calibration's largest, even on a
# drifted scene (where a false refusal would silence an honest camera); an attacker needs many
# times more to outvote the others (issue 25: ±50 against honest logits of a few units).
MARGIN = 4.0
LOG_PROB_TOLERANCE = 0.05  # |log Σ exp(scores)| of normalized log-probabilities (float16 wire)


class ScoreBounds:
    """Checks one device's class scores (a sequence of C floats) against the bundle's record."""

    def __init__(self, record: dict | None):
        record = record or {}
        self.kind = record.get("kind")
        max_abs = record.get("max_abs")
        self.limit = (MARGIN * float(max_abs) if self.kind == "logits"
                      and isinstance(max_abs, int | float) and max_abs > 0 else math.inf)

    @classmethod
    def of(cls, calibration: dict) -> ScoreBounds:
        return cls(calibration.get("scores") if isinstance(calibration, dict) else None)

    def check(self, scores: Sequence[float]) -> str | None:
        """Why ``scores`` are refused, or None when they are within bounds."""
        hi, lo = max(scores), min(scores)
        if not (math.isfinite(hi) and math.isfinite(lo)):
            return "scores are not finite"
        if hi > self.limit or lo < -self.limit:
            return f"scores reach {max(hi, -lo):.3g}, beyond ±{self.limit:.3g}"
        if self.kind == "log_probs":
            total = math.fsum(math.exp(s - hi) for s in scores)
            if hi > LOG_PROB_TOLERANCE or abs(hi + math.log(total)) > LOG_PROB_TOLERANCE:
                return "scores are not normalized log-probabilities"
        return None
