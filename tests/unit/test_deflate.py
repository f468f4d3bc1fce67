"""Raw DEFLATE on the wire: a payload never grows, and inflating is bounded and strict."""

import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddnn.deflate import deflated, inflate, wire_size
from ddnn.errors import CodecError


@given(st.binary(max_size=2048))
def test_round_trip_and_never_longer(payload):
    data = deflated(payload)
    assert wire_size(payload) <= len(payload)
    if data is None:
        assert wire_size(payload) == len(payload)
    else:
        assert len(data) < len(payload) and wire_size(payload) == len(data)
        assert inflate(data, len(payload)) == payload


def test_repetitive_payloads_shrink():
    payload = bytes(range(16)) * 24  # 384 bytes, like a 4-bit 3x16x16 detail
    assert wire_size(payload) < 100


@pytest.mark.parametrize(("stream", "limit", "message"), [
    (deflated(bytes(1000)), 999, "past the limit"),
    (deflated(bytes(1000))[:-2], 2000, "truncated"),
    (deflated(bytes(1000)) + b"\x00", 2000, "follow the deflate stream"),
    (b"\xff\xff\xff", 2000, "invalid deflate stream"),
    (zlib.compress(bytes(100)), 2000, "invalid deflate stream"),  # a zlib header is not raw
])
def test_bad_streams_raise_codec_error(stream, limit, message):
    with pytest.raises(CodecError, match=message):
        inflate(stream, limit)


def test_the_limit_is_inclusive():
    assert inflate(deflated(bytes(1000)), 1000) == bytes(1000)
