"""SCAFFOLD's control variates derived from the models: option II of Karimireddy et al.
(2020), with nothing on the wire but the models FedAvg sends anyway.

Option II sets a site's new control variate to its mean *uncorrected* step direction over the
round it just ran, ``c_i = (x - y_i) / H_i - (c - c_i_old)``, where ``x`` is the shared model
the round started from, ``y_i`` the site's result and ``H_i`` its span: its steps x the
round's learning rate (constant within a round). With every site answering and the models
averaged with weights ``w_i``, the federation's variate, the mean of the sites' weighted by
``w_i H_i`` (weight x steps: the weighting under which the corrections cancel in the average),
is the shared model's own step over the mean span: ``c = (x - x_new) / H``,
``H = sum(w_i H_i) / sum(w_i)``. Both sides already hold what that takes: a site keeps ``x``,
its ``c_i`` and its last learning rate; the server sends ``x_new`` and the mean steps, one
number. So the correction costs no variate in either direction, where option I (the mean raw
gradient as the variate, sent up and the combined one sent down) doubles a round's bytes; and
no site can send the others a variate of its own making: its levers are its model, which the
update guard screens and the aggregate bounds, and its claimed steps, held within what its
(capped) example count can take and within a factor of the round's median claim. Under a
robust rule (trimmed mean, median) the shared model's step is no weighted mean, and ``c`` is
the robust step's direction: an approximation.

The directions are in the units of the optimizer's step (Adam's normalised step, per unit of
learning rate), so the correction applies after each optimizer step (``trainer.fit``'s
``step_correction``), not to the raw gradient.

Pure numpy: the site's ClientApp, the server's round driver and the tuning sweep share it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

Weights = dict[str, np.ndarray]
# A site's claimed steps count within [1/STEP_RATIO, STEP_RATIO] x the round's median claim
# when the span is formed: a site cannot shrink the span (and so blow up every site's
# correction) or stretch it (and so erase it) by more than that by misreporting its steps.
# Honest sites step in proportion to their data; within 4x of the median site their span is
# exact (the benchmark's sites: 0.65x to 1.75x).
STEP_RATIO = 4.0


def own_direction(start: Mapping[str, np.ndarray], end: Mapping[str, np.ndarray],
                  span: float, correction: Mapping[str, np.ndarray] | None,
                  names: Iterable[str]) -> Weights:
    """The site's new control variate: its mean uncorrected step direction over the round,
    ``(start - end) / span`` less the correction it ran with (``span``: its steps x lr)."""
    out: Weights = {}
    for n in names:
        d = (start[n].astype(np.float64) - end[n]) / span
        if correction is not None and n in correction:
            d = d - correction[n]
        out[n] = d.astype(np.float32)
    return out


def shared_direction(previous: Mapping[str, np.ndarray], current: Mapping[str, np.ndarray],
                     span: float, names: Iterable[str]) -> Weights:
    """The federation's control variate: the shared model's last step per unit of the span
    its sites' steps covered (a positive span: a round that moved no model, span 0, has no
    direction, and its sites run the next round uncorrected)."""
    if not span > 0:
        raise ValueError(f"a shared direction needs a positive span, got {span}")
    return {n: ((previous[n].astype(np.float64) - current[n]) / span).astype(np.float32)
            for n in names}


def step_correction(shared: Mapping[str, np.ndarray], own: Mapping[str, np.ndarray]
                    ) -> Weights:
    """What a site adds to each of its steps: the federation's direction less its own."""
    return {n: np.asarray(shared[n] - own[n], np.float32) for n in own}


def most_steps(examples: float, epochs: float, batch_size: int) -> int:
    """The most local steps a site of ``examples`` examples runs in a round of ``epochs``
    (``trainer.fit``: an epoch is a pass over the larger of its labelled data and its
    experience, which together are its example count)."""
    return max(1, round(epochs * math.ceil(max(examples, 1) / batch_size)))


def round_span(steps: list[float], weights: list[float], bounds: list[float] | None = None,
               ratio: float = STEP_RATIO) -> float:
    """The mean steps ``H`` of a round's shared step, which the server sends with the next
    model: the sites' claimed steps averaged with the weights their models were averaged with,
    each claim first held within [1, its bound] (``bounds``: :func:`most_steps` of the site's
    capped example count) and then within ``[median / ratio, median * ratio]`` of the round's
    claims so held (0 when no model was taken). A site cannot inflate its claim past what its
    counted examples allow, nor, from three sites, deflate it past a quarter of the median."""
    if not steps or sum(weights) <= 0:
        return 0.0
    if bounds is not None:
        steps = [min(max(s, 1.0), b) for s, b in zip(steps, bounds, strict=True)]
    median = float(np.median(steps))
    held = [min(max(s, median / ratio), median * ratio) for s in steps]
    return float(np.dot(held, weights) / sum(weights))
