"""The kinds of model the cloud serves for each bundle.

* ``{name}-cloud``: edge features (as the edge aggregator forwards them, already through the
  bundle's edge codec), FP32 → cloud exit scores and their normalized entropy;
* ``{name}-cloud-packed`` (where the bundle's edge codec packs): the same model on the same
  features packed in that codec, one UINT8 row per sample (``edge_features_packed``), which
  costs the WAN link 32× fewer bytes for binary features. A model of its own, so every input a
  model's metadata lists is one its requests need: a client that knows only the metadata shapes
  a valid request for each;
* ``{name}-full``: raw views with a presence mask → the cloud exit computed through every segment,
  exactly as :meth:`ddnn.runtime.BundleRuntime.all_exits` does (the raw-offload path);
* ``{name}-escalated`` (where the bundle can escalate): edge features and the senders' details
  (``device_detail``, concatenated in the bundle's slot order, zeros in an empty slot) → the
  escalated exit, the answer to a frame that was still unsure after the edge exit;
* ``{name}-escalated-packed``: the same on its inputs packed (the edge features in the edge
  codec, the details one row per slot in the detail codec with which slots hold one), what
  the edge sends: 4-bit details take an eighth of their FP32 bytes;
* ``{name}-escalated-lean``: the same in one input, each frame one row of bytes
  (:class:`~ddnn.packed_detail.EscalatedFrame`), so it answers the lean route: what the edge
  sends where the cloud serves it (no JSON either way);
* ``{name}-raw`` (a raw-offload reference bundle, ``"kind": "raw"``): every raw view, zeros for
  an absent one → the reference's scores, to compare the hierarchy with through the same service.

Each kind is one class with the LitServe shape: ``decode`` validates a request's tensors (user
errors raise :class:`~ddnn.oip.OipError`), ``predict`` runs a whole batch off the event loop, and
``encode`` picks the outputs the request asked for. ``serves`` says whether a bundle has the kind.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ddnn.bundle import Manifest
from ddnn.codec import MAX_ELEMENTS, FeatureCodec
from ddnn.errors import CodecError
from ddnn.exits import entropy_of_logits
from ddnn.hierarchy import cloud_exit
from ddnn.oip import (
    DATATYPES,
    DETAIL_PRESENT,
    DEVICE_DETAIL,
    DEVICE_DETAIL_PACKED,
    EDGE_FEATURES,
    EDGE_FEATURES_PACKED,
    ESCALATED_FRAME,
    PACKING_CODECS,
    InferRequest,
    OipError,
    json_array_limit,
)
from ddnn.packed_detail import DETAIL_PACKING_CODECS, DetailPacking, EscalatedFrame
from ddnn.raw_runtime import RawRuntime
from ddnn.runtime import BundleRuntime

PLATFORM = "onnxruntime_onnx"


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as the protocol's metadata describes it; ``-1`` marks the batch axis.

    ``parameters`` are listed in the metadata (the packed input says its codec there)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    parameters: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        d = {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}
        if self.parameters:
            d["parameters"] = dict(self.parameters)
        return d


class ServedModel:
    """One servable model of one bundle version."""

    kind: ClassVar[str] = ""

    def __init__(self, runtime: BundleRuntime | RawRuntime):
        self.runtime: Any = runtime  # the kind's serves() says which of the two it gets
        m = runtime.manifest
        self.bundle_name = m.name
        self.name = f"{m.name}-{self.kind}"
        self.version = m.version
        c = m.num_classes
        self.inputs: tuple[TensorMeta, ...] = self._input_meta()
        self.outputs = (TensorMeta("scores", "FP32", (-1, c)), TensorMeta("entropy", "FP32", (-1,)))

    @classmethod
    def serves(cls, manifest: Manifest) -> bool:
        """Whether a bundle with this manifest has a model of this kind (every kind of a
        hierarchy bundle serves unless it says otherwise)."""
        return manifest.kind == "ddnn"

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        raise NotImplementedError

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def raw_input(self) -> tuple[str, str, tuple[int, ...]] | None:
        """The one input a raw binary request may carry (name, datatype, sample shape): for a
        model with exactly one input, whose only free dimension is the batch."""
        if len(self.inputs) != 1 or -1 in self.inputs[0].shape[1:]:
            return None
        t = self.inputs[0]
        return t.name, t.datatype, t.shape[1:]

    def json_arrays(self, json_bytes: int) -> int:
        """The most ``[`` a JSON request body of ``json_bytes`` bytes may hold for this model's
        inputs (checked before the body is parsed: :func:`ddnn.oip.json_array_limit`)."""
        return json_array_limit([(t.datatype, t.shape[1:]) for t in self.inputs], json_bytes)

    def metadata(self, versions: list[str]) -> dict:
        return {
            "name": self.name,
            "versions": versions,
            "platform": PLATFORM,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            # lean: the model answers ddnn's lean route (one input; docs/cloud.md)
            "parameters": {"bundle": self.bundle_name,
                           "classes": list(self.runtime.manifest.classes),
                           **({"lean": True} if self.raw_input is not None else {})},
        }

    # --- decode → predict → encode ------------------------------------------------------------

    def decode(self, request: InferRequest) -> tuple[dict[str, np.ndarray], int]:
        """Check the request's tensors against the model; returns them (as ``predict`` takes
        them) and the batch size."""
        expected = {t.name: t for t in self.inputs}
        unknown = sorted(set(request.inputs) - set(expected))
        if unknown:
            raise OipError(f"model {self.name} has no input {unknown[0]!r}; its inputs are "
                           f"{sorted(expected)}")
        arrays: dict[str, np.ndarray] = {}
        batch: int | None = None
        for meta in self.inputs:
            if meta.name not in request.inputs:
                raise OipError(f"model {self.name} needs input {meta.name!r}")
            x = request.inputs[meta.name]
            if x.dtype != DATATYPES[meta.datatype]:
                got = next(k for k, d in DATATYPES.items() if d == x.dtype)
                raise OipError(f"input {meta.name!r} must be {meta.datatype}, got {got}")
            want = list(meta.shape)
            if x.ndim != len(want) or any(w not in (-1, d)
                                          for w, d in zip(want, x.shape, strict=True)):
                raise OipError(f"input {meta.name!r} must have shape {want} (-1: any batch "
                               f"size), got {list(x.shape)}{_shape_hint(meta)}")
            if batch is not None and x.shape[0] != batch:
                raise OipError(f"inputs disagree on the batch size ({batch} vs {x.shape[0]})")
            batch = x.shape[0]
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                raise OipError(f"input {meta.name!r} holds NaN or infinite values")
            _check_range(meta, x)
            arrays[meta.name] = x
        if not batch:
            raise OipError("a request must hold at least one sample (batch size 0)")
        if request.outputs is not None:
            names = {t.name for t in self.outputs}
            for name in request.outputs:
                if name not in names:
                    raise OipError(f"model {self.name} has no output {name!r}; its outputs are "
                                   f"{sorted(names)}")
        return self._unpack(arrays), batch

    def _unpack(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs as ``predict`` takes them (one form per kind, so requests batch together)."""
        return arrays

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a batch (called in a worker thread); returns every output."""
        try:
            scores = np.asarray(self._scores(inputs), dtype=np.float32)
        except CodecError as e:  # e.g. scores too large for a float16 link: the input's doing
            raise OipError(f"model {self.name} cannot process this input: {e}") from None
        if not np.isfinite(scores).all():
            # Finite inputs far outside what the network saw can overflow it; NaN scores have
            # entropy -0.0 ("certain"), an answer worse than none.
            raise OipError(f"model {self.name} cannot answer these inputs: its scores are not "
                           "finite (values far outside what the bundle's codecs and images "
                           "produce; each input's metadata gives its range where one holds)")
        return {"scores": scores, "entropy": entropy_of_logits(scores).astype(np.float32)}

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def encode(self, request: InferRequest, outputs: dict[str, np.ndarray]
               ) -> dict[str, np.ndarray]:
        """The outputs the request asked for, in its order (all of them when it named none)."""
        names = request.outputs if request.outputs is not None else [t.name for t in self.outputs]
        return {n: outputs[n] for n in names}


class CloudModel(ServedModel):
    """``{name}-cloud``: the cloud segment on edge features, FP32."""

    kind = "cloud"

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        m = self.runtime.manifest
        sample = tuple(m.cloud.inputs[0].sample_shape)
        return (TensorMeta(EDGE_FEATURES, "FP32", (-1, *sample),
                           _ranged(m.codec["edge_features"])),)

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.runtime.cloud(inputs[EDGE_FEATURES])


def _ranged(codec: str) -> dict[str, Any]:
    """The metadata parameters of an input whose values a codec made: their ``range``."""
    r = FeatureCodec(codec).value_range
    return {} if r is None else {"range": list(r)}


IMAGE_RANGE = (0.0, 1.0)  # the bundle's input range (the dataset file's)


def _images() -> dict[str, Any]:
    """The metadata parameters of an input of images: their ``range``."""
    return {"range": list(IMAGE_RANGE)}


class CloudPackedModel(CloudModel):
    """``{name}-cloud-packed``: the cloud segment on edge features packed in the bundle's edge
    codec, one UINT8 row of ``payload_size`` bytes per sample as
    :meth:`ddnn.codec.FeatureCodec.encode_rows` makes it; unpacked, exactly the FP32 features of
    ``{name}-cloud``. Only for a codec that packs (binary, int8, float16).

    Any bytes are a request: rows decode leniently (an all-zero int8 row is zeros; a value that
    would not be finite is clamped, NaN to 0), so a client that knows only the metadata — a load
    generator sending zeros or random bytes — gets an answer, as from the other kinds."""

    kind = "cloud-packed"

    @classmethod
    def serves(cls, manifest: Manifest) -> bool:
        return manifest.kind == "ddnn" and manifest.codec["edge_features"] in PACKING_CODECS

    def __init__(self, runtime: BundleRuntime):
        self.codec = FeatureCodec(runtime.manifest.codec["edge_features"])
        self.sample = tuple(runtime.manifest.cloud.inputs[0].sample_shape)
        super().__init__(runtime)

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        row = self.codec.payload_size(self.sample)
        return (TensorMeta(EDGE_FEATURES_PACKED, "UINT8", (-1, row), {
            "codec": self.codec.kind, "unpacked_name": EDGE_FEATURES,
            "unpacked_datatype": "FP32", "unpacked_shape": [-1, *self.sample]}),)

    def _unpack(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = arrays[EDGE_FEATURES_PACKED]
        if len(rows) * math.prod(self.sample) > MAX_ELEMENTS:  # 32× the bytes' worth of floats
            raise OipError(f"input {EDGE_FEATURES_PACKED!r}: {len(rows)} samples unpack to "
                           f"more than {MAX_ELEMENTS} values, the limit of one request")
        return {EDGE_FEATURES: self.codec.decode_rows(rows, self.sample, lenient=True)}


class FullModel(ServedModel):
    """``{name}-full``: every segment on raw views, the raw-offload path."""

    kind = "full"

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        m = self.runtime.manifest
        return (TensorMeta("views", "FP32", (-1, m.views, *m.input_shape), _images()),
                TensorMeta("present", "BOOL", (-1, m.views)))

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        # The hierarchy's cloud exit at the escalation level its calibration chose (level 1:
        # the escalated cloud, with every sender's detail), as ``ddnn evaluate`` reports it.
        # (Answers only: no byte counts, which would code every view's detail per request.)
        exits = self.runtime.all_exits(inputs["views"], inputs["present"], detail_bytes=False)
        return cloud_exit(exits, self.runtime.manifest.escalation_level)


def _check_range(meta: TensorMeta, x: np.ndarray) -> None:
    """Values outside the input's listed ``range`` (what the bundle's codecs or images can
    produce) are refused: far outside it the network's answer means nothing, or overflows."""
    bounds = meta.parameters.get("range")
    if bounds is None or not x.size:
        return
    lo, hi = bounds
    if x.min() < lo or x.max() > hi:
        raise OipError(f"input {meta.name!r} must hold values in [{lo:g}, {hi:g}] (what the "
                       "bundle's images or codec can produce: the metadata's parameters.range)")


