"""The two kinds of model the cloud serves for each bundle.

* ``{name}-cloud``: edge features (as the edge aggregator forwards them, already through the
  bundle's edge codec) → cloud exit scores and their normalized entropy;
* ``{name}-full``: raw views with a presence mask → the cloud exit computed through every segment,
  exactly as :meth:`ddnn.runtime.BundleRuntime.all_exits` does (the raw-offload path).

Each kind is one class with the LitServe shape: ``decode`` validates a request's tensors (user
errors raise :class:`~ddnn.oip.OipError`), ``predict`` runs a whole batch off the event loop, and
``encode`` picks the outputs the request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ddnn.errors import CodecError
from ddnn.exits import entropy_of_logits
from ddnn.oip import DATATYPES, InferRequest, OipError, json_array_limit
from ddnn.runtime import BundleRuntime

PLATFORM = "onnxruntime_onnx"


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as the protocol's metadata describes it; ``-1`` marks the batch axis."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


class ServedModel:
    """One servable model of one bundle version."""

    kind: ClassVar[str] = ""

    def __init__(self, runtime: BundleRuntime):
        self.runtime = runtime
        m = runtime.manifest
        self.bundle_name = m.name
        self.name = f"{m.name}-{self.kind}"
        self.version = m.version
        c = m.num_classes
        self.inputs: tuple[TensorMeta, ...] = self._input_meta()
        self.outputs = (TensorMeta("scores", "FP32", (-1, c)), TensorMeta("entropy", "FP32", (-1,)))

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        raise NotImplementedError

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

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
            "parameters": {"bundle": self.bundle_name,
                           "classes": list(self.runtime.manifest.classes)},
        }

    # --- decode → predict → encode ------------------------------------------------------------

    def decode(self, request: InferRequest) -> tuple[dict[str, np.ndarray], int]:
        """Check the request's tensors against the model; returns them and the batch size."""
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
                               f"size), got {list(x.shape)}")
            if batch is not None and x.shape[0] != batch:
                raise OipError(f"inputs disagree on the batch size ({batch} vs {x.shape[0]})")
            batch = x.shape[0]
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                raise OipError(f"input {meta.name!r} holds NaN or infinite values")
            arrays[meta.name] = x
        if not batch:
            raise OipError("a request must hold at least one sample (batch size 0)")
        self._check(arrays)
        if request.outputs is not None:
            names = {t.name for t in self.outputs}
            for name in request.outputs:
                if name not in names:
                    raise OipError(f"model {self.name} has no output {name!r}; its outputs are "
                                   f"{sorted(names)}")
        return arrays, batch

    def _check(self, arrays: dict[str, np.ndarray]) -> None:
        """Checks of a kind beyond names, datatypes and shapes."""

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a batch (called in a worker thread); returns every output."""
        try:
            scores = np.asarray(self._scores(inputs), dtype=np.float32)
        except CodecError as e:  # e.g. scores too large for a float16 link: the input's doing
            raise OipError(f"model {self.name} cannot process this input: {e}") from None
        return {"scores": scores, "entropy": entropy_of_logits(scores).astype(np.float32)}

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def encode(self, request: InferRequest, outputs: dict[str, np.ndarray]
               ) -> dict[str, np.ndarray]:
        """The outputs the request asked for, in its order (all of them when it named none)."""
        names = request.outputs if request.outputs is not None else [t.name for t in self.outputs]
        return {n: outputs[n] for n in names}


class CloudModel(ServedModel):
    """``{name}-cloud``: the cloud segment on edge features."""

    kind = "cloud"

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        spec = self.runtime.manifest.cloud.inputs[0]
        return (TensorMeta("edge_features", "FP32", (-1, *spec.sample_shape)),)

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.runtime.cloud(inputs["edge_features"])


class FullModel(ServedModel):
    """``{name}-full``: every segment on raw views, the raw-offload path."""

    kind = "full"

    def _input_meta(self) -> tuple[TensorMeta, ...]:
        m = self.runtime.manifest
        return (TensorMeta("views", "FP32", (-1, m.views, *m.input_shape)),
                TensorMeta("present", "BOOL", (-1, m.views)))

    def _check(self, arrays: dict[str, np.ndarray]) -> None:
        views = arrays["views"]
        if views.size and (views.min() < 0.0 or views.max() > 1.0):
            raise OipError("input 'views' must hold image values in [0, 1] (the bundle's input "
                           "range)")

    def _scores(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.runtime.all_exits(inputs["views"], inputs["present"])["cloud"]


MODEL_KINDS: tuple[type[ServedModel], ...] = (CloudModel, FullModel)
