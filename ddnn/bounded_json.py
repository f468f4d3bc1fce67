"""JSON from a peer, parsed only once its nesting is known to be shallow.

``json.loads`` recurses once per level of nesting. A body of 50,000 ``[`` runs it into
Python's recursion limit, and at that depth anything else that runs on the thread (a garbage
collection's finalizers, a logging handler) can fail too, outside any ``except``. So every
parser of a peer's JSON measures the nesting first, in linear time and without recursion,
and refuses a body deeper than its format can be (:class:`JsonDepthError`, a ``ValueError``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

# Deeper than any message of the contract (an OIP tensor of rank 8 inside its request is 11
# levels); far below the interpreter's recursion limit (1,000).
MAX_DEPTH = 32
# A string, its closing quote optional so that an unterminated one ends the scan in one pass
# (json.loads fails on it anyway, before the brackets inside it).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK = 1 << 20  # bytes scanned at a time: the running depth's int32s stay at 4 MiB


class JsonDepthError(ValueError):
    """A JSON text nested deeper than its reader allows."""


def nesting_depth(data: bytes | bytearray | memoryview | str) -> int:
    """How deep the JSON in ``data`` nests: its deepest run of open brackets (``[`` and ``{``),
    brackets inside strings left out. Linear in the bytes; never recurses."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    view = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
    depth = deepest = 0
    for start in range(0, len(view), _CHUNK):
        running = np.cumsum(_STEP[view[start:start + _CHUNK]], dtype=np.int32) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


def loads(data: bytes | bytearray | memoryview | str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(data)``, refused (:class:`JsonDepthError`) if it nests more than
    ``max_depth`` levels; other faults raise as ``json.loads`` raises them (``ValueError``)."""
    if isinstance(data, memoryview):  # (json.loads takes no memoryview: one copy, here)
        data = bytes(data)
    depth = nesting_depth(data)
    if depth > max_depth:
        raise JsonDepthError(f"nested {depth} levels deep, more than {max_depth}")
    return json.loads(data)
