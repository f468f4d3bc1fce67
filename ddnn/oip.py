"""The Open Inference Protocol (KServe v2) inference bodies, with the binary tensor extension.

Both sides live here so that the edge tier (a client) and the cloud service (a server) agree
byte for byte: :func:`encode_request` / :func:`decode_response` for clients,
:func:`decode_request` / :func:`encode_response` for servers. Numpy and the standard library only.

A body is a JSON object, optionally followed by raw tensor bytes; the header
``Inference-Header-Content-Length`` then gives the length of the JSON part, and each tensor sent
in binary carries ``"parameters": {"binary_data_size": n}`` instead of ``"data"``, its bytes
appended in order, row-major, little-endian. A *raw binary request* (Triton's form of the
extension) has no JSON at all: ``Inference-Header-Content-Length: 0``, the body is the bytes of a
model's one input, and every output is answered binary. Everything is validated — sizes, header
length against body length, datatype and shape against byte count, JSON structure — and any
problem raises :class:`OipError` with a message fit to return to the caller. The limits and the
parsing of tensors live in :mod:`ddnn.oip_body`; their public names are re-exported here.

ddnn's *lean route* (``POST /lean/{model}[/{version}]``, docs/cloud.md) is the raw binary request
answered in kind: the body is the raw bytes of the model's first output
(:func:`encode_raw_response` / :func:`decode_raw_response`), no JSON and no header but its length.
A client opts in by calling that route; the v2 routes answer as the protocol says.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddnn.oip_body import (
    BINARY_TYPE,
    DATATYPES,
    DETAIL_PRESENT,
    DEVICE_DETAIL,
    DEVICE_DETAIL_PACKED,
    EDGE_FEATURES,
    EDGE_FEATURES_PACKED,
    ESCALATED_FRAME,
    HEADER_LENGTH,
    JSON_TYPE,
    MAX_BODY,
    MAX_DIM,
    MAX_JSON_BYTES,
    MAX_JSON_ELEMENTS,
    MAX_NAME,
    MAX_RANK,
    MAX_TENSORS,
    PACKING_CODECS,
    ModelNotFoundError,
    OipError,
    PayloadTooLargeError,
    _check_consumed,
    _field,
    _from_bytes,
    _header,
    _name,
    _parameters,
    _read_tensors,
    _split,
    check_json_size,
    datatype_of,
    json_array_limit,
)

# The v2 API of ddnn, with the limits and errors of ddnn.oip_body that callers use.
__all__ = [
    "BINARY_TYPE",
    "DATATYPES",
    "DETAIL_PRESENT",
    "DEVICE_DETAIL",
    "DEVICE_DETAIL_PACKED",
    "EDGE_FEATURES",
    "EDGE_FEATURES_PACKED",
    "ESCALATED_FRAME",
    "HEADER_LENGTH",
    "JSON_TYPE",
    "LEAN_ROUTE",
    "MAX_BODY",
    "MAX_DIM",
    "MAX_JSON_BYTES",
    "MAX_JSON_ELEMENTS",
    "MAX_NAME",
    "MAX_RANK",
    "MAX_TENSORS",
    "PACKING_CODECS",
    "InferRequest",
    "ModelNotFoundError",
    "OipError",
    "PayloadTooLargeError",
    "check_json_size",
    "datatype_of",
    "decode_raw_response",
    "decode_request",
    "decode_response",
    "encode_raw_request",
    "encode_raw_response",
    "encode_request",
    "encode_response",
    "error_body",
    "json_array_limit",
]

# The lean route's prefix (a ddnn extension, not part of the v2 protocol).
LEAN_ROUTE = "/lean"


# --- server side --------------------------------------------------------------------------------


@dataclass
class InferRequest:
    """A decoded inference request."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None = None  # the requested outputs, in order; None: all of them
    binary_outputs: set[str] | bool = False  # which outputs to answer in binary (True: all)
    parameters: dict[str, Any] = field(default_factory=dict)

    def wants_binary(self, name: str) -> bool:
        if isinstance(self.binary_outputs, bool):
            return self.binary_outputs
        return name in self.binary_outputs


