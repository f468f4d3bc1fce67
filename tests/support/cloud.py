"""The cloud in this process (uvicorn, ONNX Runtime), its readiness, and inference requests."""

from __future__ import annotations

import contextlib
import time

import httpx
import numpy as np

from ddnn import oip
from ddnn.runtime import BundleRuntime, transmit


def cloud_wait_ready(url: str, timeout: float = 30.0, **client_args) -> None:
    """Poll ``/v2/health/ready`` until it answers 200 (readiness, not a guessed sleep)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=2.0, **client_args) as client:
        while True:
            try:
                if client.get("/v2/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} is not ready after {timeout} s")
            time.sleep(0.02)


@contextlib.contextmanager
def real_cloud(bundle, port: int = 0):
    """The real cloud service (uvicorn, ONNX Runtime) in this process, on a loopback port."""
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings

    with run_server(CloudSettings(bundle=bundle, port=port)) as server:
        yield server


def cloud_inputs(rt: BundleRuntime, X: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Edge features as the edge aggregator forwards them (the steps of ``all_exits``)."""
    b, v = X.shape[:2]
    feat_shape = rt.manifest.devices[0].output("features").sample_shape
    feats = np.zeros((b, v, *feat_shape), np.float32)
    for i in range(v):
        rows = np.flatnonzero(present[:, i])
        if rows.size:
            _, f = rt.device(i, X[rows, i])
            feats[rows, i] = transmit(f, rt.device_codec)
    _, edge = rt.edge(feats, present)
    return transmit(edge, rt.edge_codec)


def post(url: str, model: str, inputs: dict, *, version: str | None = None, **kw) -> httpx.Response:
    body, headers = oip.encode_request(inputs, **kw)
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


