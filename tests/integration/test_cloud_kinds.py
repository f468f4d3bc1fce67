"""The cloud serves every kind of bundle: a hierarchy that can escalate adds
``{name}-escalated`` (edge features and the senders' details → the escalated exit), and a
raw-offload reference bundle is served as ``{name}-raw`` beside the hierarchy of the same name.
Answers over v2 equal the offline runtime's on the same inputs."""

from __future__ import annotations

import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")  # the repository's bundles are trained here

from ddnn import oip
from ddnn.aggregation import aggregate
from ddnn.bundle import load_bundle
from ddnn.codec import MAX_ELEMENTS
from ddnn.dataset import load_dataset
from ddnn.edge.cloud_client import CloudClient, CloudError
from ddnn.packed_detail import EscalatedFrame
from ddnn.raw_runtime import RawRuntime
from ddnn.runtime import BundleRuntime, transmit
from tests.support.cloud import cloud_wait_ready


@pytest.fixture(scope="module")
def url(kinds_repository):
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings

    settings = CloudSettings(repository=kinds_repository, host="127.0.0.1", port=0,
                             poll_interval=0)
    with run_server(settings) as running:
        cloud_wait_ready(running.url)
        yield running.url


def _infer(url: str, model: str, **inputs: np.ndarray) -> httpx.Response:
    body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": "FP32",
                        "data": v.ravel().tolist()} for k, v in inputs.items()]}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=30)


def _scores(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}["scores"]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def test_the_repository_lists_every_kind(url):
    index = {e["name"]: e for e in httpx.post(f"{url}/v2/repository/index").json()}
    assert {"tiny-cloud", "tiny-full", "tiny-raw", "esc-cloud", "esc-full",
            "esc-escalated"} <= {n for n, e in index.items() if e["state"] == "READY"}
    assert "tiny-escalated" not in index  # the paper's network cannot escalate
    meta = httpx.get(f"{url}/v2/models/esc-escalated").json()
    assert [t["name"] for t in meta["inputs"]] == ["edge_features", "device_detail"]
    meta = httpx.get(f"{url}/v2/models/esc-escalated-packed").json()
    assert [t["name"] for t in meta["inputs"]] == ["edge_features_packed",
                                                   "device_detail_packed", "detail_present"]
    meta = httpx.get(f"{url}/v2/models/esc-escalated-lean").json()
    assert [t["name"] for t in meta["inputs"]] == ["escalated_frame"]
    assert meta["parameters"]["lean"] is True  # one input: it answers the lean route


def _escalated_inputs(kinds_repository, tiny_data, frames: int = 4):
    """Edge features and the senders' details of a few test frames, as the edge has them, and
    the offline runtime's escalated answer."""
    runtime = BundleRuntime(load_bundle(kinds_repository / "esc"))
    m = runtime.manifest
    ds = load_dataset(tiny_data.test, num_classes=m.num_classes)
    X, present = ds.X[:frames], ds.present[:frames]
    feats = np.stack([transmit(runtime.device(v, X[:, v])[1], runtime.device_codec)
                      for v in range(m.views)], axis=1)
    _, edge_features = runtime.edge(feats, present)
    edge_features = transmit(edge_features, runtime.edge_codec)
    detail = np.stack([transmit(runtime.device_detail(v, X[:, v]), runtime.detail_codec)
                       for v in range(m.views)], axis=1)
    want = runtime.escalated(edge_features, detail, present)
    detail = aggregate(detail, present, "concat")
    for got, expected in zip(runtime.escalation_request(X, present), (edge_features, detail),
                             strict=True):  # the runtime's own helper (benchmarks use it)
        np.testing.assert_array_equal(got, expected)
    return edge_features, detail, want, m.version


