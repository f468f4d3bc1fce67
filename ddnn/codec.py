"""Feature codec: how a tensor travels as bytes between tiers.

* ``binary``: 1 bit per value (sign; ``x > 0`` → 1), for the binarized device features of the
  paper, decoded to ±1;
* ``int8``: symmetric linear quantization, a float32 scale then one byte per value;
* ``float16`` / ``float32``: IEEE little-endian values;
* ``bits2`` / ``bits4``: 2 or 4 bits per value, the index of the nearest of 2**k levels evenly
  spaced over [−1, 1] (values outside are clamped), decoded to that level: the few-bit device
  features (``ddnn.models``' quantized activation produces exactly these levels). No level is
  0, so a present view's features never decode to all zeros.

The shape is not part of the payload: the message envelope carries it, and :meth:`decode` checks
that the byte count is exactly what the shape implies, so a truncated or padded payload is
rejected rather than misread.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from ddnn.errors import CodecError

CODECS = ("binary", "int8", "float16", "float32", "bits2", "bits4")  # append only: the wire
# format numbers codecs by their position here
LEVEL_BITS = {"bits2": 2, "bits4": 4}  # few-bit codecs: bits per value

# A bound on decoded tensors, so a lying header cannot make a receiver allocate gigabytes.
MAX_ELEMENTS = 1 << 24

_SCALE = struct.Struct("<f")
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def _elements(shape: tuple[int, ...]) -> int:
    if any((not isinstance(d, int | np.integer)) or d < 0 for d in shape):
        raise CodecError(f"invalid tensor shape {shape!r}")
    n = math.prod(int(d) for d in shape)
    if n > MAX_ELEMENTS:
        raise CodecError(f"tensor of {n} elements exceeds the limit of {MAX_ELEMENTS}")
    return n


def _level_bytes(x: np.ndarray, k: int) -> bytes:
    """Values (n,) → each value's nearest level index in ``k`` bits, most significant first,
    packed ``8 // k`` indices a byte (the last byte zero-padded): what ``np.packbits`` of the
    indices' bits gives, without spelling out the bits (a tenth of the work on a device)."""
    steps = 2**k - 1
    index = np.rint((np.clip(x, -1.0, 1.0) + 1.0) * (steps / 2)).astype(np.uint8)
    per = 8 // k
    pad = -len(index) % per
    if pad:
        index = np.concatenate([index, np.zeros(pad, np.uint8)])
    index = index.reshape(-1, per)
    packed = index[:, 0] << (8 - k)
    for j in range(1, per):
        packed |= index[:, j] << (8 - k * (j + 1))
    return packed.tobytes()


def _levels(bits: np.ndarray, k: int) -> np.ndarray:
    """Bits (..., k), most significant first → the levels they index, float32 in [−1, 1]."""
    weights = (1 << np.arange(k - 1, -1, -1)).astype(np.float32)
    index = bits.astype(np.float32) @ weights
    # The same float32 arithmetic as the quantizer in ddnn.models.network: identical levels.
    return index * np.float32(2 / (2**k - 1)) - np.float32(1.0)


