"""A bundle's segment files and their tensors: what the manifest says of each ONNX file."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddnn.errors import BundleError

# The first dimension of every segment tensor is the batch, left dynamic in the ONNX files.
BATCH = "batch"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# The element types a segment's tensors may have (the runtime feeds and reads these).
TENSOR_DTYPES = ("float32", "float16", "int8", "uint8", "int64", "bool")


def expect_shape(tensor: TensorSpec, shape: tuple[int, ...], what: str) -> None:
    if tensor.sample_shape != tuple(shape):
        raise BundleError(f"{what} has per-sample shape {tensor.sample_shape}, expected "
                          f"{tuple(shape)}")


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor of a segment; ``shape`` uses ``"batch"`` for the dynamic first axis."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str = "float32"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        name, shape, dtype = str(d["name"]), d["shape"], str(d.get("dtype", "float32"))
        # A dynamic batch axis, then positive sizes: what every tier allocates buffers from.
        if (not isinstance(shape, list) or not shape or shape[0] != "batch"
                or not all(type(x) is int and x > 0 for x in shape[1:])):
            raise BundleError(f"tensor {name!r} has shape {shape!r}; expected "
                              "[\"batch\", positive sizes...]")
        if dtype not in TENSOR_DTYPES:
            raise BundleError(f"tensor {name!r} has dtype {dtype!r}; expected one of "
                              f"{TENSOR_DTYPES}")
        return cls(name, tuple(shape), dtype)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample (the batch axis dropped)."""
        return tuple(int(d) for d in self.shape[1:])


@dataclass(frozen=True)
class SegmentSpec:
    """One ONNX file of the bundle with its input and output tensors."""

    file: str
    sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # The file's size in bytes (manifests written since it was added; None in older ones).
    # Downloads are capped by it; the sha256 alone decides whether the file is intact.
    size: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentSpec:
        size = d.get("size")
        if size is not None and (type(size) is not int or size < 0):
            raise BundleError(f"segment {d.get('file')!r} has size {size!r}; expected a "
                              "non-negative integer")
        return cls(
            file=str(d["file"]),
            sha256=str(d["sha256"]),
            inputs=tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_dict(t) for t in d["outputs"]),
            size=size,
        )

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise BundleError(f"segment {self.file} has no input {name!r}")

    def output(self, name: str) -> TensorSpec:
        for t in self.outputs:
            if t.name == name:
                return t
        raise BundleError(f"segment {self.file} has no output {name!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.size is None:  # an older manifest re-written stays as it was
            del d["size"]
        return d
