"""The escalated cloud's route: how a frame that escalates reaches ``{name}-escalated``.

Negotiated once per bundle version from the cloud's metadata, as the plain model's packing is
(:mod:`edge.cloud_client`): the lean route to ``{name}-escalated-lean`` where the cloud serves
it (the whole frame in one row of bytes, no JSON either way: the edge features packed, a flag
per slot, the senders' details one row per slot in the bundle's detail codec through the
average filter: :class:`~ddnn.packed_detail.EscalatedFrame`); else ``{name}-escalated-packed``
(the same three parts as v2 inputs, unfiltered); else ``{name}-escalated`` with FP32
``edge_features`` and ``device_detail``. A cloud that refuses a packed way (400, or 404: the
model went away) gets FP32 for that version from then on. Every body is deflated
(``Content-Encoding: deflate``; the lean frame with deflate's filtered strategy); a server that
refuses the encoding (415, or a 400 that names it) gets bodies plain from then on.

Not thread-safe on its own: :class:`~edge.cloud_client.CloudClient` calls it under its lock,
inside its circuit breaker.
"""

from __future__ import annotations

import logging
import urllib.parse
import zlib
from collections.abc import Callable

import numpy as np

from ddnn import bounded_json, oip
from ddnn.codec import FeatureCodec
from ddnn.errors import CodecError
from ddnn.packed_detail import EscalatedFrame, EscalatedInputs

log = logging.getLogger(__name__)

# Deflate's level for escalated bodies: 6 codes a frame's 19 KB in about 0.4 ms on the 2-core
# development machine, and level 9 would save under 1% more (measured over 200 test frames).
ESCALATED_DEFLATE = 6
MAX_VERSIONS = 64  # negotiations remembered; a bound, versions come and go slowly
# A negotiation that found no packed model (404): remembered only once FP32 is answered, since
# the version itself may be the one missing (an update under way).
_ABSENT = object()
_Way = EscalatedFrame | EscalatedInputs  # the packed ways escalated frames go, negotiated

Answer = tuple[int, bytes, dict[str, str]]  # status, body, headers
Request = Callable[[str, str, bytes | None, dict[str, str]], Answer]


