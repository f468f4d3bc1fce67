"""The Open Inference Protocol codec: round trips, the binary extension, and malformed bodies."""

import contextlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ddnn import oip, oip_body
from ddnn.oip import HEADER_LENGTH, OipError, decode_request, decode_response, encode_request


def _body(obj, binary: bytes = b"") -> tuple[bytes, dict[str, str]]:
    head = json.dumps(obj).encode()
    return head + binary, ({HEADER_LENGTH: str(len(head))} if binary else {})


def _fp32_input(name="x", shape=(2, 3), **extra):
    return {"name": name, "datatype": "FP32", "shape": list(shape), **extra}


# --- round trips --------------------------------------------------------------------------------

_DTYPES = st.sampled_from(list(oip.DATATYPES.values()))
_ARRAYS = _DTYPES.flatmap(lambda dt: hnp.arrays(
    dt, hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5),
    elements=hnp.from_dtype(dt, allow_nan=False, allow_infinity=False)))


@settings(max_examples=150, deadline=None)
@given(arrays=st.lists(_ARRAYS, min_size=1, max_size=4), binary=st.booleans())
def test_request_round_trip(arrays, binary):
    inputs = {f"in{i}": a for i, a in enumerate(arrays)}
    body, headers = encode_request(inputs, binary=binary, request_id="r1")
    req = decode_request(body, headers)
    assert req.id == "r1" and list(req.inputs) == list(inputs)
    for name, a in inputs.items():
        got = req.inputs[name]
        assert got.dtype == a.dtype.newbyteorder("=") and got.shape == a.shape
        np.testing.assert_array_equal(got, a)
    assert req.outputs is None and req.binary_outputs is True


@settings(max_examples=100, deadline=None)
@given(arrays=st.lists(_ARRAYS, min_size=1, max_size=3), data=st.data())
def test_response_round_trip(arrays, data):
    outputs = {f"out{i}": a for i, a in enumerate(arrays)}
    binary = set(data.draw(st.lists(st.sampled_from(list(outputs)), unique=True)))
    body, headers = oip.encode_response("m", "1", outputs, request_id=None, binary_outputs=binary)
    assert (HEADER_LENGTH in headers) == any(outputs[n].size for n in binary)
    got = decode_response(body, headers)
    assert list(got) == list(outputs)
    for name, a in outputs.items():
        np.testing.assert_array_equal(got[name], a)
        assert got[name].dtype == a.dtype


