"""The message envelope: one versioned, self-describing binary frame per MQTT or HTTP message.

Layout (little-endian; see ``docs/wire-protocol.md`` for the byte-by-byte table)::

    magic "DDNN" | u8 envelope version | u8 message type | u8 codec | u8 dtype | u8 ndim
    | u64 frame id | f64 timestamp (Unix seconds) | u32 payload length
    | 4 × (u8 length + UTF-8): model name, model version, deployment, device id
    | ndim × u32 shape | payload (the tensor packed by :class:`ddnn.codec.FeatureCodec`)

Decoding validates every field and raises :class:`DecodeError` (a :class:`CodecError`) for
anything else, so a receiver can count and drop a bad message with one ``except``.
"""

from __future__ import annotations

import enum
import math
import struct
import time
from dataclasses import dataclass

import numpy as np

from ddnn.codec import CODECS, FeatureCodec
from ddnn.errors import CodecError
from ddnn.names import RULE, is_name

MAGIC = b"DDNN"
VERSION = 1
MAX_MESSAGE = 1 << 20  # bytes: bounds what a sender can make a receiver hold or decode
MAX_NDIM = 8
MAX_STRING = 64
_HEADER = struct.Struct("<4sBBBBBQdI")
_DIM = struct.Struct("<I")
# Strings land in topics, logs and metric labels: a safe alphabet, no MQTT wildcards or slashes.
# Codec ids on the wire; 0 means "no tensor" (absent views, feature pulls without a mask).
_CODEC_IDS = {name: i + 1 for i, name in enumerate(CODECS)}
_CODEC_NAMES = {i: name for name, i in _CODEC_IDS.items()}
_DTYPES = {1: "float32"}  # what the decoded tensor is; the only one the segments take today


class DecodeError(CodecError):
    """Bytes that are not a valid envelope of this version."""


class MessageType(enum.IntEnum):
    """What a message carries."""

    SCORES = 1  # a device's class scores for one frame (B=1, C)
    FEATURES = 2  # a device's packed features for one frame (1, F, h, w)
    ABSENT = 3  # "this view sees nothing in this frame": no tensor, so nobody waits for it
    REQUEST = 4  # the edge pulls features of a frame; tensor = binary mask (V,) of views asked


@dataclass(frozen=True)
class Envelope:
    """One decoded message; ``payload`` holds the packed tensor bytes (empty for no tensor)."""

    kind: MessageType
    model: str
    version: str
    deployment: str
    device: str
    frame: int
    timestamp: float = 0.0
    codec: str | None = None
    shape: tuple[int, ...] = ()
    payload: bytes = b""
    dtype: str = "float32"

    @property
    def header_size(self) -> int:
        """Bytes of the envelope around the payload (counted apart from tensor bytes)."""
        strings = sum(1 + len(s.encode()) for s in self._strings())
        return _HEADER.size + strings + _DIM.size * len(self.shape)

    def _strings(self) -> tuple[str, str, str, str]:
        return (self.model, self.version, self.deployment, self.device)

    def tensor(self) -> np.ndarray:
        """The decoded float32 tensor; raises :class:`DecodeError` for a message without one."""
        if self.codec is None:
            raise DecodeError(f"{self.kind.name.lower()} message carries no tensor")
        try:
            return FeatureCodec(self.codec).decode(self.payload, self.shape)
        except DecodeError:
            raise
        except CodecError as e:
            raise DecodeError(str(e)) from None


def pack(
    kind: MessageType,
    *,
    model: str,
    version: str,
    deployment: str,
    device: str,
    frame: int,
    tensor: np.ndarray | None = None,
    codec: str | None = None,
    timestamp: float | None = None,
) -> Envelope:
    """Build an envelope, packing ``tensor`` with ``codec`` (both or neither)."""
    if (tensor is None) != (codec is None):
        raise CodecError("give both a tensor and its codec, or neither")
    payload, shape = b"", ()
    if tensor is not None:
        payload = FeatureCodec(codec).encode(tensor)
        shape = tuple(int(d) for d in np.shape(tensor))
    ts = time.time() if timestamp is None else float(timestamp)
    return Envelope(MessageType(kind), model, version, deployment, device, int(frame), ts,
                    codec, shape, payload)


