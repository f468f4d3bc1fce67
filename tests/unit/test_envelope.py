"""The message envelope: exact round trips, and nothing but DecodeError on bad bytes."""

import contextlib
import zlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from ddnn import envelope as env
from ddnn.codec import CODECS, FeatureCodec
from ddnn.deflate import wire_size
from ddnn.envelope import MAX_MESSAGE, DecodeError, Envelope, MessageType
from ddnn.errors import CodecError

names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)
shapes = array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=8)


def _valid(kind=MessageType.SCORES, tensor=None, codec="float16", **kw) -> Envelope:
    if kind in (MessageType.ABSENT,):
        tensor = codec = None
    elif tensor is None:
        tensor = np.array([[0.5, -1.0, 2.0]], np.float32)
    ids = dict(model="tiny", version="1", deployment="default", device="cam0", frame=7,
               timestamp=1.7e9)
    ids.update(kw)
    return env.pack(kind, tensor=tensor, codec=codec, **ids)


@given(
    kind=st.sampled_from([MessageType.SCORES, MessageType.FEATURES, MessageType.REQUEST]),
    model=names, version=names, deployment=names, device=names, identity=st.booleans(),
    frame=st.integers(0, 2**64 - 1), ts=st.floats(1e9, 4e9), codec=st.sampled_from(CODECS),
    x=arrays(np.float32, shapes, elements=st.floats(-100, 100, width=32)),
    deflate=st.booleans(),
)
def test_round_trip(kind, model, version, deployment, device, identity, frame, ts, codec, x,
                    deflate):
    ids = dict(model=model, deployment=deployment, device=device) if identity else {}
    e = env.pack(kind, version=version, frame=frame, tensor=x, codec=codec, timestamp=ts,
                 deflate=deflate, **ids)
    data = env.encode(e)
    d = env.decode(data, now=ts + 3600)  # an hour in flight: still placed exactly
    assert d.deflate <= e.deflate  # deflated only where asked (and where shorter)
    assert d == replace(e, timestamp=d.timestamp, deflate=d.deflate)
    assert abs(d.timestamp - ts) <= env.TICK / 2 + 1e-6
    assert env.encode(d) == data
    expected = FeatureCodec(codec).decode(FeatureCodec(codec).encode(x), x.shape)
    np.testing.assert_array_equal(d.tensor(x.shape), expected)


def test_a_compact_scores_message_is_small():
    """Version, frame and time only: the topic and the status say the rest."""
    e = env.pack(MessageType.SCORES, version="1", frame=1234, timestamp=1.7e9,
                 tensor=np.zeros((1, 3), np.float32), codec="float16")
    data = env.encode(e)
    assert len(data) == 2 + 2 + 4 + 2 + 6  # format+type, frame varint, time, version, payload
    assert env.decode(data).device is None
    bound = env.decode(data).bound(model="tiny", deployment="d", device="cam0")
    assert (bound.model, bound.deployment, bound.device) == ("tiny", "d", "cam0")


def test_the_capture_time_wraps_and_is_placed_near_the_receivers_clock():
    wrap = (1 << 32) * env.TICK
    for now in (1.7e9, 1.7e9 + wrap / 2 - 10, 1.7e9 - wrap / 2 + 10):
        data = env.encode(_valid(timestamp=1.7e9))
        assert env.decode(data, now=now).timestamp == pytest.approx(1.7e9, abs=1e-4)


def test_version_1_messages_are_refused_by_name():
    v1 = b"DDNN\x01" + bytes(40)
    with pytest.raises(DecodeError, match="envelope version 1 .*no longer accepted"):
        env.decode(v1)