def test_requested_outputs_carry_their_binary_flags():
    body, headers = encode_request({"x": np.zeros((1, 2), np.float32)}, outputs=["a", "b"],
                                   binary_outputs=False, parameters={"priority": 1})
    req = decode_request(body, headers)
    assert req.outputs == ["a", "b"] and req.binary_outputs == set()
    assert req.parameters == {"priority": 1} and not req.wants_binary("a")
    obj = {"inputs": [_fp32_input(shape=[1], data=[1.0])],
           "parameters": {"binary_data_output": True},
           "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}]}
    req = decode_request(*_body(obj))
    assert req.binary_outputs == {"a"} and req.wants_binary("a") and not req.wants_binary("b")


def test_nested_json_data_and_plain_dict_headers_are_accepted():
    obj = {"inputs": [_fp32_input(shape=[2, 2], data=[[1, 2], [3, 4.5]])]}
    req = decode_request(*_body(obj))
    np.testing.assert_array_equal(req.inputs["x"], [[1, 2], [3, 4.5]])
    body, headers = encode_request({"x": np.ones((2, 2), np.float32)})
    lowered = {k.lower(): v for k, v in headers.items()}
    np.testing.assert_array_equal(decode_request(body, lowered).inputs["x"], np.ones((2, 2)))


def test_response_keeps_the_request_id_and_decodes_error_bodies():
    body, _headers = oip.encode_response("m", "2", {"y": np.arange(3, dtype=np.int64)},
                                        request_id="abc", binary_outputs=False)
    obj = json.loads(body)
    assert obj["id"] == "abc" and obj["model_version"] == "2"
    assert obj["outputs"][0]["data"] == [0, 1, 2]
    with pytest.raises(OipError, match="server error: no such model"):
        decode_response(oip.error_body("no such model"), {})


def test_datatype_names():
    assert oip.datatype_of(np.float32) == "FP32" and oip.datatype_of(np.bool_) == "BOOL"
    with pytest.raises(OipError, match="no Open Inference Protocol datatype"):
        oip.datatype_of(np.complex64)


# --- malformed bodies ---------------------------------------------------------------------------

_GOOD = _fp32_input(shape=[1, 2], data=[1.0, 2.0])


@pytest.mark.parametrize(("obj", "match"), [
    ([1, 2], "must be a JSON object"),
    ({}, "lacks the required field 'inputs'"),
    ({"inputs": {}}, "'inputs' must be a list"),
    ({"inputs": []}, "'inputs' is empty"),
    ({"inputs": [1]}, r"inputs\[0\] must be a JSON object"),
    ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}, "required field 'name'"),
    ({"inputs": [_fp32_input(name="", data=[1] * 6)]}, "tensor name must be"),
    ({"inputs": [_GOOD, _GOOD]}, "appears twice"),
    ({"inputs": [_fp32_input(shape=[-1, 2], data=[1, 2])]}, "non-negative integers"),
    ({"inputs": [_fp32_input(shape=[1.5], data=[1])]}, "non-negative integers"),
    ({"inputs": [_fp32_input(shape=[True], data=[1])]}, "non-negative integers"),
    ({"inputs": [{**_GOOD, "shape": "2"}]}, "'shape' must be a list"),
    ({"inputs": [_fp32_input(shape=[1] * 9, data=[1])]}, "rank 9 exceeds"),
    ({"inputs": [_fp32_input(shape=[1 << 20, 1 << 20], data=[])]}, "exceed the limit"),
    ({"inputs": [{**_GOOD, "datatype": "FP128"}]}, "unknown datatype 'FP128'"),
    ({"inputs": [{**_GOOD, "datatype": "BYTES"}]}, "BYTES tensors are not supported"),
    ({"inputs": [{**_GOOD, "datatype": 7}]}, "'datatype' must be a str"),
    ({"inputs": [_fp32_input(shape=[1, 2], data=[1.0])]}, "holds 1 values but shape"),
    ({"inputs": [_fp32_input(shape=[2, 2], data=[[1, 2], [3]])]}, "not a regular array"),
    ({"inputs": [_fp32_input(shape=[1, 2], data=["1", "2"])]}, "not FP32"),
    ({"inputs": [_fp32_input(shape=[1, 2], data=[True, False])]}, "not FP32"),
    ({"inputs": [_fp32_input(shape=[1, 2], data=[None, 1])]}, "not FP32"),
    ({"inputs": [_fp32_input(shape=[1, 2], data=3)]}, "'data' must be a list"),
    ({"inputs": [{**_GOOD, "datatype": "INT32", "data": [1.5, 2]}]}, "not INT32"),
    ({"inputs": [{**_GOOD, "datatype": "INT8", "data": [1, 300]}]}, "outside the range of INT8"),
    ({"inputs": [{**_GOOD, "datatype": "BOOL", "data": [1, 0]}]}, "not BOOL"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}, "neither 'data' nor"),
    ({"inputs": [{**_GOOD, "parameters": {"binary_data_size": 8}}]}, "both 'data' and"),
    ({"inputs": [{**_GOOD, "parameters": []}]}, "'parameters' must be a dict"),
    ({"inputs": [_GOOD], "id": 5}, "'id' must be a str"),
    ({"inputs": [_GOOD], "parameters": {"binary_data_output": "yes"}}, "must be true or false"),
    ({"inputs": [_GOOD], "outputs": "scores"}, "'outputs' must be a list"),
    ({"inputs": [_GOOD], "outputs": [{"name": "a"}, {"name": "a"}]}, "requested twice"),
    ({"inputs": [_GOOD], "outputs": [{"name": "a", "parameters": {"binary_data": 1}}]},
     "binary_data must be true or false"),
])
def test_malformed_json_is_refused(obj, match):
    with pytest.raises(OipError, match=match) as e:
        decode_request(*_body(obj))
    assert e.value.status == 400


def _binary_request(size_claim: int, payload: bytes, header: str | None = None):
    head = json.dumps({"inputs": [_fp32_input(shape=[1, 2], parameters={
        "binary_data_size": size_claim})]}).encode()
    return head + payload, {HEADER_LENGTH: header if header is not None else str(len(head))}


@pytest.mark.parametrize(("claim", "payload", "header", "match"), [
    (8, b"\0" * 4, None, r"runs past the end of the body \(4 bytes left\): truncated"),
    (4, b"\0" * 4, None, "binary_data_size is 4 bytes but shape"),
    (8, b"\0" * 12, None, "4 bytes after the last binary tensor"),
    (8, b"\0" * 8, "abc", "must be an integer"),
    (8, b"\0" * 8, "-1", "must be 1..body length"),
    (8, b"\0" * 8, "0", "raw binary request .* needs a model with exactly one input"),
    (8, b"\0" * 8, "100000", "must be 1..body length"),
    (-8, b"\0" * 8, None, "non-negative integer"),
])
def test_lying_binary_sizes_are_refused(claim, payload, header, match):
    with pytest.raises(OipError, match=match):
        decode_request(*_binary_request(claim, payload, header))


def test_binary_without_the_header_and_bad_bool_bytes_are_refused():
    body, _headers = _binary_request(8, b"\0" * 8)
    with pytest.raises(OipError, match="not valid JSON"):
        decode_request(body, {})  # the whole body is then taken as JSON
    head = json.dumps({"inputs": [{"name": "p", "datatype": "BOOL", "shape": [2],
                                   "parameters": {"binary_data_size": 2}}]}).encode()
    with pytest.raises(OipError, match="BOOL bytes must be 0 or 1"):
        decode_request(head + b"\x01\x07", {HEADER_LENGTH: str(len(head))})


