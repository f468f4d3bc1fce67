"""The message envelope: exact round trips, and nothing but DecodeError on bad bytes."""

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from ddnn import envelope as env
from ddnn.codec import CODECS, FeatureCodec
from ddnn.envelope import MAX_MESSAGE, DecodeError, Envelope, MessageType
from ddnn.errors import CodecError

names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)
shapes = array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=8)


def _valid(kind=MessageType.SCORES, tensor=None, codec="float16", **kw) -> Envelope:
    if kind in (MessageType.ABSENT,):
        tensor = codec = None
    elif tensor is None:
        tensor = np.array([[0.5, -1.0, 2.0]], np.float32)
    ids = dict(model="tiny", version="1", deployment="default", device="cam0", frame=7)
    ids.update(kw)
    return env.pack(kind, tensor=tensor, codec=codec, timestamp=1.5, **ids)


@given(
    kind=st.sampled_from([MessageType.SCORES, MessageType.FEATURES, MessageType.REQUEST]),
    model=names, version=names, deployment=names, device=names,
    frame=st.integers(0, 2**64 - 1), ts=st.floats(allow_nan=False, allow_infinity=False),
    codec=st.sampled_from(CODECS),
    x=arrays(np.float32, shapes, elements=st.floats(-100, 100, width=32)),
)
def test_round_trip(kind, model, version, deployment, device, frame, ts, codec, x):
    e = env.pack(kind, model=model, version=version, deployment=deployment, device=device,
                 frame=frame, tensor=x, codec=codec, timestamp=ts)
    data = env.encode(e)
    assert len(data) == e.header_size + len(e.payload)
    d = env.decode(data)
    assert d == e
    expected = FeatureCodec(codec).decode(FeatureCodec(codec).encode(x), x.shape)
    np.testing.assert_array_equal(d.tensor(), expected)


def test_absent_has_no_tensor():
    e = _valid(MessageType.ABSENT)
    d = env.decode(env.encode(e))
    assert d.kind == MessageType.ABSENT and d.codec is None and d.payload == b""
    with pytest.raises(DecodeError):
        d.tensor()


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_decode_error(data):
    try:
        e = env.decode(data)
    except DecodeError:
        return
    if e.codec is not None:
        with contextlib.suppress(DecodeError):
            e.tensor()


@settings(max_examples=300)
@given(st.data())
def test_mutated_messages_raise_only_decode_error(data):
    kind = data.draw(st.sampled_from([MessageType.SCORES, MessageType.FEATURES,
                                      MessageType.ABSENT]))
    codec = data.draw(st.sampled_from(CODECS))
    msg = bytearray(env.encode(_valid(kind, np.ones((1, 4, 2, 2), np.float32), codec)))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "extend"]))
        if op == "flip" and msg:
            i = data.draw(st.integers(0, len(msg) - 1))
            msg[i] = data.draw(st.integers(0, 255))
        elif op == "cut" and msg:
            del msg[data.draw(st.integers(0, len(msg) - 1)):]
        else:
            msg += data.draw(st.binary(min_size=1, max_size=8))
    try:
        e = env.decode(bytes(msg))
        if e.codec is not None:
            e.tensor()
    except DecodeError:
        pass


def _header_fields(data: bytes) -> list:
    return list(struct.unpack_from("<4sBBBBBQdI", data))


def _repack(data: bytes, **changes) -> bytes:
    f = _header_fields(data)
    names_ = ["magic", "version", "kind", "codec", "dtype", "ndim", "frame", "ts", "n"]
    for k, v in changes.items():
        f[names_.index(k)] = v
    return struct.pack("<4sBBBBBQdI", *f) + data[struct.calcsize("<4sBBBBBQdI"):]


@pytest.mark.parametrize(("change", "message"), [
    ({"magic": b"XXXX"}, "magic"),
    ({"version": 9}, "version 9"),
    ({"kind": 99}, "message type"),
    ({"codec": 77}, "codec id"),
    ({"dtype": 5}, "dtype"),
    ({"ndim": 9}, "dimensions"),
    ({"ts": float("nan")}, "timestamp"),
    ({"n": 5}, "header says"),
])
def test_each_header_field_is_checked(change, message):
    data = env.encode(_valid())
    with pytest.raises(DecodeError, match=message):
        env.decode(_repack(data, **change))


def test_shape_must_match_payload():
    e = _valid()
    bad = Envelope(e.kind, e.model, e.version, e.deployment, e.device, e.frame, e.timestamp,
                   e.codec, (1, 4), e.payload)
    with pytest.raises(DecodeError, match="must be 8 bytes"):
        env.decode(env.encode(bad))


def test_oversized_messages_are_refused_both_ways():
    with pytest.raises(DecodeError, match="exceeds"):
        env.decode(b"DDNN" + bytes(MAX_MESSAGE))
    with pytest.raises(CodecError, match="exceeds"):
        env.encode(_valid(MessageType.FEATURES, np.ones((1, MAX_MESSAGE), np.float32), "float32"))


def test_names_are_validated():
    with pytest.raises(CodecError, match="invalid name"):
        env.encode(_valid(device="cam/0"))
    data = env.encode(_valid(device="camx"))
    i = data.index(b"camx")
    with pytest.raises(DecodeError, match="invalid name"):
        env.decode(data[:i] + b"ca+x" + data[i + 4:])


def test_decode_error_is_a_codec_error():
    assert issubclass(DecodeError, CodecError)
    with pytest.raises(CodecError):
        env.decode(b"")
