"""Packed edge features: the codec's rows, the packed cloud model's checks, the edge's
negotiation."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from ddnn import oip
from ddnn.cloud.models import CloudModel, CloudPackedModel
from ddnn.codec import CODECS, MAX_ELEMENTS, FeatureCodec
from ddnn.edge.cloud_client import _advertised, _Packing
from ddnn.errors import CodecError
from ddnn.oip import InferRequest, OipError

SAMPLE = (16, 8, 8)
ROW = 128  # 1024 values, one bit each

# --- FeatureCodec.encode_rows / decode_rows -----------------------------------------------------


@pytest.mark.parametrize("kind", CODECS)
@settings(max_examples=40, deadline=None)
@given(x=arrays(np.float32, array_shapes(min_dims=2, max_dims=4, min_side=0, max_side=7),
                elements=st.floats(-6e4, 6e4, width=32)))
def test_rows_are_each_sample_encoded_alone_and_decode_like_decode(kind, x):
    codec = FeatureCodec(kind)
    rows = codec.encode_rows(x)
    size = codec.payload_size(x.shape[1:])
    assert rows.dtype == np.uint8 and rows.shape == (len(x), size)
    for sample, row in zip(x, rows, strict=True):
        assert row.tobytes() == codec.encode(sample)
    back = codec.decode_rows(rows, x.shape[1:])
    want = np.stack([codec.decode(r.tobytes(), x.shape[1:]) for r in rows]) if len(x) else back
    assert back.dtype == np.float32 and back.shape == x.shape
    assert back.tobytes() == want.tobytes()


def test_binary_rows_give_exactly_the_signs():
    x = np.sign(np.random.default_rng(0).standard_normal((5, *SAMPLE))).astype(np.float32)
    codec = FeatureCodec("binary")
    rows = codec.encode_rows(x)
    assert rows.shape == (5, ROW)
    assert codec.decode_rows(rows, SAMPLE).tobytes() == x.tobytes()


@pytest.mark.parametrize(("kind", "rows", "match"), [
    ("binary", np.zeros((2, ROW - 1), np.uint8), "must be uint8"),
    ("binary", np.zeros((2, ROW), np.int8), "must be uint8"),
    ("binary", np.zeros((2, 1, ROW), np.uint8), "must be uint8"),
    ("int8", np.zeros((1, 4 + 1024), np.uint8), "invalid int8 scale"),
    ("int8", np.frombuffer(np.float32(np.inf).tobytes() + bytes(1024), np.uint8)[None],
     "invalid int8 scale"),
    ("int8", np.frombuffer(np.float32(3e38).tobytes() + b"\x7f" * 1024, np.uint8)[None],
     "overflows"),
    ("float16", np.full((1, 2048), 0xFF, np.uint8), "NaN"),
])
def test_bad_rows_raise_codec_error(kind, rows, match):
    with pytest.raises(CodecError, match=match):
        FeatureCodec(kind).decode_rows(rows, SAMPLE)


@pytest.mark.parametrize("kind", ["binary", "int8", "float16", "float32"])
def test_lenient_rows_decode_any_bytes_to_finite_features(kind):
    """What a server that takes any bytes needs: zeros, random bytes (NaN and infinite scales
    and halves, negative scales, overflowing products) all decode, finite."""
    codec = FeatureCodec(kind)
    size = codec.payload_size(SAMPLE)
    rng = np.random.default_rng(3)
    for rows in (np.zeros((2, size), np.uint8), np.full((2, size), 0xFF, np.uint8),
                 rng.integers(0, 256, (64, size), dtype=np.uint8)):
        x = codec.decode_rows(rows, SAMPLE, lenient=True)
        assert x.shape == (len(rows), *SAMPLE) and np.isfinite(x).all()
    if kind == "int8":  # a zero scale is zeros; a valid row decodes as it strictly does
        assert not codec.decode_rows(np.zeros((1, size), np.uint8), SAMPLE, lenient=True).any()
    valid = codec.encode_rows(rng.standard_normal((3, *SAMPLE)).astype(np.float32))
    assert (codec.decode_rows(valid, SAMPLE, lenient=True).tobytes()
            == codec.decode_rows(valid, SAMPLE).tobytes())


# --- CloudPackedModel: the packed input, its metadata and its checks ----------------------------


class _Runtime:
    """As much of a bundle runtime as the model's checks read; the segment is the identity's sum."""

    def __init__(self, codec: str):
        self.manifest = SimpleNamespace(
            name="m", version="1", classes=("a", "b"), num_classes=2, kind="ddnn",
            codec={"edge_features": codec},
            cloud=SimpleNamespace(inputs=[SimpleNamespace(sample_shape=SAMPLE)]))

    def cloud(self, x):
        return np.stack([x.reshape(len(x), -1).sum(1), -x.reshape(len(x), -1).sum(1)], 1)


def _model(codec="binary") -> CloudPackedModel:
    return CloudPackedModel(_Runtime(codec))  # type: ignore[arg-type]


def _decode(model, inputs, outputs=None):
    return model.decode(InferRequest(None, inputs, outputs))


def test_each_model_lists_one_form_of_the_features():
    packed = _model().metadata(["1"])
    assert packed["name"] == "m-cloud-packed"
    assert packed["inputs"] == [
        {"name": "edge_features_packed", "datatype": "UINT8", "shape": [-1, ROW],
         "parameters": {"codec": "binary", "unpacked_name": "edge_features",
                        "unpacked_datatype": "FP32", "unpacked_shape": [-1, *SAMPLE]}}]
    plain = CloudModel(_Runtime("binary")).metadata(["1"])  # type: ignore[arg-type]
    assert plain["name"] == "m-cloud" and plain["inputs"] == [
        {"name": "edge_features", "datatype": "FP32", "shape": [-1, *SAMPLE],
         "parameters": {"range": [-1.0, 1.0]}}]  # (binary features decode to ±1)
    int8 = _model("int8").metadata(["1"])["inputs"][0]
    assert int8["shape"] == [-1, 4 + 1024] and int8["parameters"]["codec"] == "int8"
    assert [CloudPackedModel.serves(SimpleNamespace(kind="ddnn", codec={"edge_features": c}))
            for c in ("binary", "int8", "float16", "float32")] == [True, True, True, False]


@pytest.mark.parametrize("kind", ["binary", "int8", "float16"])
def test_packed_and_fp32_requests_decode_to_the_same_tensor(kind):
    codec = FeatureCodec(kind)
    raw = np.random.default_rng(1).standard_normal((3, *SAMPLE)).astype(np.float32)
    x = codec.decode_rows(codec.encode_rows(raw), SAMPLE)  # as the edge forwards them
    model, plain = _model(kind), CloudModel(_Runtime(kind))  # type: ignore[arg-type]
    packed, b1 = _decode(model, {oip.EDGE_FEATURES_PACKED: codec.encode_rows(x)})
    fp32, b2 = _decode(plain, {oip.EDGE_FEATURES: x})
    assert b1 == b2 == 3 and list(packed) == list(fp32) == ["edge_features"]
    assert packed["edge_features"].tobytes() == fp32["edge_features"].tobytes()
    np.testing.assert_array_equal(model.predict(packed)["scores"], plain.predict(fp32)["scores"])


@pytest.mark.parametrize("kind", ["binary", "int8", "float16"])
def test_any_rows_of_the_listed_shape_are_answered(kind):
    """All-zero rows, and bytes no codec would make: a client that knows only the metadata."""
    model = _model(kind)
    row = model.inputs[0].shape[1]
    for rows in (np.zeros((2, row), np.uint8),
                 np.random.default_rng(2).integers(0, 256, (8, row), dtype=np.uint8)):
        inputs, batch = _decode(model, {oip.EDGE_FEATURES_PACKED: rows})
        assert batch == len(rows) and np.isfinite(inputs["edge_features"]).all()
        assert model.predict(inputs)["scores"].shape == (len(rows), 2)


@pytest.mark.parametrize(("inputs", "match"), [
    ({"edge_features_packed": np.zeros((1, ROW - 1), np.uint8)},
     r"must have shape \[-1, 128\].*got \[1, 127\] \(one row of 128 bytes per sample"),
    ({"edge_features_packed": np.zeros((1, 1, ROW), np.uint8)}, r"must have shape \[-1, 128\]"),
    ({"edge_features_packed": np.zeros((1, ROW), np.int8)}, "must be UINT8, got INT8"),
    ({"edge_features_packed": np.zeros((1, ROW), np.float32)}, "must be UINT8, got FP32"),
    ({"edge_features_packed": np.zeros((0, ROW), np.uint8)}, "at least one sample"),
    ({"edge_features_packed": np.zeros((1, ROW), np.uint8),
      "edge_features": np.zeros((1, *SAMPLE), np.float32)}, "has no input 'edge_features'"),
    ({}, "needs input 'edge_features_packed'"),
    ({"features": np.zeros((1, ROW), np.uint8)}, "has no input 'features'"),
])
def test_bad_requests_are_refused_with_a_clear_message(inputs, match):
    with pytest.raises(OipError, match=match) as e:
        _decode(_model(), inputs)
    assert e.value.status == 400


def test_a_packed_batch_that_would_unpack_past_the_limit_is_refused():
    rows = np.zeros((MAX_ELEMENTS // 1024 + 1, ROW), np.uint8)
    with pytest.raises(OipError, match="unpack to more than"):
        _decode(_model(), {oip.EDGE_FEATURES_PACKED: rows})


def test_json_arrays_still_bound_a_json_packed_request():
    body, headers = oip.encode_request(
        {oip.EDGE_FEATURES_PACKED: np.zeros((2, ROW), np.uint8)}, binary=False)
    model = _model()
    req = oip.decode_request(body, headers, max_json_arrays=model.json_arrays)
    assert _decode(model, req.inputs)[1] == 2


# --- the edge's side: what it reads from the metadata, and when it packs ------------------------


def _metadata(model=None, **change) -> bytes:
    meta = (model or _model()).metadata(["1"])
    meta["inputs"][-1].update(change)
    return json.dumps(meta).encode()


def test_the_edge_reads_the_advertised_packed_input():
    packing = _advertised(_metadata(), FeatureCodec("binary"))
    assert packing == _Packing(FeatureCodec("binary"), SAMPLE, ROW, lean=True)
    # A cloud without the lean route (or whose first output is not FP32 scores): packed, v2.
    for change in ({"parameters": {}}, {"outputs": [{"name": "entropy", "datatype": "FP32"}]}):
        meta = {**json.loads(_metadata()), **change}
        packing = _advertised(json.dumps(meta).encode(), FeatureCodec("binary"))
        assert packing == _Packing(FeatureCodec("binary"), SAMPLE, ROW, lean=False)


@pytest.mark.parametrize("metadata", [
    _metadata(CloudModel(_Runtime("binary"))),  # type: ignore[arg-type]  # not the packed model
    _metadata(name="edge_features"),
    _metadata(datatype="BYTES"),
    _metadata(shape=[-1, 64]),
    _metadata(parameters={"codec": "int8", "unpacked_shape": [-1, *SAMPLE]}),
    _metadata(parameters={"codec": "binary", "unpacked_shape": "16x8x8"}),
    _metadata(parameters={"codec": "binary"}),
    b"not json", b"[]", b'{"inputs": 3}', b'{"inputs": ["x"]}',
])
def test_anything_else_means_fp32(metadata):
    assert _advertised(metadata, FeatureCodec("binary")) is None


def test_features_that_would_not_survive_the_codec_go_fp32():
    packing = _Packing(FeatureCodec("binary"), SAMPLE, ROW)
    signs = np.ones((2, *SAMPLE), np.float32)
    assert packing.pack(signs) is not None
    assert packing.pack(np.zeros((2, *SAMPLE), np.float32)) is None  # 0 would come back -1
    assert packing.pack(signs * 0.5) is None
    assert packing.pack(np.ones((2, 4), np.float32)) is None  # not this version's shape
    assert packing.pack(np.full((1, *SAMPLE), np.nan, np.float32)) is None