def test_the_escalated_model_answers_as_the_offline_runtime(url, kinds_repository, tiny_data):
    edge_features, detail, want, _ = _escalated_inputs(kinds_repository, tiny_data)
    got = _scores(_infer(url, "esc-escalated", edge_features=edge_features,
                         device_detail=detail))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class _NoEncodings(ThreadingHTTPServer):
    """A relay to the cloud that refuses any Content-Encoding (415, or ``refusal``), as a plain
    server may."""

    def __init__(self, upstream: str, refusal: tuple[int, bytes] = (415, b"unsupported")):
        self.upstream, self.refusal, self.refused = upstream, refusal, 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding"):
                    self.server.refused += 1
                    (status, data), headers = self.server.refusal, {}
                else:
                    r = httpx.post(self.server.upstream + self.path, content=body, timeout=30,
                                   headers={k: v for k, v in self.headers.items()
                                            if k.lower() not in ("host", "content-length")})
                    status, headers, data = r.status_code, r.headers, r.content
                self.send_response(status)
                for k in ("content-type", oip.HEADER_LENGTH.lower()):
                    if k in headers:
                        self.send_header(k, headers[k])
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_the_edge_sends_escalated_frames_deflated(url, kinds_repository, tiny_data):
    edge_features, detail, want, version = _escalated_inputs(kinds_repository, tiny_data)
    client = CloudClient(url, "esc-cloud", timeout=30, escalated="esc-escalated")
    got = client.infer_escalated(edge_features, detail, version)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert client.escalated_route.deflate  # the cloud took the deflated body
    # A bad request is answered 400 for what it is, not taken for a refused encoding.
    with pytest.raises(CloudError, match="400"):
        client.infer_escalated(edge_features, detail[:, 1:], version)
    assert client.escalated_route.deflate
    client.close()


@pytest.mark.parametrize("way", ["lean", "packed"])
def test_the_edge_sends_escalated_frames_packed_and_the_answer_is_the_fp32_one(
        url, kinds_repository, tiny_data, way):
    edge_features, detail, want, version = _escalated_inputs(kinds_repository, tiny_data,
                                                             frames=12)
    fp32 = CloudClient(url, "esc-cloud", timeout=30, escalated="esc-escalated")
    packed = CloudClient(url, "esc-cloud", timeout=30, escalated="esc-escalated",
                         codec=load_bundle(kinds_repository / "esc").manifest.codec[
                             "edge_features"])
    packed.escalated_route.lean = way == "lean"  # off: the packed inputs, as an edge of before
    try:
        got = packed.infer_escalated(edge_features, detail, version)
        assert packed.escalated_way(version) == way and fp32.escalated_way(version) is None
        # Packing is lossless: the cloud's answer is the FP32 request's, bit for bit.
        assert got.tobytes() == fp32.infer_escalated(edge_features, detail, version).tobytes()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        lone = packed.infer_escalated(edge_features[3:4], detail[3:4], version)
        assert lone.tobytes() == got[3:4].tobytes()
        # Details that did not come through the codec travel as FP32, answered all the same.
        off = detail + np.float32(1e-3) * (detail != 0)
        assert packed.infer_escalated(edge_features, off, version).shape == want.shape
        assert packed.escalated_way(version) == way
    finally:
        fp32.close()
        packed.close()