class EscalatedModel(ServedModel):
    """``{name}-escalated``: the cloud's answer to an escalated frame, from the edge features
    and the senders' details (docs/training.md, "Escalation in the live tiers"). Both inputs
    are required in every request; an empty slot of ``device_detail`` holds zeros."""

    kind = "escalated"

    @classmethod
    def serves(cls, manifest: Manifest) -> bool:
        return manifest.kind == "ddnn" and manifest.escalated is not None

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        seg = self.runtime.manifest.escalated
        assert seg is not None  # serves() said so
        codec = self.runtime.manifest.codec
        return (TensorMeta(EDGE_FEATURES, "FP32", (-1, *seg.input(EDGE_FEATURES).sample_shape),
                           _ranged(codec["edge_features"])),
                TensorMeta(DEVICE_DETAIL, "FP32", (-1, *seg.input(DEVICE_DETAIL).sample_shape),
                           _ranged(codec["device_detail"])))

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.runtime.runner("escalated")(edge_features=inputs[EDGE_FEATURES],
                                                device_detail=inputs[DEVICE_DETAIL])["scores"]


class EscalatedPackedModel(EscalatedModel):
    """``{name}-escalated-packed``: ``{name}-escalated`` on its inputs packed, what the edge
    sends where the cloud serves it: the edge features as ``{name}-cloud-packed`` takes them,
    and the details one row per slot in the bundle's detail codec with ``detail_present``
    (:class:`~ddnn.packed_detail.DetailPacking`; 4-bit details take an eighth of their FP32
    bytes). Unpacked, exactly the FP32 inputs of ``{name}-escalated``; any bytes decode
    (leniently, as for ``{name}-cloud-packed``)."""

    kind = "escalated-packed"

    @classmethod
    def serves(cls, manifest: Manifest) -> bool:
        return (super().serves(manifest) and manifest.codec["edge_features"] in PACKING_CODECS
                and manifest.codec["device_detail"] in DETAIL_PACKING_CODECS)

    def __init__(self, runtime: BundleRuntime):
        m = runtime.manifest
        seg = m.escalated
        assert seg is not None  # serves() said so
        self.codec = FeatureCodec(m.codec["edge_features"])
        self.sample = tuple(seg.input(EDGE_FEATURES).sample_shape)
        self.detail = DetailPacking.of(m.codec["device_detail"],
                                       tuple(seg.input(DEVICE_DETAIL).sample_shape),
                                       m.escalation_views or m.views)
        super().__init__(runtime)

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        d = self.detail
        return (TensorMeta(EDGE_FEATURES_PACKED, "UINT8", (-1, self.codec.payload_size(
                    self.sample)), {"codec": self.codec.kind, "unpacked_name": EDGE_FEATURES,
                                    "unpacked_datatype": "FP32",
                                    "unpacked_shape": [-1, *self.sample]}),
                TensorMeta(DEVICE_DETAIL_PACKED, "UINT8", (-1, d.slots, d.row_bytes), {
                    "codec": d.codec.kind, "unpacked_name": DEVICE_DETAIL,
                    "unpacked_datatype": "FP32", "unpacked_shape": [-1, *d.sample_shape],
                    "presence": DETAIL_PRESENT}),
                TensorMeta(DETAIL_PRESENT, "BOOL", (-1, d.slots)))

    def _bound(self, frames: int) -> None:
        """Refuse a request whose frames unpack to more floats than one request may hold (up
        to 32× the bytes' worth): before any is unpacked."""
        values = math.prod(self.sample) + math.prod(self.detail.sample_shape)
        if frames * values > MAX_ELEMENTS:
            raise OipError(f"model {self.name}: {frames} frames unpack to more than "
                           f"{MAX_ELEMENTS} values, the limit of one request")

    def _unpack(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = arrays[EDGE_FEATURES_PACKED]
        self._bound(len(rows))
        return {EDGE_FEATURES: self.codec.decode_rows(rows, self.sample, lenient=True),
                DEVICE_DETAIL: self.detail.unpack(arrays[DEVICE_DETAIL_PACKED],
                                                  arrays[DETAIL_PRESENT])}


class EscalatedLeanModel(EscalatedPackedModel):
    """``{name}-escalated-lean``: ``{name}-escalated-packed`` in one input, ``escalated_frame``,
    each frame one row of the fixed layout its metadata lists
    (:class:`~ddnn.packed_detail.EscalatedFrame`: packed features, slot flags, filtered detail
    rows), so a frame answers on the lean route with no JSON either way. A body that is not a
    whole number of frames is a 400; any frame's bytes decode (leniently, as for
    ``{name}-escalated-packed``)."""

    kind = "escalated-lean"

    @functools.cached_property
    def frame(self) -> EscalatedFrame:
        """The layout: the packed model's parts, one row of bytes a frame."""
        return EscalatedFrame(self.codec, self.sample, self.detail)

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        return (TensorMeta(ESCALATED_FRAME, "UINT8", (-1, self.frame.frame_bytes),
                           self.frame.parameters()),)

    def _unpack(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        frames = arrays[ESCALATED_FRAME]
        self._bound(len(frames))
        try:
            features, detail = self.frame.unpack(frames)
        except CodecError as e:
            raise OipError(f"input {ESCALATED_FRAME!r}: {e}") from None
        return {EDGE_FEATURES: features, DEVICE_DETAIL: detail}


class RawModel(ServedModel):
    """``{name}-raw``: a raw-offload reference bundle's one model on every raw view (zeros for
    an absent view, as in the dataset file): what the hierarchy is judged against."""

    kind = "raw"

    @classmethod
    def serves(cls, manifest: Manifest) -> bool:
        return manifest.kind == "raw"

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        m = self.runtime.manifest
        return (TensorMeta("views", "FP32", (-1, m.views, *m.input_shape), _images()),)

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.runtime.scores(inputs["views"])


def _shape_hint(meta: TensorMeta) -> str:
    codec = meta.parameters.get("codec")
    if codec is None:
        return ""
    return (f" (one row of {meta.shape[-1]} bytes per sample: its FP32 "
            f"{meta.parameters['unpacked_shape'][1:]} features packed with the {codec} codec)")


MODEL_KINDS: tuple[type[ServedModel], ...] = (CloudModel, CloudPackedModel, FullModel,
                                               EscalatedModel, EscalatedPackedModel,
                                               EscalatedLeanModel, RawModel)
