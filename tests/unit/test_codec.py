"""The feature codec: exact round trips, exact sizes, and clear errors on bad bytes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from ddnn.codec import CODECS, MAX_ELEMENTS, FeatureCodec
from ddnn.errors import CodecError

shapes = array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=9)
finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@given(arrays(np.float32, shapes, elements=st.sampled_from([-1.0, 1.0])))
def test_binary_round_trip_is_exact_for_signs(x):
    codec = FeatureCodec("binary")
    payload = codec.encode(x)
    assert len(payload) == codec.payload_size(x.shape) == (x.size + 7) // 8
    np.testing.assert_array_equal(codec.decode(payload, x.shape), x)


@given(arrays(np.float32, shapes, elements=finite))
def test_binary_keeps_the_sign(x):
    out = FeatureCodec("binary").decode(FeatureCodec("binary").encode(x), x.shape)
    np.testing.assert_array_equal(out, np.where(x > 0, 1.0, -1.0))


@given(arrays(np.float32, shapes, elements=finite))
def test_int8_error_is_within_half_a_step(x):
    codec = FeatureCodec("int8")
    out = codec.decode(codec.encode(x), x.shape)
    step = max(float(np.abs(x).max()), 1e-30) / 127
    assert np.all(np.abs(out - x) <= step * 0.5 + 1e-6 * np.abs(x) + 1e-30)


@given(arrays(np.float32, shapes, elements=st.floats(-6e4, 6e4, width=32)))
def test_float16_matches_numpy_rounding(x):
    codec = FeatureCodec("float16")
    out = codec.decode(codec.encode(x), x.shape)
    np.testing.assert_array_equal(out, x.astype(np.float16).astype(np.float32))


@given(arrays(np.float32, shapes, elements=finite))
def test_float32_is_lossless(x):
    codec = FeatureCodec("float32")
    np.testing.assert_array_equal(codec.decode(codec.encode(x), x.shape), x)


@pytest.mark.parametrize("kind", CODECS)
@settings(max_examples=50)
@given(data=st.binary(max_size=64), dims=st.lists(st.integers(0, 12), min_size=1, max_size=3))
def test_decode_of_arbitrary_bytes_raises_only_codec_error(kind, data, dims):
    try:
        out = FeatureCodec(kind).decode(data, tuple(dims))
    except CodecError:
        return
    assert out.shape == tuple(dims) and out.dtype == np.float32


@pytest.mark.parametrize("kind", CODECS)
def test_truncated_and_padded_payloads_are_rejected(kind):
    codec = FeatureCodec(kind)
    payload = codec.encode(np.ones((2, 5), np.float32))
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(payload[:-1], (2, 5))
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(payload + b"\0", (2, 5))


def test_bad_inputs_are_typed_errors():
    with pytest.raises(CodecError, match="unknown codec"):
        FeatureCodec("jpeg")
    with pytest.raises(CodecError, match="NaN"):
        FeatureCodec("float16").encode(np.array([np.nan], np.float32))
    with pytest.raises(CodecError, match="float16 range"):
        FeatureCodec("float16").encode(np.array([1e6], np.float32))
    with pytest.raises(CodecError, match="exceeds"):
        FeatureCodec("binary").decode(b"", (MAX_ELEMENTS + 1,))
    with pytest.raises(CodecError, match="shape"):
        FeatureCodec("binary").decode(b"", (-1,))
    with pytest.raises(CodecError, match="scale"):
        FeatureCodec("int8").decode(b"\0\0\0\0\1", (1,))


def test_one_bit_per_value_for_binarized_features():
    # 4 filters × 16 × 16 binary features: 1024 bits = 128 bytes on the wire.
    assert FeatureCodec("binary").payload_size((1, 4, 16, 16)) == 128


@pytest.mark.parametrize("bits", [2, 4])
@given(data=st.data())
def test_few_bit_codecs_carry_their_levels_exactly(bits, data):
    levels = np.arange(2**bits, dtype=np.float32) * np.float32(2 / (2**bits - 1)) - np.float32(1)
    x = data.draw(arrays(np.float32, shapes, elements=st.sampled_from(levels.tolist())))
    codec = FeatureCodec(f"bits{bits}")
    payload = codec.encode(x)
    assert len(payload) == codec.payload_size(x.shape) == (x.size * bits + 7) // 8
    np.testing.assert_array_equal(codec.decode(payload, x.shape), x)


@pytest.mark.parametrize("bits", [2, 4])
@given(x=arrays(np.float32, shapes, elements=finite))
def test_few_bit_codecs_round_to_the_nearest_level_never_zero(bits, x):
    out = FeatureCodec(f"bits{bits}").decode(FeatureCodec(f"bits{bits}").encode(x), x.shape)
    step = 2 / (2**bits - 1)
    assert np.all(np.abs(out - np.clip(x, -1, 1)) <= step / 2 + 1e-6)
    assert np.all(out != 0) and np.all(np.abs(out) <= 1)


@pytest.mark.parametrize("bits", [2, 4])
@given(x=arrays(np.float32, shapes, elements=st.floats(-1.5, 1.5, width=32)))
def test_few_bit_payload_is_each_level_index_bit_by_bit(bits, x):
    # The wire format, spelled out: each value's nearest level index in `bits` bits, most
    # significant first, all of them through np.packbits (the encoder packs whole indices).
    index = np.rint((np.clip(x.ravel(), -1, 1) + 1) * ((2**bits - 1) / 2)).astype(np.uint8)
    spelled = (index[:, None] >> np.arange(bits - 1, -1, -1, dtype=np.uint8)) & 1
    assert FeatureCodec(f"bits{bits}").encode(x) == np.packbits(spelled.ravel()).tobytes()


def test_few_bit_codecs_match_the_training_quantizer():
    torch = pytest.importorskip("torch")
    from ddnn.models.network import Quantize

    x = torch.randn(4, 16, 4, 4) * 1.5
    for bits in (2, 4):
        q = Quantize(bits).eval()(x).numpy()
        codec = FeatureCodec(f"bits{bits}")
        assert codec.decode(codec.encode(q), q.shape).tobytes() == q.tobytes()
        rows = codec.encode_rows(q)
        assert rows.shape == (4, 16 * 4 * 4 * bits // 8)
        assert codec.decode_rows(rows, q.shape[1:]).tobytes() == q.tobytes()


def test_a_float16_nan_is_refused_without_a_warning():
    """0x7D00 is a float16 NaN: widening it warns "invalid value" on aarch64's numpy, which
    pytest's -W error turned into a failure there (found by hypothesis on the emulated board)."""
    with pytest.raises(CodecError, match="NaN"):
        FeatureCodec("float16").decode(bytes(16) + b"\x00\x7d", (9,))