def test_the_lean_escalated_frame_refuses_malformed_bodies_with_a_400(url, kinds_repository,
                                                                     tiny_data):
    edge_features, detail, want, version = _escalated_inputs(kinds_repository, tiny_data)
    doc = httpx.get(f"{url}/v2/models/esc-escalated-lean").json()
    frame = EscalatedFrame.from_metadata(doc)
    frames = frame.pack(edge_features, detail)
    lean = f"{url}/lean/esc-escalated-lean/{version}"
    r = httpx.post(lean, content=frames.tobytes(), timeout=30)
    assert r.status_code == 200
    assert r.content == np.ascontiguousarray(
        _scores(_infer(url, "esc-escalated", edge_features=edge_features,
                       device_detail=detail))).tobytes()
    for body in (frames.tobytes()[:-1], frames.tobytes() + b"\0", b""):
        r = httpx.post(lean, content=body, timeout=30)
        assert r.status_code == 400 and "whole number of samples" in r.json()["error"], r.text
    r = httpx.post(lean, content=b"not deflate", headers={"Content-Encoding": "deflate"},
                   timeout=30)
    assert r.status_code == 400 and "deflate" in r.json()["error"]
    r = httpx.post(lean, content=zlib.compress(bytes(64 << 20)),
                   headers={"Content-Encoding": "deflate"}, timeout=30)  # a deflate bomb
    assert r.status_code == 413, r.text
    # More frames than one request may unpack (each frame's values, not its bytes, count).
    values = np.prod(frame.features_shape) + np.prod(frame.detail.sample_shape)
    many = int(MAX_ELEMENTS // values + 1)
    r = httpx.post(lean, content=zlib.compress(bytes(many * frame.frame_bytes)),
                   headers={"Content-Encoding": "deflate"}, timeout=60)
    assert r.status_code == 400 and "limit of one request" in r.json()["error"], r.text
    # Any bytes in whole frames decode (leniently): an answer, never a 5xx.
    noise = np.random.default_rng(0).integers(0, 256, frames.shape, dtype=np.uint8)
    r = httpx.post(lean, content=noise.tobytes(), timeout=30)
    assert r.status_code in (200, 400), r.text  # 400: scores too far out to be finite
    # A standard v2 client sends the same frames as a binary tensor and gets the same scores.
    body, headers = oip.encode_request({oip.ESCALATED_FRAME: frames}, outputs=["scores"])
    r = httpx.post(f"{url}/v2/models/esc-escalated-lean/versions/{version}/infer",
                   content=body, headers=headers, timeout=30)
    assert r.status_code == 200
    got = oip.decode_response(r.content, r.headers)["scores"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class _CloudOfBefore(ThreadingHTTPServer):
    """A relay to the cloud that serves no ``{name}-escalated-lean`` (404), as a cloud of before;
    it counts the requests each model's routes got."""

    def __init__(self, upstream: str):
        self.upstream, self.seen = upstream, []

        class Handler(BaseHTTPRequestHandler):
            def _relay(self, method: str):
                self.server.seen.append(self.path)
                if "escalated-lean" in self.path:
                    status, headers, data = 404, {}, b'{"error": "no such model"}'
                else:
                    body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                    r = httpx.request(method, self.server.upstream + self.path, content=body,
                                      timeout=30, headers={
                                          k: v for k, v in self.headers.items()
                                          if k.lower() not in ("host", "content-length")})
                    status, headers, data = r.status_code, r.headers, r.content
                self.send_response(status)
                if oip.HEADER_LENGTH.lower() in headers:
                    self.send_header(oip.HEADER_LENGTH, headers[oip.HEADER_LENGTH.lower()])
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._relay("GET")

            def do_POST(self):
                self._relay("POST")

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_a_cloud_without_the_lean_frame_gets_the_packed_inputs(url, kinds_repository,
                                                               tiny_data):
    edge_features, detail, want, version = _escalated_inputs(kinds_repository, tiny_data)
    relay = _CloudOfBefore(url)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    client = CloudClient(f"http://127.0.0.1:{relay.server_address[1]}", "esc-cloud",
                         timeout=30, escalated="esc-escalated",
                         codec=load_bundle(kinds_repository / "esc").manifest.codec[
                             "edge_features"])
    try:
        for _ in range(2):
            got = client.infer_escalated(edge_features, detail, version)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert client.escalated_way(version) == "packed"
        # The lean model's metadata was asked once; both frames went to the packed model.
        assert sum("escalated-lean" in path for path in relay.seen) == 1
        assert sum(path.endswith(f"escalated-packed/versions/{version}/infer")
                   for path in relay.seen) == 2
    finally:
        client.close()
        relay.shutdown()
        relay.server_close()


@pytest.mark.parametrize("refusal", [(415, b"unsupported media type"),
                                     (400, b"unsupported Content-Encoding 'deflate'")])
def test_a_server_refusing_the_encoding_gets_plain_escalated_frames(url, kinds_repository,
                                                                    tiny_data, refusal):
    edge_features, detail, want, version = _escalated_inputs(kinds_repository, tiny_data)
    relay = _NoEncodings(url, refusal)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        client = CloudClient(f"http://127.0.0.1:{relay.server_address[1]}", "esc-cloud",
                             timeout=30, escalated="esc-escalated")
        for _ in range(2):
            got = client.infer_escalated(edge_features, detail, version)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert not client.escalated_route.deflate and relay.refused == 1  # asked once, then plain
        client.close()
    finally:
        relay.shutdown()
        relay.server_close()


def test_the_escalated_model_needs_both_inputs(url, kinds_repository):
    seg = load_bundle(kinds_repository / "esc").manifest.escalated
    features = np.zeros((1, *seg.input("edge_features").sample_shape), np.float32)
    r = _infer(url, "esc-escalated", edge_features=features)
    assert r.status_code == 400 and "needs input 'device_detail'" in r.json()["error"]


def test_finite_but_huge_inputs_get_a_400_never_nan_scores(url, kinds_repository):
    # Round 3 found {name}-escalated answering 200 with NaN scores and entropy -0.0
    # ("certain") for finite but huge inputs. Inputs a codec bounds are range-checked against
    # the metadata's parameters.range; any other input whose scores overflow is refused too.
    m = load_bundle(kinds_repository / "esc").manifest
    meta = httpx.get(f"{url}/v2/models/esc-escalated").json()
    ranges = {t["name"]: t.get("parameters", {}).get("range") for t in meta["inputs"]}
    assert ranges["device_detail"] == [-1.0, 1.0]  # its detail codec's levels
    seg = m.escalated
    features = np.full((2, *seg.input("edge_features").sample_shape), 1e30, np.float32)
    detail = np.full((2, *seg.input("device_detail").sample_shape), 1e30, np.float32)
    r = _infer(url, "esc-escalated", edge_features=features, device_detail=detail)
    assert r.status_code == 400 and "must hold values in [-1, 1]" in r.json()["error"]
    # The default edge codec (int8) bounds nothing but finiteness: 1e30 features overflow the
    # cloud segment, and the answer is a 400, not NaN scores.
    assert ranges["edge_features"] is None and m.codec["edge_features"] == "int8"
    r = _infer(url, "esc-cloud", edge_features=features)
    if r.status_code == 200:  # (a network that saturates instead answers finite scores)
        assert np.isfinite(_scores(r)).all()
    else:
        assert r.status_code == 400 and "not finite" in r.json()["error"], r.text
    huge = np.full_like(features, 3.0e38)
    huge[:, ::2] *= -1  # (+inf and -inf inside the segment: NaN scores)
    r = _infer(url, "esc-cloud", edge_features=huge)
    assert r.status_code == 400 and "not finite" in r.json()["error"], r.text
    # The service keeps serving: a valid request still gets its answer.
    ok = _infer(url, "esc-escalated", edge_features=np.zeros_like(features),
                device_detail=np.zeros_like(detail))
    assert np.isfinite(_scores(ok)).all()


def test_the_raw_reference_is_served_beside_its_hierarchy(url, kinds_repository, tiny_data):
    reference = RawRuntime(load_bundle(kinds_repository / "tiny-raw", kind="raw"))
    ds = load_dataset(tiny_data.test, num_classes=reference.manifest.num_classes)
    views = ds.X[:5]
    got = _scores(_infer(url, "tiny-raw", views=views))
    np.testing.assert_allclose(got, reference.scores(views), rtol=1e-4, atol=1e-4)
    meta = httpx.get(f"{url}/v2/models/tiny-raw").json()
    assert [t["name"] for t in meta["inputs"]] == ["views"]
    assert meta["parameters"]["bundle"] == "tiny"
    r = _infer(url, "tiny-raw", views=views * 3.0)  # outside the bundle's input range
    assert r.status_code == 400 and "[0, 1]" in r.json()["error"]


def test_the_bundle_route_hands_out_hierarchies_only(url):
    # Devices update over the air from the hierarchy of their name, never from its reference.
    r = httpx.get(f"{url}/v1/bundles/tiny/1/manifest.json")
    assert r.status_code == 200 and r.json().get("kind", "ddnn") == "ddnn"
