"""The exit policy: a sample leaves at an exit when that exit is confident enough.

Confidence is the normalized entropy of the exit's softmax, η(p) = −Σ p log p / log C, which lies
in [0, 1] whatever the class count C; a sample exits where η < T (BranchyNet, DDNN §III-C).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ddnn.errors import ConfigError

EXIT_TIERS = ("local", "edge", "cloud")


def softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float64 (entropy near 0 needs the precision)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def normalized_entropy(probs: np.ndarray, axis: int = -1) -> np.ndarray:
    """η(p) in [0, 1]: 0 for a one-hot distribution, 1 for the uniform one."""
    p = np.asarray(probs, dtype=np.float64)
    n_classes = p.shape[axis]
    if n_classes < 2:
        raise ConfigError("normalized entropy needs at least two classes")
    # 0 · log 0 is taken as 0, the limit, without a warning.
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    eta = -plogp.sum(axis=axis) / np.log(n_classes)
    return np.clip(eta, 0.0, 1.0)


def entropy_of_logits(logits: np.ndarray) -> np.ndarray:
    """Normalized entropy of softmax(logits) along the last axis."""
    return normalized_entropy(softmax(logits))


def check_threshold(name: str, value: float) -> float:
    """Validate an exit threshold: a number in [0, 1] (0 never exits, 1 nearly always does)."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"threshold {name!r} must be a number, got {value!r}") from None
    if not 0.0 <= t <= 1.0 or np.isnan(t):
        raise ConfigError(f"threshold {name!r} must lie in [0, 1], got {t}")
    return t


@dataclass(frozen=True)
class ExitPolicy:
    """Entropy thresholds of the early exits, keyed by tier ("local", "edge").

    The cloud exit is the last one and always takes what reaches it.
    """

    thresholds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tier, t in self.thresholds.items():
            if tier not in EXIT_TIERS[:-1]:
                raise ConfigError(f"unknown exit {tier!r}; early exits are local and edge")
            check_threshold(tier, t)

    def threshold(self, tier: str) -> float:
        # An exit without a threshold never takes a sample early.
        return float(self.thresholds.get(tier, 0.0))

    def exits(self, tier: str, entropy: np.ndarray | float) -> np.ndarray:
        """Boolean mask: which samples with this entropy leave at ``tier``."""
        if tier == "cloud":
            return np.ones_like(np.asarray(entropy), dtype=bool)
        return np.asarray(entropy) < self.threshold(tier)

    def with_overrides(self, **overrides: float | None) -> ExitPolicy:
        """A copy with the given thresholds replaced (``None`` keeps the current one)."""
        merged = dict(self.thresholds)
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return ExitPolicy(merged)
