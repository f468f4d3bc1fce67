"""Reading Open Inference Protocol (KServe v2) bodies safely: the limits, the typed errors and
the parsing of JSON and binary tensors that both sides of :mod:`ddnn.oip` share. Every size is
bounded before anything is parsed (a JSON part's bytes and element count, the tensors' count,
rank and elements), so a hostile body costs little. Numpy and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ddnn import bounded_json
from ddnn.codec import MAX_ELEMENTS
from ddnn.errors import DdnnError

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"
# Bounds, so a hostile body cannot make a receiver allocate without limit.
MAX_BODY = 256 << 20
MAX_TENSORS = 64
MAX_RANK = 8
MAX_NAME = 256
# No dimension may exceed the element bound: a shape like [10**30, 0] holds no elements yet is no
# tensor anyone can allocate or reshape to.
MAX_DIM = MAX_ELEMENTS
# Arrays a JSON body may hold beyond those its tensors' nesting needs (the inputs and outputs
# lists, each tensor's shape, a few in parameters).
JSON_ARRAY_SLACK = 4 * MAX_TENSORS + 64
# What a JSON part may make json.loads build, checked before it runs (it holds the interpreter
# lock throughout, and a Python object costs 30-70 bytes where its JSON took 2-3): elements (each
# value, array and object: the count of ',' '[' '{') and bytes. At the bound a parse takes tens of
# milliseconds and tens of MiB; larger tensors go binary (the extension), which costs neither.
MAX_JSON_ELEMENTS = 1 << 19
MAX_JSON_BYTES = 16 << 20
# The fewest bytes one value takes in a JSON tensor ("0,"): bounds a batch by the body's size.
_MIN_VALUE_BYTES = 2

# The inputs of a ``{name}-cloud`` model: the edge features as FP32, or (where the bundle's edge
# codec packs) each sample packed by that codec into one row of UINT8
# (:meth:`ddnn.codec.FeatureCodec.encode_rows`), which the model's metadata advertises.
EDGE_FEATURES = "edge_features"
EDGE_FEATURES_PACKED = "edge_features_packed"
# The second input of {name}-escalated: the senders' details, concatenated in slot order; its
# packed twin {name}-escalated-packed takes them one row per slot with which slots hold one
# (ddnn.packed_detail), beside the packed edge features.
DEVICE_DETAIL = "device_detail"
DEVICE_DETAIL_PACKED = "device_detail_packed"
DETAIL_PRESENT = "detail_present"
# The one input of {name}-escalated-lean: each escalated frame in one row of bytes
# (ddnn.packed_detail.EscalatedFrame), what the lean route carries.
ESCALATED_FRAME = "escalated_frame"
PACKING_CODECS = ("binary", "int8", "float16")

# v2 datatype <-> numpy dtype (little-endian on the wire). BYTES is not supported.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
# JSON values each datatype accepts, by numpy kind of the parsed list: bools are not numbers here
# and floats are not integers, so a client's type confusion is an error rather than a cast.
_JSON_KINDS = {"BOOL": "b", "FP16": "iuf", "FP32": "iuf", "FP64": "iuf"}


class OipError(DdnnError, ValueError):
    """A request or response that breaks the protocol; ``status`` is the HTTP code to answer."""

    status: int = 400


class ModelNotFoundError(OipError):
    """The model or version named in a request is not served."""

    status = 404


class PayloadTooLargeError(OipError):
    """A body larger than the receiver accepts."""

    status = 413


def datatype_of(dtype: np.dtype | type) -> str:
    """The v2 datatype name of a numpy dtype; raises :class:`OipError` for unsupported ones."""
    dt = np.dtype(dtype)
    for name, d in DATATYPES.items():
        if d.kind == dt.kind and d.itemsize == dt.itemsize:
            return name
    raise OipError(f"numpy dtype {dt} has no Open Inference Protocol datatype")


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:  # plain dicts are case-sensitive; HTTP header names are not
        lower = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lower), None)
    return value


def _json_length(body: bytes | bytearray, headers: Mapping[str, str]) -> int:
    raw = _header(headers, HEADER_LENGTH)
    if raw is None:
        return len(body)
    try:
        n = int(raw.strip())
    except ValueError:
        raise OipError(f"{HEADER_LENGTH} must be an integer, got {raw!r}") from None
    if not 0 < n <= len(body):
        raise OipError(
            f"{HEADER_LENGTH} is {n} but the body has {len(body)} bytes; the JSON header must "
            "be 1..body length bytes"
        )
    return n


def _parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = bounded_json.loads(data)
    except bounded_json.JsonDepthError as e:
        raise OipError(f"{what} is nested too deeply: {e}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of 4300+ digits
        raise OipError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise OipError(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str,
           default: Any = ...) -> Any:
    if key not in obj:
        if default is ...:
            raise OipError(f"{where} lacks the required field {key!r}")
        return default
    value = obj[key]
    # JSON true is a Python int: never accept it where a number or string is due.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise OipError(f"{where}: field {key!r} must be a {kind.__name__}, "
                       f"got {type(value).__name__}")
    return value


def _parameters(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    return _field(obj, "parameters", dict, where, default={})


def _name(obj: Mapping[str, Any], where: str) -> str:
    name = _field(obj, "name", str, where)
    if not name or len(name) > MAX_NAME:
        raise OipError(f"{where}: tensor name must be 1..{MAX_NAME} characters")
    return name


def _shape(obj: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape = _field(obj, "shape", list, where)
    if len(shape) > MAX_RANK:
        raise OipError(f"{where}: rank {len(shape)} exceeds the limit of {MAX_RANK}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise OipError(f"{where}: shape must be a list of non-negative integers, got "
                       f"{shape!r:.200}")
    if any(d > MAX_DIM for d in shape):
        raise OipError(f"{where}: a dimension of shape {shape!r:.200} exceeds the limit of "
                       f"{MAX_DIM}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise OipError(f"{where}: {math.prod(shape)} elements exceed the limit of {MAX_ELEMENTS}")
    return tuple(shape)


def _dtype(obj: Mapping[str, Any], where: str) -> tuple[str, np.dtype]:
    name = _field(obj, "datatype", str, where)
    if name not in DATATYPES:
        extra = " (BYTES tensors are not supported)" if name == "BYTES" else ""
        raise OipError(f"{where}: unknown datatype {name!r}{extra}; use one of {list(DATATYPES)}")
    return name, DATATYPES[name]


def _from_json_data(data: Any, datatype: str, dtype: np.dtype, shape: tuple[int, ...],
                    where: str) -> np.ndarray:
    if not isinstance(data, list):
        raise OipError(f"{where}: 'data' must be a list")
    n = math.prod(shape)
    # Flat (n values) or nested (shape[0] rows): anything else is refused before numpy walks it.
    if len(data) != n and (len(shape) < 2 or len(data) != shape[0]):
        raise OipError(f"{where}: 'data' holds {len(data)} values but shape {list(shape)} needs "
                       f"{n}")
    try:
        raw = np.asarray(data)
    except ValueError as e:  # ragged nesting
        raise OipError(f"{where}: 'data' is not a regular array: {e}") from None
    if raw.size != n:
        raise OipError(f"{where}: 'data' holds {raw.size} values but shape {list(shape)} needs {n}")
    if n and raw.dtype.kind not in _JSON_KINDS.get(datatype, "iu"):
        raise OipError(f"{where}: 'data' holds {raw.dtype.kind!r}-kind values, not {datatype}")
    if raw.dtype.kind in "iu" and n and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if raw.min() < info.min or raw.max() > info.max:
            raise OipError(f"{where}: 'data' has values outside the range of {datatype}")
    with np.errstate(over="ignore"):
        return raw.astype(dtype.newbyteorder("=")).reshape(shape)


def _from_bytes(buf: memoryview, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    expected = math.prod(shape) * dtype.itemsize
    if len(buf) != expected:
        raise OipError(f"{where}: binary_data_size is {len(buf)} bytes but shape {list(shape)} "
                       f"of {dtype} needs {expected}")
    if dtype.kind == "b":
        raw = np.frombuffer(buf, dtype=np.uint8)
        if raw.size and raw.max() > 1:
            raise OipError(f"{where}: BOOL bytes must be 0 or 1")
        return raw.astype(bool).reshape(shape)
    return np.frombuffer(buf, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)


def _read_tensors(items: Any, binary: memoryview, where: str, *, allow_data: bool = True
                  ) -> tuple[dict[str, np.ndarray], int]:
    """Tensors of an ``inputs``/``outputs`` list; returns them and the binary bytes consumed."""
    if not isinstance(items, list):
        raise OipError(f"{where} must be a list")
    if len(items) > MAX_TENSORS:
        raise OipError(f"{where} holds {len(items)} tensors, more than the limit of {MAX_TENSORS}")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise OipError(f"{where}[{i}] must be a JSON object")
        name = _name(item, f"{where}[{i}]")
        at = f"tensor {name!r}"
        if name in tensors:
            raise OipError(f"{at} appears twice")
        shape = _shape(item, at)
        datatype, dtype = _dtype(item, at)
        size = _parameters(item, at).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise OipError(f"{at}: binary_data_size must be a non-negative integer")
            if "data" in item:
                raise OipError(f"{at} has both 'data' and binary_data_size")
            if offset + size > len(binary):
                raise OipError(f"{at}: binary_data_size {size} runs past the end of the body "
                               f"({len(binary) - offset} bytes left): truncated body?")
            tensors[name] = _from_bytes(binary[offset:offset + size], dtype, shape, at)
            offset += size
        elif "data" in item and allow_data:
            tensors[name] = _from_json_data(item["data"], datatype, dtype, shape, at)
        else:
            raise OipError(f"{at} has neither 'data' nor a binary_data_size parameter")
    return tensors, offset


def json_array_limit(tensors: Iterable[tuple[str, tuple[int, ...]]], json_bytes: int) -> int:
    """The most JSON arrays a request body of ``json_bytes`` bytes can need for tensors given as
    ``(datatype, sample shape)`` (the batch axis dropped), sent nested or flat.

    Nested, a sample of shape ``(a, b, c)`` takes ``1 + a + a*b`` arrays for its ``a*b*c``
    values, each at least ``"0,"`` (``"true,"`` for BOOL); a body of ``json_bytes`` holds at
    most so many samples of any one input, so the bound is what the largest legitimate body
    could need. A body of ``[[],[],…]`` needs far more arrays than values and is refused before
    it is parsed.
    """
    arrays = JSON_ARRAY_SLACK
    for datatype, shape in tensors:
        values = max(1, math.prod(shape))
        per_sample = 1 + sum(math.prod(shape[:i]) for i in range(1, len(shape)))
        value_bytes = 5 if datatype == "BOOL" else _MIN_VALUE_BYTES
        samples = json_bytes // (value_bytes * values) + 1
        arrays += 1 + samples * per_sample
    return arrays


def check_json_size(data: bytes | bytearray, what: str, max_arrays: int | None = None) -> None:
    """Bound what parsing the JSON ``data`` can cost, before it is parsed: its bytes and elements
    (413), and, given ``max_arrays``, its arrays (400). ``bytes.count`` runs at memory speed,
    while ``json.loads`` of ten million empty lists takes seconds and most of a GiB. Characters
    inside strings count too, which only makes the bounds stricter for odd bodies."""
    if len(data) > MAX_JSON_BYTES:
        raise PayloadTooLargeError(f"{what}: a JSON part of {len(data)} bytes exceeds the limit "
                                   f"of {MAX_JSON_BYTES}; send large tensors binary")
    arrays = data.count(b"[")
    elements = arrays + data.count(b"{") + data.count(b",")
    if elements > MAX_JSON_ELEMENTS:
        raise PayloadTooLargeError(f"{what}: the JSON holds about {elements} elements, more than "
                                   f"the limit of {MAX_JSON_ELEMENTS}; send large tensors binary")
    if max_arrays is not None and arrays > max_arrays:
        raise OipError(f"{what}: the JSON holds {arrays} arrays; tensors of this model's shapes "
                       f"need at most {max_arrays} for a body of {len(data)} bytes (send 'data' "
                       "flat, or binary tensors)")


def _split(body: bytes | bytearray, headers: Mapping[str, str], what: str,
           max_json_arrays: int | Callable[[int], int] | None = None
           ) -> tuple[dict[str, Any], memoryview]:
    if len(body) > MAX_BODY:
        raise PayloadTooLargeError(f"{what} of {len(body)} bytes exceeds the limit of {MAX_BODY}")
    if not body:
        raise OipError(f"{what} is empty")
    n = _json_length(body, headers)
    head = body if n == len(body) else body[:n]
    check_json_size(head, what, max_json_arrays(n) if callable(max_json_arrays)
                    else max_json_arrays)
    return _parse_json(head, what), memoryview(body)[n:]


def _check_consumed(binary: memoryview, used: int) -> None:
    if used != len(binary):
        raise OipError(f"the body has {len(binary) - used} bytes after the last binary tensor; "
                       f"binary_data_size values and {HEADER_LENGTH} disagree with the body")