def decode_request(body: bytes | bytearray, headers: Mapping[str, str], *,
                   max_json_arrays: int | Callable[[int], int] | None = None,
                   raw_input: tuple[str, str, tuple[int, ...]] | None = None) -> InferRequest:
    """Parse and validate an inference request body (JSON, or JSON plus binary tensors, or a raw
    binary request).

    The JSON part is bounded before it is parsed (:func:`check_json_size`); ``max_json_arrays``:
    how many ``[`` it may hold (a number, or a function of its length such as one made with
    :func:`json_array_limit`). ``raw_input``: the model's one input as (name, datatype, sample
    shape), which a raw binary request carries; without it such a request is refused.
    """
    raw = _header(headers, HEADER_LENGTH)
    if raw is not None and raw.strip() == "0":
        return _raw_request(body, raw_input)
    obj, binary = _split(body, headers, "request body", max_json_arrays)
    req_id = _field(obj, "id", str, "request", default=None)
    params = _parameters(obj, "request")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise OipError("request parameter binary_data_output must be true or false")
    inputs, used = _read_tensors(_field(obj, "inputs", list, "request"), binary, "inputs")
    if not inputs:
        raise OipError("request 'inputs' is empty")
    _check_consumed(binary, used)
    outputs: list[str] | None = None
    binary_outputs: set[str] | bool = binary_default
    if "outputs" in obj:
        items = _field(obj, "outputs", list, "request")
        if len(items) > MAX_TENSORS:
            raise OipError(f"request asks for {len(items)} outputs, more than {MAX_TENSORS}")
        outputs, binary_outputs = [], set()
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise OipError(f"outputs[{i}] must be a JSON object")
            name = _name(item, f"outputs[{i}]")
            if name in outputs:
                raise OipError(f"output {name!r} is requested twice")
            flag = _parameters(item, f"output {name!r}").get("binary_data", binary_default)
            if not isinstance(flag, bool):
                raise OipError(f"output {name!r}: parameter binary_data must be true or false")
            outputs.append(name)
            if flag:
                binary_outputs.add(name)
    return InferRequest(req_id, inputs, outputs, binary_outputs, params)


