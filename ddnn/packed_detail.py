"""The senders' details of an escalated frame, packed for the WAN link (issue 41, item 3).

The escalated model's FP32 ``device_detail`` (B, S·c, r, r) holds every slot's detail as it
left the bundle's detail codec, zeros in an empty slot: few-bit levels written as 32-bit
floats. Packed, each slot is one row of the detail codec's bytes (``bits4``: 384 B for a
3×16×16 view, an eighth of its FP32 bytes) and ``detail_present`` (B, S) says which slots hold
one; an empty slot's row is zeros, which deflate makes almost free. Both sides use
:class:`DetailPacking`: the edge packs only details that unpack to the same FP32 bits
(anything else travels as FP32), the cloud unpacks what it gets, so the escalated model reads
exactly what ``ddnn evaluate`` feeds it.

:class:`EscalatedFrame` is the lean route's layout of a whole escalated frame in one row of
bytes (docs/cloud.md, "Escalated frames"): the packed edge features, a byte per slot saying
whether it holds a detail, then the slots' detail rows through the *average* filter
(:meth:`DetailPacking.filter`), which deflate codes in about a quarter fewer bytes, losslessly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ddnn.codec import LEVEL_BITS, FeatureCodec
from ddnn.errors import CodecError
from ddnn.oip_body import (
    DETAIL_PRESENT,
    DEVICE_DETAIL_PACKED,
    EDGE_FEATURES_PACKED,
    ESCALATED_FRAME,
    PACKING_CODECS,
)

# Codecs whose details pack (every codec that codes in fewer bytes than FP32).
DETAIL_PACKING_CODECS = (*PACKING_CODECS, *LEVEL_BITS)
# Codecs whose rows are levels of a few bits (bits per value), which the average filter applies to.
FILTER_BITS = {"binary": 1, **LEVEL_BITS}
# The lean layout's name in the escalated frame's metadata (a change of layout changes it).
FRAME_LAYOUT = "ddnn-escalated-frame-1"


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

    def filter(self, rows: np.ndarray) -> np.ndarray:
        """Rows (..., row_bytes) with each level replaced by its difference (modulo the codec's
        levels) from a prediction: the mean (rounded down) of the level to its left and the one
        above it in the same channel; in the first image row the level to its left, in the first
        column the one above, the first level itself. A smooth detail's differences are small,
        so deflate codes them in fewer bits (measured on 64 test frames of 4-bit details: 899 B
        deflated against 1,212 B). Lossless (:meth:`unfilter`); rows of codecs without levels
        (int8, float16) are returned as they are."""
        return self._filtered(rows, inverse=False)

    def unfilter(self, rows: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`filter`; any bytes unfilter (padding bits come back zero)."""
        return self._filtered(rows, inverse=True)

    def _filtered(self, rows: np.ndarray, *, inverse: bool) -> np.ndarray:
        k = FILTER_BITS.get(self.codec.kind)
        rows = np.asarray(rows)
        if k is None or not rows.size:
            return rows
        n = math.prod(self.view_shape)
        h, w = self.view_shape[-2:] if len(self.view_shape) > 1 else (1, n)
        flat = rows.reshape(-1, self.row_bytes)
        shifts = np.arange(8 - k, -1, -k, dtype=np.uint8)  # a byte's levels, first one highest
        mask = (1 << k) - 1
        levels = ((flat[:, :, None] >> shifts) & mask).reshape(len(flat), -1)[:, :n]
        # One image per channel; uint8 throughout: a sum of two levels fits, and a difference
        # wraps modulo 256, a multiple of the levels' count.
        levels = levels.reshape(-1, h * w)
        first, second, diagonals = _neighbours(h, w)
        # Each image with a zero first, so a level with no neighbour is predicted 0.
        out = np.zeros((len(levels), 1 + h * w), np.uint8)
        if inverse:  # a level's prediction needs the levels it is made of: one anti-diagonal
            for at in diagonals:  # at a time (h + w - 1 steps of whole arrays, not h·w)
                guess = (out[:, first[at]] + out[:, second[at]]) >> 1
                out[:, 1 + at] = (levels[:, at] + guess) & mask
        else:
            out[:, 1:] = levels
            out[:, 1:] = (levels - ((out[:, first] + out[:, second]) >> 1)) & mask
        coded = np.zeros((len(flat), self.row_bytes * (8 // k)), np.uint8)
        coded[:, :n] = out[:, 1:].reshape(len(flat), n)
        packed = np.bitwise_or.reduce(coded.reshape(len(flat), -1, 8 // k) << shifts, axis=2)
        return packed.astype(np.uint8).reshape(rows.shape)


@functools.cache
def _neighbours(h: int, w: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """For each level of an h × w image (row-major), the two levels whose mean (rounded down)
    predicts it, as indices into the image behind one zero: left and above, or in the first
    row the left one twice, in the first column the one above twice, 0 for the first level;
    and the levels of each anti-diagonal, top left first."""
    i, j = (a.ravel() for a in np.mgrid[0:h, 0:w])
    left, above = 1 + i * w + j - 1, 1 + (i - 1) * w + j
    first = np.where(j > 0, left, np.where(i > 0, above, 0))
    second = np.where(i > 0, above, first)
    return first, second, [np.flatnonzero(i + j == d) for d in range(h + w - 1)]


@dataclass(frozen=True)
class _EscalatedParts:
    """An escalated frame's parts: the edge features of ``features_shape`` coded with
    ``features``, one row a frame, and the details packed by ``detail``."""

    features: FeatureCodec
    features_shape: tuple[int, ...]
    detail: DetailPacking

    @property
    def features_bytes(self) -> int:
        return self.features.payload_size(self.features_shape)

    def packed(self, features: np.ndarray, detail: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """FP32 edge features (B, ...) and details (B, S·c, r, r) → feature rows, detail rows
        and presence, or None when either would not unpack to the bits given."""
        x = np.asarray(features)
        if x.dtype != np.float32 or x.shape[1:] != self.features_shape or len(x) != len(detail):
            return None
        rows, details = self.features.lossless_rows(x), self.detail.pack(detail)
        return None if rows is None or details is None else (rows, *details)


class EscalatedInputs(_EscalatedParts):
    """The inputs of ``{name}-escalated-packed``: the parts as three v2 tensors."""

    def pack(self, features: np.ndarray, detail: np.ndarray) -> dict[str, np.ndarray] | None:
        """The model's inputs by name, or None (as :meth:`packed`)."""
        packed = self.packed(features, detail)
        names = (EDGE_FEATURES_PACKED, DEVICE_DETAIL_PACKED, DETAIL_PRESENT)
        return None if packed is None else dict(zip(names, packed, strict=True))

    @classmethod
    def from_metadata(cls, metadata: dict) -> EscalatedInputs:
        """The inputs a ``{name}-escalated-packed`` model's metadata lists; :class:`CodecError`
        for metadata this side cannot read."""
        try:
            features, detail, present = metadata["inputs"]
            fp, dp = features["parameters"], detail["parameters"]
            inputs = cls(FeatureCodec(fp["codec"]),
                         tuple(int(v) for v in fp["unpacked_shape"][1:]),
                         DetailPacking.of(dp["codec"], tuple(dp["unpacked_shape"][1:]),
                                          int(present["shape"][1])))
            d = inputs.detail
            known = [(t["name"], t["datatype"], t["shape"]) for t in (features, detail, present)]
            batches = [fp["unpacked_shape"][0], dp["unpacked_shape"][0]]
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise CodecError(f"unreadable escalated inputs metadata: {e!r}") from None
        if known != [(EDGE_FEATURES_PACKED, "UINT8", [-1, inputs.features_bytes]),
                     (DEVICE_DETAIL_PACKED, "UINT8", [-1, d.slots, d.row_bytes]),
                     (DETAIL_PRESENT, "BOOL", [-1, d.slots])] or batches != [-1, -1]:
            raise CodecError(f"escalated inputs this side does not know: {known}")
        return inputs


class EscalatedFrame(_EscalatedParts):
    """One escalated frame as one row of ``frame_bytes`` bytes, the lean route's layout: the edge
    features coded with ``features`` (``features_bytes``), one byte per slot (1: the slot holds a
    detail, 0: it does not), then every slot's detail row (:class:`DetailPacking`) through
    :meth:`DetailPacking.filter`, an empty slot's zeros."""

    @property
    def frame_bytes(self) -> int:
        return self.features_bytes + self.detail.slots * (1 + self.detail.row_bytes)

    def pack(self, features: np.ndarray, detail: np.ndarray) -> np.ndarray | None:
        """FP32 edge features (B, ...) and details (B, S·c, r, r) → frames (B, frame_bytes), or
        None when either would not unpack to the bits given."""
        packed = self.packed(features, detail)
        if packed is None:
            return None
        rows, slots, present = packed
        return np.concatenate([rows, present.astype(np.uint8),
                               self.detail.filter(slots).reshape(len(rows), -1)], axis=1)

    def unpack(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Frames (B, frame_bytes) → FP32 edge features and details; :class:`CodecError` for
        frames of another size. Any bytes decode, leniently (a slot flag other than 0 reads
        as 1), so a client that knows only the metadata gets an answer, as from every model."""
        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 2 or frames.shape[1] != self.frame_bytes:
            raise CodecError(f"escalated frames must be uint8 (B, {self.frame_bytes}): features "
                             f"{self.features_bytes} B, {self.detail.slots} slot flags, "
                             f"{self.detail.slots} detail rows of {self.detail.row_bytes} B; "
                             f"got {frames.dtype} {frames.shape}")
        f, s = self.features_bytes, self.detail.slots
        rows = self.detail.unfilter(frames[:, f + s:].reshape(len(frames), s, -1))
        features = self.features.decode_rows(frames[:, :f], self.features_shape, lenient=True)
        return features, self.detail.unpack(rows, frames[:, f:f + s] != 0)

    def parameters(self) -> dict:
        """The layout as the frame's metadata lists it (what :meth:`advertised` reads)."""
        d = self.detail
        return {"layout": FRAME_LAYOUT, "features_codec": self.features.kind,
                "features_shape": [-1, *self.features_shape], "detail_codec": d.codec.kind,
                "detail_shape": [-1, *d.sample_shape], "slots": d.slots,
                "detail_filter": "average" if d.codec.kind in FILTER_BITS else "none"}

    @classmethod
    def from_metadata(cls, metadata: dict) -> EscalatedFrame:
        """The layout of a ``{name}-escalated-lean`` model's metadata, which must take it in
        its one input and answer FP32 scores first on the lean route; :class:`CodecError`
        otherwise."""
        try:
            (meta,) = metadata["inputs"]
            first = metadata["outputs"][0]
            batch, frame_bytes = meta["shape"]
            lean = (metadata.get("parameters") or {}).get("lean") is True
            known = (meta["name"] == ESCALATED_FRAME and meta["datatype"] == "UINT8"
                     and batch == -1 and first["name"] == "scores" and first["datatype"] == "FP32")
            params = meta["parameters"]
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise CodecError(f"unreadable escalated frame metadata: {e!r}") from None
        if not (lean and known and isinstance(params, dict)):
            raise CodecError("the metadata lists no lean escalated frame input")
        return cls.advertised(params, frame_bytes)

    @classmethod
    def advertised(cls, params: dict, frame_bytes: int) -> EscalatedFrame:
        """The layout a frame's metadata lists; :class:`CodecError` for one this side does not
        know, or whose sizes disagree with ``frame_bytes``."""
        try:
            _, *features = params["features_shape"]
            _, *detail = params["detail_shape"]
            frame = cls(FeatureCodec(params["features_codec"]), tuple(int(v) for v in features),
                        DetailPacking.of(params["detail_codec"], tuple(detail),
                                         int(params["slots"])))
        except (KeyError, TypeError, ValueError) as e:
            raise CodecError(f"unreadable escalated frame layout: {e!r}") from None
        if params.get("layout") != FRAME_LAYOUT or params != frame.parameters():
            raise CodecError(f"an escalated frame layout this side does not know: {params}")
        if frame.frame_bytes != frame_bytes:
            raise CodecError(f"the escalated frame layout takes {frame.frame_bytes} bytes, not "
                             f"{frame_bytes}")
        return frame