@dataclass(frozen=True)
class FeatureCodec:
    """Encodes float tensors to bytes and back; ``kind`` is one of :data:`CODECS`."""

    kind: str = "binary"

    def __post_init__(self) -> None:
        if self.kind not in CODECS:
            raise CodecError(f"unknown codec {self.kind!r}; choose from {CODECS}")

    def payload_size(self, shape: tuple[int, ...]) -> int:
        """Exact byte count of an encoded tensor of this shape."""
        n = _elements(tuple(shape))
        if self.kind == "binary":
            return (n + 7) // 8
        if self.kind in LEVEL_BITS:
            return (n * LEVEL_BITS[self.kind] + 7) // 8
        if self.kind == "int8":
            return _SCALE.size + n
        return n * (2 if self.kind == "float16" else 4)

    @property
    def value_range(self) -> tuple[float, float] | None:
        """The interval every value this codec decodes to lies in, or None where only
        finiteness bounds it (int8, whose float32 scale is the sender's, and float32)."""
        if self.kind == "binary" or self.kind in LEVEL_BITS:
            return (-1.0, 1.0)
        if self.kind == "float16":
            top = float(np.finfo(np.float16).max)
            return (-top, top)
        return None

    def row_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes one row (the last axis) of a packed tensor of ``shape`` takes, or 0 where it
        has no rows or a row does not end on a byte (int8's rows sit after its 4-byte scale)."""
        if len(shape) < 2:
            return 0
        bits = 1 if self.kind == "binary" else LEVEL_BITS.get(self.kind, 0)
        bits = bits or {"int8": 8, "float16": 16, "float32": 32}[self.kind]
        n = int(shape[-1]) * bits
        return n // 8 if n % 8 == 0 else 0

    def encode(self, x: np.ndarray) -> bytes:
        """Pack a float tensor; raises :class:`CodecError` on NaN or infinity."""
        x = np.asarray(x, dtype=np.float32)
        if x.size > MAX_ELEMENTS:  # (an array's shape is valid: only its size is checked)
            raise CodecError(f"tensor of {x.size} elements exceeds the limit of {MAX_ELEMENTS}")
        if not np.isfinite(x).all():
            raise CodecError("cannot encode a tensor with NaN or infinite values")
        if self.kind == "binary":
            return np.packbits((x > 0).ravel()).tobytes()
        if self.kind in LEVEL_BITS:
            return _level_bytes(x.ravel(), LEVEL_BITS[self.kind])
        if self.kind == "int8":
            peak = float(np.abs(x).max()) if x.size else 0.0
            # The scale is stored as float32: keep it a normal number even for subnormal peaks.
            scale = max(float(np.float32(peak / 127.0)), float(np.finfo(np.float32).tiny))
            q = np.clip(np.rint(x / np.float32(scale)), -127, 127).astype(np.int8)
            return _SCALE.pack(scale) + q.tobytes()
        if self.kind == "float16":
            if x.size and float(np.abs(x).max()) > _FLOAT16_MAX:
                raise CodecError("value out of float16 range; use float32 or int8")
            return x.astype("<f2").tobytes()
        return x.astype("<f4").tobytes()

    def decode(self, payload: bytes, shape: tuple[int, ...]) -> np.ndarray:
        """Unpack to a float32 tensor of ``shape``; the byte count must match exactly."""
        shape = tuple(int(d) for d in shape)
        expected = self.payload_size(shape)
        if len(payload) != expected:
            raise CodecError(
                f"{self.kind} payload for shape {shape} must be {expected} bytes, "
                f"got {len(payload)}"
            )
        n = math.prod(shape)
        if self.kind == "binary":
            bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), count=n)
            return (bits.astype(np.float32) * 2.0 - 1.0).reshape(shape)
        if self.kind in LEVEL_BITS:
            k = LEVEL_BITS[self.kind]
            bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), count=n * k)
            return _levels(bits.reshape(n, k), k).reshape(shape)
        if self.kind == "int8":
            (scale,) = _SCALE.unpack_from(payload)
            if not math.isfinite(scale) or scale <= 0:
                raise CodecError(f"invalid int8 scale {scale!r}")
            q = np.frombuffer(payload, dtype=np.int8, offset=_SCALE.size)
            # Found by fuzzing: a scale near the float32 limit times 127 (or -128) overflows.
            peak = max(-int(q.min()), int(q.max())) if q.size else 0
            if scale * peak > float(np.finfo(np.float32).max):
                raise CodecError(f"int8 scale {scale!r} overflows float32")
            return (q.astype(np.float32) * np.float32(scale)).reshape(shape)
        dtype = "<f2" if self.kind == "float16" else "<f4"
        # A NaN widened to float32 warns "invalid value" on some CPUs (aarch64): it is refused
        # just below, so the warning says nothing more.
        with np.errstate(invalid="ignore"):
            x = np.frombuffer(payload, dtype=dtype).astype(np.float32).reshape(shape)
        if not np.isfinite(x).all():
            raise CodecError("decoded tensor holds NaN or infinite values")
        return x

    def encode_rows(self, x: np.ndarray) -> np.ndarray:
        """Pack each sample of a batch ``x`` (B, ...) alone: uint8 rows (B, payload_size)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim < 1:
            raise CodecError("rows need a batch axis")
        b, size = x.shape[0], self.payload_size(x.shape[1:])
        if self.kind == "binary":
            if not np.isfinite(x).all():
                raise CodecError("cannot encode a tensor with NaN or infinite values")
            return np.packbits(x.reshape(b, math.prod(x.shape[1:])) > 0, axis=1)
        return np.frombuffer(b"".join(self.encode(s) for s in x), np.uint8).reshape(b, size)

    def lossless_rows(self, x: np.ndarray) -> np.ndarray | None:
        """:meth:`encode_rows` of ``x`` (B, ...), or None when decoding the rows would not give
        back ``x`` bit for bit (values that did not come through this codec: a sender sends
        those as FP32 instead)."""
        try:
            rows = self.encode_rows(x)
            back = self.decode_rows(rows, x.shape[1:])
        except CodecError:
            return None
        return rows if back.tobytes() == np.asarray(x, np.float32).tobytes() else None

    def decode_rows(self, rows: np.ndarray, shape: tuple[int, ...], *, lenient: bool = False
                    ) -> np.ndarray:
        """The inverse of :meth:`encode_rows`, vectorised: equal to :meth:`decode` of each row.

        ``lenient``: every row of the right size decodes, for a server whose clients may send
        any bytes: an int8 scale may be zero or negative, and a value that would not be finite
        (a NaN or infinite scale or float16, a product past float32) is numpy's ``nan_to_num``
        of it (NaN → 0, ±∞ → ±float32 max) instead of a :class:`CodecError`."""
        shape = tuple(int(d) for d in shape)
        size, n = self.payload_size(shape), math.prod(shape)
        rows = np.asarray(rows)
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != size:
            raise CodecError(f"{self.kind} rows for samples of shape {shape} must be uint8 "
                             f"(B, {size}), got {rows.dtype} {rows.shape}")
        b = rows.shape[0]
        if self.kind == "binary":
            bits = np.unpackbits(rows, axis=1, count=n)
            return (bits.astype(np.float32) * 2.0 - 1.0).reshape(b, *shape)
        if self.kind in LEVEL_BITS:
            k = LEVEL_BITS[self.kind]
            bits = np.unpackbits(rows, axis=1, count=n * k)
            return _levels(bits.reshape(b, n, k), k).reshape(b, *shape)
        if self.kind == "int8":
            scales = np.ascontiguousarray(rows[:, :_SCALE.size]).view("<f4")[:, 0]
            q = np.ascontiguousarray(rows[:, _SCALE.size:]).view(np.int8)
            if lenient:
                with np.errstate(over="ignore", invalid="ignore"):
                    x = q.astype(np.float32) * scales.astype(np.float32)[:, None]
                return np.nan_to_num(x, copy=False).reshape(b, *shape)
            if not (np.isfinite(scales) & (scales > 0)).all():
                raise CodecError("invalid int8 scale (a row's first 4 bytes must be a finite "
                                 "positive float32)")
            if n:  # as in decode: a scale near the float32 limit times the peak overflows
                peak = np.maximum(-q.min(axis=1).astype(np.int64), q.max(axis=1))
                if (scales.astype(np.float64) * peak > float(np.finfo(np.float32).max)).any():
                    raise CodecError("an int8 scale overflows float32")
            return (q.astype(np.float32) * scales.astype(np.float32)[:, None]).reshape(b, *shape)
        dtype = "<f2" if self.kind == "float16" else "<f4"
        x = np.ascontiguousarray(rows).view(dtype).astype(np.float32).reshape(b, *shape)
        if lenient:
            return np.nan_to_num(x, copy=False)
        if not np.isfinite(x).all():
            raise CodecError("decoded tensor holds NaN or infinite values")
        return x