def _raw_request(body: bytes | bytearray, raw_input: tuple[str, str, tuple[int, ...]] | None
                 ) -> InferRequest:
    """A raw binary request: the body is the one input's samples, as many as its size holds."""
    if raw_input is None:
        raise OipError(f"a raw binary request ({HEADER_LENGTH}: 0) needs a model with exactly "
                       "one input")
    name, datatype, sample = raw_input
    dtype = DATATYPES[datatype]
    row = math.prod(sample) * dtype.itemsize
    if not body or not row or len(body) % row:
        raise OipError(f"a raw binary request for {name!r} ({datatype} {[-1, *sample]}) must hold "
                       f"a whole number of samples of {row} bytes, got {len(body)} bytes")
    if len(body) > MAX_BODY:
        raise PayloadTooLargeError(f"request body of {len(body)} bytes exceeds the limit of "
                                   f"{MAX_BODY}")
    x = _from_bytes(memoryview(body), dtype, (len(body) // row, *sample), f"tensor {name!r}")
    return InferRequest(None, {name: x}, None, True)


def _tensor_json(name: str, x: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes]:
    entry: dict[str, Any] = {"name": name, "datatype": datatype_of(x.dtype), "shape": list(x.shape)}
    if binary:
        le = x.astype(x.dtype.newbyteorder("<"), copy=False)
        raw = np.ascontiguousarray(le).tobytes()
        entry["parameters"] = {"binary_data_size": len(raw)}
        return entry, raw
    entry["data"] = x.ravel().tolist()
    return entry, b""


def _assemble(obj: dict[str, Any], chunks: list[bytes]) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(obj, separators=(",", ":")).encode()
    if not any(chunks):
        return head, {"Content-Type": JSON_TYPE}
    return head + b"".join(chunks), {"Content-Type": BINARY_TYPE, HEADER_LENGTH: str(len(head))}


def encode_response(model_name: str, model_version: str, outputs: dict[str, np.ndarray], *,
                    request_id: str | None, binary_outputs: set[str] | bool
                    ) -> tuple[bytes, dict[str, str]]:
    """Build a response body and its headers; outputs named in ``binary_outputs`` go binary."""
    obj: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        obj["id"] = request_id
    entries, chunks = [], []
    for name, x in outputs.items():
        wanted = binary_outputs if isinstance(binary_outputs, bool) else name in binary_outputs
        entry, raw = _tensor_json(name, np.asarray(x), wanted)
        entries.append(entry)
        chunks.append(raw)
    obj["outputs"] = entries
    return _assemble(obj, chunks)


def encode_raw_response(x: np.ndarray) -> bytes:
    """The lean route's answer: ``x``'s bytes, row-major, little-endian, nothing else."""
    x = np.asarray(x)
    datatype_of(x.dtype)
    return np.ascontiguousarray(x.astype(x.dtype.newbyteorder("<"), copy=False)).tobytes()


def error_body(message: str) -> bytes:
    """The protocol's error object."""
    return json.dumps({"error": message}).encode()


# --- client side --------------------------------------------------------------------------------


def encode_request(inputs: dict[str, np.ndarray], *, binary: bool = True,
                   outputs: list[str] | None = None, binary_outputs: bool = True,
                   request_id: str | None = None, parameters: dict | None = None
                   ) -> tuple[bytes, dict[str, str]]:
    """Build a request body and its headers; ``binary`` sends the inputs as raw bytes."""
    if not inputs:
        raise OipError("a request needs at least one input")
    obj: dict[str, Any] = {}
    if request_id is not None:
        obj["id"] = request_id
    params = dict(parameters or {})
    if outputs is None:
        if binary_outputs:
            params["binary_data_output"] = True
    else:
        obj["outputs"] = [{"name": n, "parameters": {"binary_data": bool(binary_outputs)}}
                          for n in outputs]
    if params:
        obj["parameters"] = params
    entries, chunks = [], []
    for name, x in inputs.items():
        entry, raw = _tensor_json(name, np.asarray(x), binary)
        entries.append(entry)
        chunks.append(raw)
    obj["inputs"] = entries
    return _assemble(obj, chunks)


def encode_raw_request(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """A raw binary request for a model with one input: ``x``'s bytes and nothing else (every
    output comes back binary). The server takes the batch from the body's size."""
    x = np.asarray(x)
    datatype_of(x.dtype)  # a datatype the protocol has
    le = x.astype(x.dtype.newbyteorder("<"), copy=False)
    return np.ascontiguousarray(le).tobytes(), {HEADER_LENGTH: "0"}


def decode_raw_response(body: bytes | bytearray, rows: int, datatype: str) -> np.ndarray:
    """A lean route's answer to ``rows`` samples: ``(rows, n)`` values of ``datatype``, ``n``
    taken from the body's size (which must hold as many values for each row, at least one)."""
    dtype = DATATYPES[datatype]
    if len(body) > MAX_BODY:
        raise PayloadTooLargeError(f"response body of {len(body)} bytes exceeds the limit of "
                                   f"{MAX_BODY}")
    if rows < 1 or not body or len(body) % (rows * dtype.itemsize):
        raise OipError(f"a raw answer of {len(body)} bytes does not hold {rows} rows of "
                       f"{datatype} values")
    n = len(body) // (rows * dtype.itemsize)
    return _from_bytes(memoryview(body), dtype, (rows, n), "raw answer")


def decode_response(body: bytes, headers: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Parse a response body into its output tensors; an error body raises :class:`OipError`."""
    obj, binary = _split(body, headers, "response body")
    if "error" in obj:
        raise OipError(f"server error: {obj['error']}")
    tensors, used = _read_tensors(_field(obj, "outputs", list, "response"), binary, "outputs")
    _check_consumed(binary, used)
    return tensors
