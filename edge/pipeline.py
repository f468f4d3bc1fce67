"""The exits a frame walks up at the edge: frame in, decision out.

1. local exit: the devices' scores aggregated over the views present (``BundleRuntime.local``);
   confident: answer; else pull the present views' features;
2. edge exit: the features that arrived, aggregated, through the edge segment
   (``BundleRuntime.edge``); confident: answer; else
3. send the edge features, as they go on the wire, to the cloud; its scores answer the frame
   (:meth:`ExitPipeline.cloud`), or the edge's own exit does, degraded, when it cannot.

Every step is the one ``ddnn evaluate`` runs (``BundleRuntime.all_exits``), fed with the tensors
as they crossed the wire, so the live hierarchy's answers equal the offline evaluation's. Pure:
no threads, no MQTT, no metrics; compute times go to the ``on_segment`` hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ddnn.exits import ExitPolicy, entropy_of_logits
from ddnn.runtime import BundleRuntime, transmit


@dataclass(frozen=True)
class Exit:
    """Answer the frame at ``tier`` with these class scores."""

    tier: str  # "local", "edge" or "cloud"
    scores: np.ndarray  # (C,) class scores of that exit
    entropy: float  # normalized entropy of those scores
    views: tuple[int, ...]  # the views fused into the answer


@dataclass(frozen=True)
class Pull:
    """Not confident at the local exit: the edge segment fuses the features of ``views``."""

    views: tuple[int, ...]  # the present views, whose features the edge segment fuses
    ask: tuple[int, ...]  # of those, the views to request (not arrived, not pushing them)
    answer: Exit  # the local exit's own answer: the fallback if no features arrive at all


@dataclass(frozen=True)
class ToCloud:
    """Not confident at the edge exit: the cloud answers from these edge features."""

    features: np.ndarray  # (1, ...) edge features through the bundle's edge codec
    version: str  # the bundle version they were made with (the cloud segment to use)
    fallback: Exit  # the edge's own answer, for when the cloud cannot give one (degraded)


class ExitPipeline:
    """The exits of one bundle version under one exit policy."""

    def __init__(self, runtime: BundleRuntime, policy: ExitPolicy, *,
                 on_segment: Callable[[str, float], None] | None = None):
        self.runtime, self.policy = runtime, policy
        m = self.manifest = runtime.manifest
        self._feature_shape = tuple(m.devices[0].output("features").sample_shape)
        self._on_segment = on_segment or (lambda step, seconds: None)

    @property
    def classes(self) -> Sequence[str]:
        return self.manifest.classes

    def local(self, scores: Mapping[int, np.ndarray], *, arrived: Collection[int] = (),
              pushing: Collection[int] = ()) -> Exit | Pull:
        """The local exit over the views present (``scores``: view → its (C,) scores).

        ``arrived``: views whose features are already here; ``pushing``: views whose devices
        send features unasked. Neither is asked for features.
        """
        m = self.manifest
        t0 = time.perf_counter()
        present = tuple(sorted(scores))
        x = np.zeros((1, m.views, m.num_classes), np.float32)
        mask = np.zeros((1, m.views), bool)
        for v in present:
            x[0, v] = np.reshape(scores[v], -1)
            mask[0, v] = True
        local = self.runtime.local(x, mask)
        eta = float(entropy_of_logits(local)[0])
        self._on_segment("local", time.perf_counter() - t0)
        answer = Exit("local", local[0], eta, present)
        if self.policy.exits("local", eta):
            return answer
        ask = tuple(v for v in present if v not in arrived and v not in pushing)
        return Pull(present, ask, answer)

    def edge(self, features: Mapping[int, np.ndarray]) -> Exit | ToCloud:
        """The edge exit over the features that arrived (view → that view's features).

        A view whose features never came is left out of the fusion, never zero-filled in; with
        none at all there is nothing to fuse (the caller answers from the local exit).
        """
        if not features:
            raise ValueError("the edge exit needs the features of at least one view")
        m = self.manifest
        t0 = time.perf_counter()
        fused = tuple(sorted(features))
        x = np.zeros((1, m.views, *self._feature_shape), np.float32)
        mask = np.zeros((1, m.views), bool)
        for v in fused:
            x[0, v] = np.reshape(features[v], self._feature_shape)
            mask[0, v] = True
        edge_scores, edge_features = self.runtime.edge(x, mask)
        eta = float(entropy_of_logits(edge_scores)[0])
        self._on_segment("edge", time.perf_counter() - t0)
        answer = Exit("edge", edge_scores[0], eta, fused)
        if self.policy.exits("edge", eta):
            return answer
        return ToCloud(transmit(edge_features, self.runtime.edge_codec), m.version, answer)

    @staticmethod
    def cloud(scores: np.ndarray, sent: Sequence[ToCloud]) -> list[Exit]:
        """The cloud's answers: its scores (B, C) for the frames ``sent`` in one call."""
        etas = entropy_of_logits(scores)
        return [Exit("cloud", s, float(eta), t.fallback.views)
                for t, s, eta in zip(sent, scores, etas, strict=True)]