def test_empty_oversized_and_deeply_nested_bodies_are_refused(monkeypatch):
    with pytest.raises(OipError, match="empty"):
        decode_request(b"", {})
    with pytest.raises(OipError, match="nested too deeply"):
        decode_request(b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {})
    monkeypatch.setattr(oip_body, "MAX_BODY", 10)
    with pytest.raises(oip.PayloadTooLargeError, match="exceeds the limit") as e:
        decode_request(b"{" + b" " * 20 + b"}", {})
    assert e.value.status == 413


def test_a_json_part_is_bounded_before_it_is_parsed(monkeypatch):
    def refused(body: bytes, headers=None, **kw) -> OipError:
        with pytest.raises(OipError) as e:
            decode_request(body, headers or {}, **kw)
        return e.value

    monkeypatch.setattr(oip_body, "bounded_json", None)  # whatever is refused here is never parsed
    n = oip.MAX_JSON_ELEMENTS
    for bomb in (b"[]," * n, b"0," * n, b"{}," * n, b'"' + b"a" * oip.MAX_JSON_BYTES + b'"'):
        e = refused(b'{"inputs": [' + bomb + b"]}")
        assert e.status == 413 and "send large tensors binary" in str(e)
    head = b'{"inputs": [' + b"[]," * 1000 + b"]}"
    sizes = []
    e = refused(head, max_json_arrays=lambda size: sizes.append(size) or 10)
    assert e.status == 400 and "holds 1001 arrays" in str(e) and sizes == [len(head)]
    e = refused(head + b"\0" * 8, {HEADER_LENGTH: str(len(head))},  # a binary body's header
                max_json_arrays=lambda size: sizes.append(size) or 10)
    assert e.status == 400 and "holds 1001 arrays" in str(e) and sizes[-1] == len(head)


def test_an_integer_past_pythons_digit_limit_is_a_400():
    with pytest.raises(OipError, match="not valid JSON: Exceeds the limit") as e:
        decode_request(b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": ['
                       + b"1" * 5000 + b"]}]}", {})
    assert e.value.status == 400


def test_a_raw_binary_request_is_the_one_inputs_bytes():
    x = np.arange(12, dtype=np.uint8).reshape(3, 4)
    body, headers = oip.encode_raw_request(x)
    assert body == x.tobytes() and headers == {HEADER_LENGTH: "0"}
    req = decode_request(body, headers, raw_input=("rows", "UINT8", (4,)))
    assert list(req.inputs) == ["rows"] and req.inputs["rows"].tobytes() == x.tobytes()
    assert req.inputs["rows"].shape == (3, 4)  # the batch from the body's size
    assert req.outputs is None and req.binary_outputs is True and req.id is None
    f = decode_request(np.ones((1, 2), "<f4").tobytes(), {HEADER_LENGTH: " 0 "},
                       raw_input=("x", "FP32", (2,)))
    np.testing.assert_array_equal(f.inputs["x"], np.ones((1, 2), np.float32))
    with pytest.raises(OipError, match="needs a model with exactly one input"):
        decode_request(body, headers)
    for bad in (b"", body[:-1]):
        with pytest.raises(OipError, match="a whole number of samples of 4 bytes"):
            decode_request(bad, headers, raw_input=("rows", "UINT8", (4,)))
    with pytest.raises(OipError, match="BOOL bytes must be 0 or 1"):
        decode_request(b"\x02", headers, raw_input=("p", "BOOL", (1,)))


def test_too_many_tensors_are_refused():
    inputs = [_fp32_input(name=f"x{i}", shape=[1], data=[0]) for i in range(oip.MAX_TENSORS + 1)]
    with pytest.raises(OipError, match="more than the limit"):
        decode_request(*_body({"inputs": inputs}))


def test_encode_request_needs_inputs_and_not_found_is_404():
    with pytest.raises(OipError, match="at least one input"):
        encode_request({})
    assert oip.ModelNotFoundError("x").status == 404


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=300), header=st.one_of(st.none(), st.integers(-5, 400).map(str)))
def test_arbitrary_bytes_raise_only_oip_errors(body, header):
    headers = {} if header is None else {HEADER_LENGTH: header}
    with contextlib.suppress(OipError):
        decode_request(body, headers)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_mutated_valid_bodies_raise_only_oip_errors(data):
    body, headers = encode_request({"v": np.arange(6, dtype=np.float32).reshape(2, 3),
                                    "p": np.array([True, False])})
    pos = data.draw(st.integers(0, len(body) - 1))
    mutated = bytearray(body)
    mutated[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    with contextlib.suppress(OipError):
        decode_request(bytes(mutated[:cut]), headers)
