"""The edge's client of the cloud tier: the Open Inference Protocol v2 over ``http.client``.

``POST {cloud}/v2/models/{name}-cloud/versions/{v}/infer`` with the edge features as FP32 in the
binary tensor extension; the answer holds ``scores`` (B, C) and ``entropy`` (B,). One
keep-alive connection, a timeout, an optional bearer token, and a circuit breaker: after a
failure the edge stops calling for a backoff that doubles up to ``retry.maximum``, then tries
again by itself.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.parse

import numpy as np

from ddnn import oip
from ddnn.errors import DdnnError
from ddnn.plumbing.http import KeepAliveConnection
from ddnn.plumbing.retry import RetryPolicy

log = logging.getLogger(__name__)

# The circuit breaker's open time: short, the cloud is usually back within seconds.
CLOUD_RETRY = RetryPolicy(initial=0.25, maximum=5.0)


class CloudError(DdnnError):
    """The cloud could not be reached or did not answer properly."""


class UnknownVersion(CloudError):
    """The cloud is up but does not serve this bundle version (404): not an outage."""


class CloudClient:
    """Calls ``{name}-cloud`` of a cloud service; safe to share between threads (one at a time)."""

    def __init__(self, base_url: str, model: str, *, token: str | None = None,
                 timeout: float = 2.0, retry: RetryPolicy = CLOUD_RETRY,
                 ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None):
        self._cloud = KeepAliveConnection(base_url, "cloud", timeout, ca_file,
                                          cert_file=cert_file, key_file=key_file)
        self.url, self.model, self.timeout = base_url, model, timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._lock = threading.Lock()
        self._backoff = retry.backoff()  # the circuit is open while it runs
        self.up = True
        self._prefix = f"{self._cloud.path.rstrip('/')}/v2/models/{model}"

    def path(self, version: str | None = None) -> str:
        """The infer route; pinned to ``version`` so features meet the cloud segment they were
        made for (during an update the cloud's default may already be the next version)."""
        if version is None:
            return f"{self._prefix}/infer"
        return f"{self._prefix}/versions/{urllib.parse.quote(version, safe='')}/infer"

    def available(self) -> bool:
        """False while the circuit is open (the last call failed and the backoff runs)."""
        return self._backoff.ready()

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]
                 ) -> tuple[int, bytes, dict[str, str]]:
        try:
            return self._cloud.request(method, path, body, {**self._headers, **headers})
        except (OSError, http.client.HTTPException) as e:
            raise CloudError(f"cloud {self._cloud.netloc} unreachable: {e}") from None

    def infer(self, features: np.ndarray, version: str | None = None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """Cloud scores (B, C) and, when the cloud sends it, the entropy (B,) of a batch."""
        body, headers = oip.encode_request({"edge_features": np.asarray(features, np.float32)},
                                           outputs=["scores", "entropy"])
        with self._lock:
            try:
                status, data, resp_headers = self._request("POST", self.path(version), body,
                                                            headers)
                if status == 401:
                    raise CloudError("cloud refused the edge's bearer token (401): set "
                                     "--cloud-token / DDNN_EDGE_CLOUD_TOKEN to the cloud's "
                                     f"--token ({data[:200]!r})")
                if status == 404 and version is not None:
                    raise UnknownVersion(f"cloud does not serve {self.model} version {version}: "
                                         f"{data[:200]!r}")
                if status != 200:
                    raise CloudError(f"cloud answered {status}: {data[:200]!r}")
                out = oip.decode_response(data, resp_headers)
                scores = out.get("scores")
                if scores is None or scores.shape[0] != len(features):
                    raise CloudError("cloud response lacks scores for every frame")
            except UnknownVersion:
                raise  # the circuit stays closed: other versions' frames still go up
            except (CloudError, oip.OipError) as e:
                self._failed(e)
                raise CloudError(str(e)) from None
            self._succeeded()
        return np.asarray(scores, np.float32), out.get("entropy")

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
