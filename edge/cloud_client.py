"""The edge's client of the cloud tier: the Open Inference Protocol v2 over one keep-alive HTTP
connection (:class:`~ddnn.plumbing.http.KeepAliveConnection`).

``POST {cloud}/v2/models/{name}-cloud[-packed]/versions/{v}/infer`` with the edge features in the
binary tensor extension; the answer holds ``scores`` (B, C) (and ``entropy`` (B,) when asked
for). The features go packed in the bundle's edge codec to ``{name}-cloud-packed``
(``edge_features_packed``: 1 bit per value for binary features, 32× fewer bytes than FP32) when
the cloud serves that model for the version with the edge's codec, else as FP32 to
``{name}-cloud``: negotiated once per version from the packed model's metadata, and a cloud that
refuses packed features (400, or 404: the model went away) gets FP32 from then on. Packed
features that want ``scores`` alone go to the cloud's lean route where the packed model's
metadata says it answers there (``POST {cloud}/lean/{name}-cloud-packed/{v}``: the packed rows
in, the scores' FP32 bytes out, no JSON and a header or two: docs/cloud.md). One
keep-alive connection, a timeout, an optional bearer token, and a circuit breaker: after a
failure the edge stops calling for a backoff that doubles up to ``retry.maximum``, then tries
again by itself.

A frame that escalates (a bundle with an escalated cloud, docs/training.md) goes to the
escalated model by the way negotiated for it (:mod:`edge.cloud_escalated`), under the same
connection, lock and circuit breaker: :meth:`CloudClient.infer_escalated`.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.parse
from dataclasses import dataclass

import numpy as np
from urllib3.util import SKIP_HEADER

from ddnn import bounded_json, oip
from ddnn.codec import FeatureCodec
from ddnn.edge.cloud_escalated import MAX_VERSIONS, EscalatedRoute
from ddnn.errors import CodecError, DdnnError
from ddnn.plumbing.http import KeepAliveConnection
from ddnn.plumbing.retry import RetryPolicy

log = logging.getLogger(__name__)

# The circuit breaker's open time: short, the cloud is usually back within seconds.
CLOUD_RETRY = RetryPolicy(initial=0.25, maximum=5.0)
# Every request pays for its headers on the WAN link: none the cloud does not read (urllib3
# would add a User-Agent and Accept-Encoding: identity, which is the default anyway).
_LEAN = {"User-Agent": SKIP_HEADER, "Accept-Encoding": SKIP_HEADER}
# A negotiation that found no packed model (404): remembered only once FP32 is answered, since
# the version itself may be the one missing (an update under way).
_ABSENT = object()


class CloudError(DdnnError):
    """The cloud could not be reached or did not answer properly."""


class UnknownVersion(CloudError):
    """The cloud is up but does not serve this bundle version (404): not an outage."""


@dataclass(frozen=True)
class _Packing:
    """What the cloud's metadata said a version takes packed: rows of ``row_bytes`` bytes, each
    one sample of ``sample_shape`` encoded with ``codec``."""

    codec: FeatureCodec
    sample_shape: tuple[int, ...]
    row_bytes: int
    lean: bool = False  # the model answers the lean route, and its first output is FP32 scores

    def pack(self, x: np.ndarray) -> np.ndarray | None:
        """``x``'s rows, or None when unpacking them would not give back ``x`` bit for bit
        (features that did not go through this codec): those travel as FP32."""
        return self.codec.lossless_rows(x) if x.shape[1:] == self.sample_shape else None


class CloudClient:
    """Calls ``{name}-cloud`` of a cloud service; safe to share between threads (one at a time).

    ``codec``: the bundle's edge-features codec; a packing one (binary, int8, float16) lets the
    client send packed features to a cloud that takes them. ``escalated``: the name of the
    escalated model (``{name}-escalated``), for bundles that escalate."""

    def __init__(self, base_url: str, model: str, *, token: str | None = None,
                 timeout: float = 2.0, retry: RetryPolicy = CLOUD_RETRY,
                 ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, codec: str | None = None,
                 escalated: str | None = None):
        self._cloud = KeepAliveConnection(base_url, "cloud", timeout, ca_file,
                                          cert_file=cert_file, key_file=key_file)
        self.url, self.model, self.timeout = base_url, model, timeout
        self._headers = {**_LEAN, **({"Authorization": f"Bearer {token}"} if token else {})}
        self.codec = FeatureCodec(codec) if codec in oip.PACKING_CODECS else None
        self._packing: dict[str | None, _Packing | None] = {}  # per version, once negotiated
        self._lock = threading.Lock()
        self._backoff = retry.backoff()  # the circuit is open while it runs
        self.up = True
        self._prefix = f"{self._cloud.path.rstrip('/')}/v2/models/{model}"
        self.escalated = escalated
        self.escalated_route = (EscalatedRoute(escalated, self._cloud.path, self.codec,
                                               self._request) if escalated is not None else None)

    def path(self, version: str | None = None, route: str = "/infer", *, packed: bool = False
             ) -> str:
        """The infer route (or another of the model's, or of its packed twin); pinned to
        ``version`` so features meet the cloud segment they were made for (during an update the
        cloud's default may already be the next version)."""
        prefix = f"{self._prefix}-packed" if packed else self._prefix
        if version is None:
            return f"{prefix}{route}"
        return f"{prefix}/versions/{urllib.parse.quote(version, safe='')}{route}"

    def available(self) -> bool:
        """False while the circuit is open (the last call failed and the backoff runs)."""
        return self._backoff.ready()

    def packed(self, version: str | None = None) -> bool | None:
        """Whether features for ``version`` go packed; None until negotiated."""
        with self._lock:
            if version not in self._packing:
                return None
            return self._packing[version] is not None

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]
                 ) -> tuple[int, bytes, dict[str, str]]:
        try:
            status, data, resp_headers = self._cloud.request(method, path, body,
                                                             {**self._headers, **headers})
        except (OSError, http.client.HTTPException) as e:
            raise CloudError(f"cloud {self._cloud.netloc} unreachable: {e}") from None
        if status == 401:
            raise CloudError("cloud refused the edge's bearer token (401): set --cloud-token / "
                             f"DDNN_EDGE_CLOUD_TOKEN to the cloud's --token ({data[:200]!r})")
        return status, data, resp_headers

    def _post(self, version: str | None, name: str, x: np.ndarray, outputs: list[str], *,
              lean: bool = False) -> tuple[int, bytes, dict[str, str]]:
        packed = name == oip.EDGE_FEATURES_PACKED
        if lean:  # the packed rows in, the scores out, raw: the fewest bytes on the WAN
            path = f"{self._cloud.path.rstrip('/')}{oip.LEAN_ROUTE}/{self.model}-packed"
            if version is not None:
                path += f"/{urllib.parse.quote(version, safe='')}"
            return self._request("POST", path, oip.encode_raw_request(x)[0], {})
        if packed and len(x) == 1:
            # A lone frame to the packed model (one input): a raw binary request, no JSON at
            # all; its answer holds every output, binary. Bytes on the WAN.
            body, headers = oip.encode_raw_request(x)
        else:
            body, headers = oip.encode_request({name: x}, outputs=outputs)
            del headers["Content-Type"]  # the v2 header-length header says it all
        return self._request("POST", self.path(version, packed=packed), body, headers)

    def infer(self, features: np.ndarray, version: str | None = None, *, entropy: bool = True
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """Cloud scores (B, C) and, when ``entropy`` asks for it, the entropy (B,) of a batch
        (the edge, which computes it from the scores, saves the bytes)."""
        x = np.ascontiguousarray(features, np.float32)
        outputs = ["scores", "entropy"] if entropy else ["scores"]
        with self._lock:
            try:
                status, data, resp_headers, lean = self._send(x, version, outputs)
                if status == 404 and version is not None:
                    raise UnknownVersion(f"cloud does not serve {self.model} version {version}: "
                                         f"{data[:200]!r}")
                if status != 200:
                    raise CloudError(f"cloud answered {status}: {data[:200]!r}")
                out = ({"scores": oip.decode_raw_response(data, len(x), "FP32")} if lean
                       else oip.decode_response(data, resp_headers))
                scores = out.get("scores")
                if scores is None or scores.shape[0] != len(x):
                    raise CloudError("cloud response lacks scores for every frame")
            except UnknownVersion:
                raise  # the circuit stays closed: other versions' frames still go up
            except (CloudError, oip.OipError) as e:
                self._failed(e)
                raise CloudError(str(e)) from None
            self._succeeded()
        return np.asarray(scores, np.float32), out.get("entropy") if entropy else None

    def infer_escalated(self, features: np.ndarray, detail: np.ndarray, version: str
                        ) -> np.ndarray:
        """The escalated cloud's scores (B, C) for edge features and the senders' details
        (B, S·c, r, r); :class:`UnknownVersion` when the cloud does not serve the model at
        that version (the caller falls back to the plain cloud)."""
        if self.escalated_route is None:
            raise UnknownVersion("this edge was not given the escalated model's name")
        x = np.ascontiguousarray(features, np.float32)
        d = np.ascontiguousarray(detail, np.float32)
        with self._lock:
            try:
                status, data, resp_headers, lean = self.escalated_route.send(x, d, version)
                if status == 404:
                    raise UnknownVersion(f"cloud does not serve {self.escalated} version "
                                         f"{version}: {data[:200]!r}")
                if status != 200:
                    raise CloudError(f"cloud answered {status}: {data[:200]!r}")
                scores = (oip.decode_raw_response(data, len(x), "FP32") if lean
                          else oip.decode_response(data, resp_headers).get("scores"))
                if scores is None or scores.shape[0] != len(features):
                    raise CloudError("cloud response lacks scores for every frame")
            except UnknownVersion:
                raise  # the circuit stays closed: the plain cloud answers these frames
            except (CloudError, oip.OipError) as e:
                self._failed(e)
                raise CloudError(str(e)) from None
            self._succeeded()
        return np.asarray(scores, np.float32)

    def escalated_way(self, version: str) -> str | None:
        """How escalated frames of ``version`` go: ``"lean"``, ``"packed"`` or ``"fp32"``;
        None until negotiated."""
        with self._lock:
            return self.escalated_route.way(version) if self.escalated_route else None

    def _send(self, x: np.ndarray, version: str | None, outputs: list[str]
              ) -> tuple[int, bytes, dict[str, str], bool]:
        """Post ``x`` packed where negotiated (FP32 again after a 400 or 404), else as FP32;
        the answer, and whether it came from the lean route (raw scores)."""
        packing = self._negotiate(version)
        rows = packing.pack(x) if isinstance(packing, _Packing) else None
        if rows is not None and isinstance(packing, _Packing):
            lean = packing.lean and outputs == ["scores"]
            answer = self._post(version, oip.EDGE_FEATURES_PACKED, rows, outputs, lean=lean)
            if answer[0] not in (400, 404):
                return (*answer, lean)
            log.warning("cloud refused packed features for %s version %s (%s, %s); sending FP32 "
                        "to this version from now on", self.model, version, answer[0],
                        answer[1][:200])
            self._remember(version, None)
        answer = self._post(version, oip.EDGE_FEATURES, x, outputs)
        if packing is _ABSENT and answer[0] == 200:  # the version is served, unpacked
            self._remember(version, None)
        return (*answer, False)

    def _negotiate(self, version: str | None) -> _Packing | object | None:
        """How ``version`` takes packed features, from the metadata of ``{model}-packed`` at
        that version (asked once per version; :data:`_ABSENT` for a 404, remembered by
        :meth:`_send` once FP32 is answered; any other answer but 200 is asked again next
        time)."""
        if self.codec is None:
            return None
        if version in self._packing:
            return self._packing[version]
        status, data, _ = self._request("GET", self.path(version, route="", packed=True), None,
                                        {})
        if status == 404:
            return _ABSENT
        if status != 200:
            return None
        packing = _advertised(data, self.codec)
        self._remember(version, packing)
        return packing

    def _remember(self, version: str | None, packing: _Packing | None) -> None:
        if len(self._packing) >= MAX_VERSIONS:
            self._packing.clear()
        self._packing[version] = packing
        log.info("cloud %s version %s: edge features go %s", self.model, version,
                 f"packed ({self.codec.kind if self.codec else '?'}, {packing.row_bytes} "
                 f"bytes per frame"
                 f"{', lean route' if packing.lean else ''})"
                 if packing else "as FP32 (the cloud serves no packed model for this codec)")

    def ready(self) -> bool:
        """``GET /v2/health/ready`` answered 200."""
        with self._lock:
            try:
                status, _, _ = self._request(
                    "GET", f"{self._cloud.path.rstrip('/')}/v2/health/ready", None, {})
            except CloudError:
                return False
        return status == 200

    def _failed(self, error: Exception) -> None:
        self._backoff.failed()
        if self.up:
            log.warning("cloud failed (%s): answering from the edge, degraded, until it returns",
                        error)
        self.up = False

    def _succeeded(self) -> None:
        if not self.up:
            log.info("cloud %s is back", self._cloud.netloc)
        self.up = True
        self._backoff.succeeded()

    def close(self) -> None:
        with self._lock:
            self._cloud.close()


def _advertised(metadata: bytes, codec: FeatureCodec) -> _Packing | None:
    """The packed model's one input, from its metadata, if it takes ``codec``; and whether the
    model answers the lean route with FP32 scores."""
    try:
        doc = bounded_json.loads(metadata)
        (meta,) = doc["inputs"]
        first = (doc.get("outputs") or [{}])[0]
        lean = ((doc.get("parameters") or {}).get("lean") is True
                and first.get("name") == "scores" and first.get("datatype") == "FP32")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # metadata this client cannot read: FP32 is always understood
    packing = _packed_input(meta, codec)
    return None if packing is None else _Packing(codec, packing.sample_shape,
                                                 packing.row_bytes, lean)


def _packed_input(meta: dict, codec: FeatureCodec) -> _Packing | None:
    """The packed edge features an input's metadata describes, if it takes ``codec``."""
    try:
        params = meta.get("parameters") or {}
        batch, *dims = params["unpacked_shape"]
        sample = tuple(int(d) for d in dims)
        row_bytes = codec.payload_size(sample)
    except (ValueError, KeyError, TypeError, AttributeError, CodecError):
        return None
    if (meta.get("name") != oip.EDGE_FEATURES_PACKED or meta.get("datatype") != "UINT8"
            or params.get("codec") != codec.kind or batch != -1
            or meta.get("shape") != [-1, row_bytes]):
        return None
    return _Packing(codec, sample, row_bytes)