def encode(env: Envelope) -> bytes:
    """Serialize an envelope; raises :class:`CodecError` for fields the format cannot hold."""
    strings = []
    for s in env._strings():
        _check_name(s, CodecError)
        strings.append(s.encode())
    if not 0 <= env.frame < 1 << 64:
        raise CodecError(f"frame id {env.frame} does not fit 64 bits")
    if len(env.shape) > MAX_NDIM:
        raise CodecError(f"tensor of {len(env.shape)} dimensions exceeds {MAX_NDIM}")
    codec_id = 0 if env.codec is None else _CODEC_IDS.get(env.codec)
    if codec_id is None:
        raise CodecError(f"unknown codec {env.codec!r}")
    header = _HEADER.pack(MAGIC, VERSION, int(env.kind), codec_id, 1, len(env.shape), env.frame,
                          env.timestamp, len(env.payload))
    parts = [header]
    for s in strings:
        parts += [bytes([len(s)]), s]
    parts += [_DIM.pack(d) for d in env.shape]
    parts.append(env.payload)
    data = b"".join(parts)
    if len(data) > MAX_MESSAGE:
        raise CodecError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    return data


def _check_name(s: str, error: type[CodecError]) -> None:
    if not is_name(s):
        raise error(f"invalid name {s!r:.80}: use {RULE}")


def decode(data: bytes) -> Envelope:
    """Parse and validate one message; raises :class:`DecodeError` on any inconsistency."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_MESSAGE:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    if len(data) < _HEADER.size:
        raise DecodeError(f"message of {len(data)} bytes is shorter than the header")
    magic, version, kind, codec_id, dtype, ndim, frame, ts, n_payload = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DecodeError("not a ddnn message (bad magic)")
    if version != VERSION:
        raise DecodeError(f"envelope version {version} is not supported (this is {VERSION})")
    try:
        kind = MessageType(kind)
    except ValueError:
        raise DecodeError(f"unknown message type {kind}") from None
    if codec_id != 0 and codec_id not in _CODEC_NAMES:
        raise DecodeError(f"unknown codec id {codec_id}")
    if dtype not in _DTYPES:
        raise DecodeError(f"unknown dtype id {dtype}")
    if ndim > MAX_NDIM:
        raise DecodeError(f"{ndim} dimensions exceed the limit of {MAX_NDIM}")
    if not math.isfinite(ts):
        raise DecodeError("timestamp is not a finite number")
    pos = _HEADER.size
    strings = []
    for _ in range(4):
        if pos >= len(data):
            raise DecodeError("message truncated inside its names")
        n = data[pos]
        pos += 1
        if n == 0 or n > MAX_STRING or pos + n > len(data):
            raise DecodeError(f"invalid name length {n}")
        try:
            s = data[pos : pos + n].decode("ascii")
        except UnicodeDecodeError:
            raise DecodeError("names must be ASCII") from None
        _check_name(s, DecodeError)
        strings.append(s)
        pos += n
    if pos + _DIM.size * ndim > len(data):
        raise DecodeError("message truncated inside its shape")
    shape = tuple(_DIM.unpack_from(data, pos + _DIM.size * i)[0] for i in range(ndim))
    pos += _DIM.size * ndim
    if len(data) - pos != n_payload:
        raise DecodeError(f"payload is {len(data) - pos} bytes, the header says {n_payload}")
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None:
        if ndim or n_payload:
            raise DecodeError("a message without a codec cannot carry a tensor")
    else:
        if ndim == 0:
            raise DecodeError("a tensor needs at least one dimension")
        try:
            expected = FeatureCodec(codec).payload_size(shape)
        except CodecError as e:
            raise DecodeError(str(e)) from None
        if expected != n_payload:
            raise DecodeError(
                f"{codec} payload for shape {shape} must be {expected} bytes, got {n_payload}"
            )
    return Envelope(kind, *strings, frame, ts, codec, shape, data[pos:], _DTYPES[dtype])