def test_absent_has_no_tensor():
    e = _valid(MessageType.ABSENT)
    d = env.decode(env.encode(e))
    assert d.kind == MessageType.ABSENT and d.codec is None and d.payload == b""
    with pytest.raises(DecodeError):
        d.tensor((1, 3))


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_decode_error(data):
    try:
        e = env.decode(data)
    except DecodeError:
        return
    if e.codec is not None:
        with contextlib.suppress(DecodeError):
            e.tensor((1, 3))


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
            e.tensor((1, 4, 2, 2))
    except DecodeError:
        pass


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"XX", "bad format byte"),
    (bytes([0xD9, 1]), "envelope version 9 is not supported"),
    (bytes([0xD2]), "truncated inside its header"),
    (bytes([0xD2, 0x30]), "message type 0"),
    (bytes([0xD2, 0x71]), "codec id 7"),
    (bytes([0xD2, 0xF1]), "codec id 7"),  # the deflate flag does not make an unknown codec
    (bytes([0xD2, 0x83, 7, 0, 0, 0, 0, 1]) + b"1x", "without a codec"),
    (bytes([0xD2, 0x95, 7, 0, 0, 0, 0, 1]) + b"1\x00\xff\xff\xff", "invalid deflate stream"),
    (bytes([0xD2, 0x95, 7, 0, 0, 0, 0, 1]) + b"1\x00" + zlib.compress(b"x")[2:-4] + b"!",
     "follow the deflate stream"),
    (bytes([0xD2, 0x95, 7, 0, 0, 0, 0, 1]) + b"1\x00" + zlib.compress(b"")[2:-4],
     "needs a payload"),
    (bytes([0xD2, 0x95, 7, 0, 0, 0, 0, 1]) + b"1", "needs a payload"),
    (bytes([0xD2, 0x31, 0x80]), "truncated inside its frame id"),
    (bytes([0xD2, 0x31]) + b"\xff" * 11, "longer than 10 bytes"),
    (bytes([0xD2, 0x31, 0x80, 0x00]), "not minimal"),
    (bytes([0xD2, 0x31, 7, 0, 0]), "truncated inside its capture time"),
    (bytes([0xD2, 0x31, 7, 0, 0, 0, 0, 0]), "invalid model version length 0"),
    (bytes([0xD2, 0x31, 7, 0, 0, 0, 0, 1]) + b"+", "invalid model version"),
    (bytes([0xD2, 0x31, 7, 0, 0, 0, 0, 1]) + b"1", "needs a payload"),
    (bytes([0xD2, 0x03, 7, 0, 0, 0, 0, 1]) + b"1x", "without a codec"),
    (bytes([0xD2, 0x0B, 7, 0, 0, 0, 0, 1]) + b"1\x04tiny", "truncated inside its deployment"),
])
def test_each_field_is_checked(data, message):
    with pytest.raises(DecodeError, match=message):
        env.decode(data)


def test_the_payload_size_is_checked_against_the_shape_the_receiver_expects():
    d = env.decode(env.encode(_valid()))
    with pytest.raises(DecodeError, match="must be 8 bytes"):
        d.tensor((1, 4))


def test_oversized_messages_are_refused_both_ways():
    with pytest.raises(DecodeError, match="exceeds"):
        env.decode(bytes([env.FORMAT]) + bytes(MAX_MESSAGE))
    with pytest.raises(CodecError, match="exceeds"):
        env.encode(_valid(MessageType.FEATURES, np.ones((1, MAX_MESSAGE), np.float32), "float32"))


def test_names_are_validated():
    with pytest.raises(CodecError, match="invalid name"):
        env.encode(_valid(device="cam/0"))
    data = env.encode(_valid(device="camx"))
    i = data.index(b"camx")
    with pytest.raises(DecodeError, match="invalid device"):
        env.decode(data[:i] + b"ca+x" + data[i + 4:])


def test_decode_error_is_a_codec_error():
    assert issubclass(DecodeError, CodecError)
    with pytest.raises(CodecError):
        env.decode(b"")


@pytest.mark.parametrize("frame", [0, 1, 127, 128, 300, 2**40, 2**64 - 1])
def test_the_frame_header_is_read_in_place(frame):
    data = env.encode(env.pack(MessageType.ABSENT, version="1", frame=frame, timestamp=1234.5))
    got, at = env.frame_header(data)
    assert got == frame
    assert int.from_bytes(data[at : at + 4], "little") == round(1234.5 / env.TICK) % 2**32
    with pytest.raises(DecodeError):
        env.frame_header(data[:2])


def test_a_detail_travels_deflated_where_that_is_shorter():
    ramp = np.linspace(-1, 1, 3 * 16 * 16, dtype=np.float32).reshape(1, 3, 16, 16)
    e = _valid(MessageType.DETAIL, tensor=ramp, codec="bits4", deflate=True)
    data = env.encode(e)
    plain = env.encode(replace(e, deflate=False))
    assert len(data) < len(plain) - 100  # a ramp of 16 levels repeats
    at = env.payload_offset(data)
    assert data[:at] != plain[:at] and e.row == 8 and len(data) - at == wire_size(e.payload, 8)
    d = env.decode(data)
    assert d.deflate and d.payload == e.payload and env.encode(d) == data
    noise = np.random.default_rng(0).uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)
    e = _valid(MessageType.DETAIL, tensor=noise, codec="bits4", deflate=True)
    assert env.encode(e) == env.encode(replace(e, deflate=False))  # noise never grows
    assert not env.decode(env.encode(e)).deflate


def test_a_deflate_bomb_is_refused_without_inflating_it():
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = bomb.compress(bytes(8 * MAX_MESSAGE)) + bomb.flush()
    assert len(stream) < 16 * 1024
    data = bytes([0xD2, 0x95, 7, 0, 0, 0, 0, 1]) + b"1\x08" + stream
    with pytest.raises(DecodeError, match="past the limit"):
        env.decode(data)


def test_the_payload_offset_skips_the_identity():
    e = _valid()
    data = env.encode(e)
    assert data[env.payload_offset(data):] == e.payload
    bare = env.encode(replace(e, model=None, deployment=None, device=None))
    assert bare[env.payload_offset(bare):] == e.payload
