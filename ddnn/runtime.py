"""Running a bundle's segments with ONNX Runtime.

:class:`SegmentRunner` wraps one ONNX file; :class:`BundleRuntime` holds the sessions of a whole
bundle and knows the glue between them (aggregation over present views, the codecs the tensors
travel through). Every tier builds on these, so the offline evaluation and the live hierarchy
compute exactly the same numbers. ONNX Runtime is imported here lazily: importing :mod:`ddnn`
needs numpy only.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from ddnn.aggregation import aggregate
from ddnn.bundle import Bundle
from ddnn.codec import FeatureCodec
from ddnn.errors import BundleError, ConfigError
from ddnn.hierarchy import detail_sizes, surest_views
from ddnn.segment import SegmentSpec


def _session(path: Path, threads: int | None) -> Any:
    try:
        import onnxruntime as ort
    except ImportError:
        raise ConfigError(
            "onnxruntime is not installed; install ddnn with the device, edge or cloud extra"
        ) from None
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    opts.log_severity_level = 3  # warnings about unused initializers are noise to users
    # Spinning worker threads burn the CPU between runs that the MQTT and HTTP threads of the
    # same process need; these segments are small, so waking up costs less than spinning.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own types for a corrupt or unsupported graph
        raise BundleError(f"{path}: ONNX Runtime cannot load this segment ({e})") from None


class SegmentRunner:
    """One segment's ONNX Runtime session; call it with arrays named by the manifest."""

    def __init__(self, path: Path, spec: SegmentSpec, threads: int | None = None):
        self.spec = spec
        self._session = _session(path, threads)
        self._outputs = [t.name for t in spec.outputs]
        # Worked out once: a device calls this every frame.
        self._inputs = [(t.name, t.sample_shape) for t in spec.inputs]

    def __call__(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {}
        for name, sample_shape in self._inputs:
            if name not in inputs:
                raise ConfigError(f"segment {self.spec.file} needs input {name!r}")
            x = np.ascontiguousarray(inputs[name], dtype=np.float32)
            if x.shape[1:] != sample_shape:
                raise ConfigError(
                    f"segment {self.spec.file} input {name!r} must have per-sample shape "
                    f"{sample_shape}, got {x.shape[1:]}"
                )
            feeds[name] = x
        results = self._session.run(self._outputs, feeds)
        return dict(zip(self._outputs, results, strict=True))


def transmit(x: np.ndarray, codec: FeatureCodec) -> np.ndarray:
    """What the receiver sees after each sample of ``x`` crosses a link with ``codec``.

    Every sample travels in its own message, so int8 quantizes each with its own scale.
    """
    if codec.kind == "int8":
        return np.stack([codec.decode(codec.encode(s), s.shape) for s in x]) if len(x) else x
    return codec.decode(codec.encode(x), x.shape)


class BundleRuntime:
    """All segments of a bundle, loaded on first use; thread-safe for concurrent callers."""

    def __init__(self, bundle: Bundle, threads: int | None = None, *, exact_links: bool = False):
        """``exact_links``: float32 on the links of the device scores and features and of the
        edge features, so the exits compare with torch's for export parity (torch's network
        does not model float16 scores or int8 edge features; binary and few-bit features are
        its exact levels either way); the tiers always run with the bundle's codecs."""
        self.bundle = bundle
        self.manifest = bundle.manifest
        self.threads = threads
        self._runners: dict[str, SegmentRunner] = {}
        self._lock = threading.Lock()
        m = self.manifest
        self.scores_codec = FeatureCodec(m.codec["scores"])
        self.device_codec = FeatureCodec(m.codec["device_features"])
        self.edge_codec = FeatureCodec(m.codec["edge_features"])
        if exact_links:
            self.scores_codec = self.device_codec = self.edge_codec = FeatureCodec("float32")
        # The devices' detail of an escalated frame (bundles that can escalate); it keeps its
        # codec even with exact links, as the network rounds it the wire's way itself.
        self.detail_codec = (FeatureCodec(m.codec["device_detail"]) if m.escalated is not None
                             else None)

    def runner(self, role: str) -> SegmentRunner:
        with self._lock:
            if role not in self._runners:
                spec = self.manifest.segments().get(role)
                if spec is None:
                    raise BundleError(f"bundle {self.bundle.ref} has no segment {role!r}")
                self._runners[role] = SegmentRunner(self.bundle.file(spec), spec, self.threads)
            return self._runners[role]

    def load_all(self) -> None:
        """Create every session now (services do this before reporting ready)."""
        for role in self.manifest.segments():
            self.runner(role)

    # --- the segments, in hierarchy order -------------------------------------------------

    def device(self, view: int, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Device segment of ``view``: images (B, 3, H, W) → (scores (B, C), features)."""
        out = self.device_outputs(view, images)
        return out["scores"], out["features"]

    def device_outputs(self, view: int, images: np.ndarray) -> dict[str, np.ndarray]:
        """Every output of ``view``'s device segment: ``scores``, ``features`` and, where the
        bundle can escalate, ``detail``."""
        if not 0 <= view < self.manifest.views:
            raise ConfigError(
                f"view {view} is outside the bundle's views 0..{self.manifest.views - 1}"
            )
        return self.runner(f"device-{view}")(image=images)

    def local(self, scores: np.ndarray, present: np.ndarray) -> np.ndarray:
        """Local exit: device scores (B, V, C) of the present views → local scores (B, C)."""
        agg = aggregate(scores, present, self.manifest.aggregation["local"])
        if self.manifest.local is None:
            return agg
        return self.runner("local")(device_scores=agg)["scores"]

    def edge(self, features: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Edge segment: device features (B, V, F, h, w) → (edge scores, edge features)."""
        agg = aggregate(features, present, self.manifest.aggregation["edge"])
        out = self.runner("edge")(device_features=agg)
        return out["scores"], out["features"]

    def cloud(self, features: np.ndarray) -> np.ndarray:
        """Cloud segment: edge features → cloud scores (B, C)."""
        return self.runner("cloud")(edge_features=features)["scores"]

    def device_detail(self, view: int, images: np.ndarray) -> np.ndarray:
        """The detail a device keeps for an escalated frame: images (B, 3, H, W) → (B, c, r, r),
        its segment's ``detail`` output (bundles that can escalate)."""
        if self.manifest.escalated is None:
            raise BundleError(f"bundle {self.bundle.ref} does not escalate: no device detail")
        return self.runner(f"device-{view}")(image=images)["detail"]

    def escalation_request(self, X: np.ndarray, present: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        """What the edge sends the escalated model for frames (B, V, 3, H, W) that escalate:
        the edge features and the senders' details concatenated over the slots (B, S·c, r, r),
        each as it left its codec (the devices' scores pick the senders where the bundle
        escalates only the surest views)."""
        if self.detail_codec is None:
            raise BundleError(f"bundle {self.bundle.ref} does not escalate: no device detail")
        scores, feats, detail, _ = self._device_pass(X, present, detail_bytes=False)
        _, edge_feats = self.edge(feats, present)
        detail, _, sent = self._senders(scores, present, detail)
        return transmit(edge_feats, self.edge_codec), aggregate(detail, sent, "concat")

    def escalated(self, features: np.ndarray, detail: np.ndarray, present: np.ndarray
                  ) -> np.ndarray:
        """The cloud's answer to an escalated frame: edge features and the details
        (B, S, c, r, r) in the bundle's S slots (every view, or the ``escalation_views``
        surest: :func:`ddnn.hierarchy.surest_views`), ``present`` (B, S) saying which slots
        hold one → scores (B, C)."""
        agg = aggregate(detail, present, "concat")
        return self.runner("escalated")(edge_features=features, device_detail=agg)["scores"]

    # --- every exit of a batch, as the live hierarchy would compute it -----------------------

    def all_exits(self, X: np.ndarray, present: np.ndarray, *, detail_bytes: bool = True,
                  stacked: bool = True) -> dict[str, np.ndarray]:
        """Run every segment on a batch of multi-view samples (B, V, 3, H, W).

        Tensors pass through the bundle's codecs exactly as they would on the wire, so these
        numbers equal the live hierarchy's. Absent views are not run (their devices send
        nothing); their slots hold zeros. A bundle that can escalate adds ``escalated``, the
        cloud's answer with every present view's detail, and (unless ``detail_bytes`` is
        False) ``detail_bytes``, each frame's details' payload as its devices would code them.
        A bundle with stacked exits answers at each upper tier as it stacks (``stacked``
        False: every segment's own scores, what calibration fits the stacking on).
        """
        dev_scores, dev_feats, detail, sizes = self._device_pass(X, present, detail_bytes)
        local = self.local(dev_scores, present)
        edge_scores, edge_feats = self.edge(dev_feats, present)
        edge_feats = transmit(edge_feats, self.edge_codec)
        exits = {
            "device": dev_scores,
            "local": local,
            "edge": edge_scores,
            "cloud": self.cloud(edge_feats),
        }
        if detail is not None:
            detail, sizes, sent = self._senders(dev_scores, present, detail, sizes)
            exits["escalated"] = self.escalated(edge_feats, detail, sent)
            if detail_bytes:  # the payload bytes of each frame's senders' details
                exits["detail_bytes"] = np.where(sent, sizes, 0).sum(axis=1)
        if stacked and self.manifest.stacking is not None:
            exits = self.manifest.stacking.apply(exits)
        return exits

    def _senders(self, scores: np.ndarray, present: np.ndarray, detail: np.ndarray,
                 sizes: np.ndarray | None = None):
        """The details (B, V, ...) of the views that send theirs, in the bundle's slots, their
        payload bytes (when given) and which slots hold one: every present view's, or only
        the ``escalation_views`` surest devices' (picked by their scores)."""
        k = self.manifest.escalation_views
        if not k:
            return detail, sizes, present
        if sizes is not None:
            sizes, _ = surest_views(sizes, scores, present, k)
        detail, sent = surest_views(detail, scores, present, k)
        return detail, sizes, sent

    def _device_pass(self, X: np.ndarray, present: np.ndarray, detail_bytes: bool):
        """Every present view's device segment on a batch: (scores, features, detail or None,
        each detail's payload bytes as its device codes it or None), as they leave their
        codecs; absent views' slots hold zeros."""
        b, v = X.shape[:2]
        m = self.manifest
        scores = np.zeros((b, v, m.num_classes), np.float32)
        feats = np.zeros((b, v, *m.devices[0].output("features").sample_shape), np.float32)
        detail = sizes = None
        if self.detail_codec is not None:
            detail = np.zeros((b, v, *m.devices[0].output("detail").sample_shape), np.float32)
            sizes = np.zeros((b, v), np.int64) if detail_bytes else None
        for i in range(v):
            rows = np.flatnonzero(present[:, i])
            if rows.size == 0:
                continue
            out = self.runner(f"device-{i}")(image=X[rows, i])
            scores[rows, i] = transmit(out["scores"], self.scores_codec)
            feats[rows, i] = transmit(out["features"], self.device_codec)
            if detail is not None:
                detail[rows, i] = transmit(out["detail"], self.detail_codec)
            if sizes is not None:  # coding every detail: for byte counts, not for answers
                sizes[rows, i] = detail_sizes(out["detail"], self.detail_codec)
        return scores, feats, detail, sizes

    def run_dataset(
        self, X: np.ndarray, present: np.ndarray, batch: int = 256, *, stacked: bool = True
    ) -> dict[str, np.ndarray]:
        """:meth:`all_exits` over a whole dataset in batches."""
        parts = [
            self.all_exits(X[i : i + batch], present[i : i + batch], stacked=stacked)
            for i in range(0, len(X), batch)
        ]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