class EscalatedRoute:
    """Sends escalated frames to the model ``name`` through ``request`` (the client's
    connection: method, path, body, headers), under the cloud root path ``root``.

    ``codec``: the bundle's edge-features codec (None: FP32 only). ``deflate`` turns off once
    the cloud refuses a deflated body; ``lean`` off sends the packed inputs even where the lean
    frame is served (an edge of before, for the benchmark and tests)."""

    def __init__(self, name: str, root: str, codec: FeatureCodec | None, request: Request):
        self.name, self._root, self.codec, self._request = name, root.rstrip("/"), codec, request
        self._ways: dict[str, _Way | None] = {}  # per version, once negotiated
        self.deflate = True
        self.lean = True

    def way(self, version: str) -> str | None:
        """``"lean"``, ``"packed"`` or ``"fp32"``; None until negotiated."""
        if version not in self._ways:
            return None
        way = self._ways[version]
        return "fp32" if way is None else "lean" if isinstance(way, EscalatedFrame) else "packed"

    def send(self, x: np.ndarray, d: np.ndarray, version: str) -> tuple[int, bytes,
                                                                       dict[str, str], bool]:
        """Post one request for features ``x`` and details ``d`` in the negotiated way (FP32
        again after a 400 or 404), else as FP32. The answer, and whether it came from the lean
        route (raw FP32 scores)."""
        way = self._negotiate(version)
        if isinstance(way, EscalatedFrame) and (frames := way.pack(x, d)) is not None:
            answer = self._post(self._path(version, "lean", lean=True), frames.tobytes(), {},
                                lean=True)
        elif isinstance(way, EscalatedInputs) and (inputs := way.pack(x, d)) is not None:
            answer = self._post(self._path(version, "packed"), *_v2_body(inputs))
        else:
            answer = None
        if answer is not None:
            if answer[0] not in (400, 404):
                return (*answer, isinstance(way, EscalatedFrame))
            log.warning("cloud refused packed escalated frames for %s version %s (%s, %s); "
                        "sending FP32 to this version from now on", self.name, version,
                        answer[0], answer[1][:200])
            self._ways[version] = None
        answer = self._post(self._path(version), *_v2_body(
            {oip.EDGE_FEATURES: x, oip.DEVICE_DETAIL: d}))
        if way is _ABSENT and answer[0] == 200:  # the version is served, unpacked
            self._ways[version] = None
        return (*answer, False)

    def _path(self, version: str, kind: str = "", *, lean: bool = False) -> str:
        """A route of ``{name}[-{kind}]`` at ``version``: its metadata, ``/infer`` on it, or
        (``lean``) its lean route."""
        name = f"{self.name}-{kind}" if kind else self.name
        v = urllib.parse.quote(version, safe="")
        return (f"{self._root}{oip.LEAN_ROUTE}/{name}/{v}" if lean
                else f"{self._root}/v2/models/{name}/versions/{v}")

    def _negotiate(self, version: str) -> _Way | object | None:
        """How ``version`` takes escalated frames: the lean frame of ``{name}-lean`` where its
        metadata says so (unless :attr:`lean` is off), else the packed inputs of
        ``{name}-packed``; None: FP32; :data:`_ABSENT`: neither model is there (yet). Only
        an answer of 200 or 404 to each question is remembered: after any other (a cloud
        restarting) the way found serves this request and the cloud is asked again."""
        if self.codec is None:
            return None
        if version in self._ways:
            return self._ways[version]
        kinds = ("lean", "packed") if self.lean else ("packed",)
        statuses, way = [], None
        for kind in kinds:
            status, data, _ = self._request("GET", self._path(version, kind), None, {})
            statuses.append(status)
            if status == 200 and (way := advertised_way(kind, data, self.codec)):
                break
        if all(s == 404 for s in statuses):
            return _ABSENT
        if 200 not in statuses:
            return None
        if any(s not in (200, 404) for s in statuses):
            return way
        if len(self._ways) >= MAX_VERSIONS:
            self._ways.clear()
        self._ways[version] = way
        log.info("cloud %s version %s: escalated frames go %s", self.name, version,
                 "as FP32 (the cloud serves no packed model for this codec)" if way is None
                 else f"{'on the lean route' if isinstance(way, EscalatedFrame) else 'packed'}"
                 f" ({way.detail.codec.kind} details, deflated)")
        return way

    def _post(self, path: str, body: bytes, headers: dict[str, str], *,
              lean: bool = False) -> Answer:
        """Post deflated, or plain to a server that refused that. ``lean``: a lean frame to
        the lean route (``path`` is the route itself), whose filtered detail rows deflate's
        filtered strategy codes in 10% fewer bytes (1,095 against 1,215 B a frame, 64 test
        frames)."""
        path += "" if lean else "/infer"
        if self.deflate:
            deflate = zlib.compressobj(ESCALATED_DEFLATE, zlib.DEFLATED, 15, 8,
                                       zlib.Z_FILTERED if lean else zlib.Z_DEFAULT_STRATEGY)
            answer = self._request("POST", path, deflate.compress(body) + deflate.flush(),
                                   {**headers, "Content-Encoding": "deflate"})
            # 415 is HTTP's answer to an unsupported encoding (RFC 9110); some servers say 400
            refused = answer[0] == 415 or (answer[0] == 400 and b"encoding" in answer[1].lower())
            if not refused:
                return answer
            log.warning("cloud refused a deflated escalated request (%s, %s); sending them "
                        "plain from now on", answer[0], answer[1][:200])
            self.deflate = False
        return self._request("POST", path, body, headers)


def _v2_body(inputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """A v2 binary request for ``scores``; the v2 header-length header says it all."""
    body, headers = oip.encode_request(inputs, outputs=["scores"])
    del headers["Content-Type"]
    return body, headers


def advertised_way(kind: str, metadata: bytes, codec: FeatureCodec) -> _Way | None:
    """What ``{name}-{kind}`` takes, from its metadata, if its features take ``codec``: the
    lean frame's layout, or the packed model's inputs."""
    try:
        doc = bounded_json.loads(metadata)
        way = (EscalatedFrame if kind == "lean" else EscalatedInputs).from_metadata(doc)
    except (ValueError, CodecError):
        return None  # metadata this client cannot read: FP32 is always understood
    return way if way.features == codec else None
