"""The senders' details of an escalated frame, packed for the WAN link (issue 41, item 3).

The escalated model's FP32 ``device_detail`` (B, S·c, r, r) holds every slot's detail as it
left the bundle's detail codec, zeros in an empty slot: few-bit levels written as 32-bit
floats. Packed, each slot is one row of the detail codec's bytes (``bits4``: 384 B for a
3×16×16 view, an eighth of its FP32 bytes) and ``detail_present`` (B, S) says which slots hold
one; an empty slot's row is zeros, which deflate makes almost free. Both sides use
:class:`DetailPacking`: the edge packs only details that unpack to the same FP32 bits
(anything else travels as FP32), the cloud unpacks what it gets, so the escalated model reads
exactly what ``ddnn evaluate`` feeds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddnn.codec import LEVEL_BITS, FeatureCodec
from ddnn.errors import CodecError
from ddnn.oip_body import PACKING_CODECS

# Codecs whose details pack (every codec that codes in fewer bytes than FP32).
DETAIL_PACKING_CODECS = (*PACKING_CODECS, *LEVEL_BITS)


@dataclass(frozen=True)
class DetailPacking:
    """``slots`` details of ``view_shape`` (c, r, r) each, coded with ``codec``."""

    codec: FeatureCodec
    slots: int
    view_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.codec.kind not in DETAIL_PACKING_CODECS:
            raise CodecError(f"details coded {self.codec.kind!r} do not pack; packing codecs "
                             f"are {DETAIL_PACKING_CODECS}")
        if self.slots < 1 or not self.view_shape or min(self.view_shape) < 1:
            raise CodecError(f"invalid detail layout: {self.slots} slots of {self.view_shape}")

    @classmethod
    def of(cls, codec: str, sample_shape: tuple[int, ...], slots: int) -> DetailPacking:
        """The packing of FP32 details of ``sample_shape`` (S·c, r, r) in ``slots`` slots."""
        channels, *rest = (int(d) for d in sample_shape)
        if slots < 1 or channels % slots:
            raise CodecError(f"{channels} detail channels do not split into {slots} slots")
        return cls(FeatureCodec(codec), slots, (channels // slots, *rest))

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One frame's FP32 details: (S·c, r, r)."""
        c, *rest = self.view_shape
        return (self.slots * c, *rest)

    @property
    def row_bytes(self) -> int:
        """Bytes one slot's detail takes packed."""
        return self.codec.payload_size(self.view_shape)

    def pack(self, detail: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """FP32 details (B, S·c, r, r) → rows (B, S, row_bytes) and presence (B, S); None when
        unpacking would not give back ``detail`` bit for bit (details that did not come
        through this codec: those travel as FP32)."""
        detail = np.asarray(detail)
        if detail.dtype != np.float32 or detail.shape[1:] != self.sample_shape:
            return None
        b = len(detail)
        views = detail.reshape(b, self.slots, -1)
        present = views.any(axis=2)  # an empty slot holds zeros (a coded detail never does)
        rows = np.zeros((b, self.slots, self.row_bytes), np.uint8)
        try:
            rows[present] = self.codec.encode_rows(views[present].reshape(-1, *self.view_shape))
            back = self.unpack(rows, present, lenient=False)
        except CodecError:
            return None
        return (rows, present) if back.tobytes() == detail.tobytes() else None

    def unpack(self, rows: np.ndarray, present: np.ndarray, *, lenient: bool = True
               ) -> np.ndarray:
        """Rows (B, S, row_bytes) and presence (B, S) → FP32 details (B, S·c, r, r), zeros in
        an empty slot. ``lenient`` (the server's): any bytes decode
        (:meth:`~ddnn.codec.FeatureCodec.decode_rows`)."""
        rows, present = np.asarray(rows), np.asarray(present)
        if (rows.dtype != np.uint8 or rows.ndim != 3
                or rows.shape[1:] != (self.slots, self.row_bytes)
                or present.dtype != np.bool_ or present.shape != rows.shape[:2]):
            raise CodecError(f"packed details must be uint8 (B, {self.slots}, {self.row_bytes})"
                             f" with a bool presence (B, {self.slots}); got {rows.dtype} "
                             f"{rows.shape} and {present.dtype} {present.shape}")
        b = len(rows)
        values = math.prod(self.view_shape)
        out = np.zeros((b, self.slots, values), np.float32)
        decoded = self.codec.decode_rows(rows[present], self.view_shape, lenient=lenient)
        out[present] = decoded.reshape(len(decoded), values)  # (no slot present: 0 rows)
        return out.reshape(b, *self.sample_shape)
