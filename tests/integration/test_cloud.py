"""The cloud service over real HTTP: both models, JSON and binary, equal to ``ddnn evaluate``."""

from __future__ import annotations

import asyncio
import gzip
import json
import re

import httpx
import numpy as np
import pytest

from ddnn import oip
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.exits import entropy_of_logits
from ddnn.runtime import BundleRuntime
from ddnn.stacking import Stacking, stack
from ddnn.tools.evaluate import evaluate
from tests.support.cloud import cloud_inputs, post


@pytest.fixture(scope="module")
def reference(tiny_bundle, tiny_data):
    """The test set, its reference exits from ONNX Runtime, and ``ddnn evaluate``'s result."""
    ds = load_dataset(tiny_data.test)
    rt = BundleRuntime(load_bundle(tiny_bundle))
    X, present = ds.X.astype(np.float32), ds.present
    return {
        "X": X, "present": present, "label": ds.label,
        "exits": rt.all_exits(X, present),
        "segments": rt.all_exits(X, present, stacked=False),  # each segment's own scores
        "edge_features": cloud_inputs(rt, X, present),
        "evaluate": evaluate(tiny_bundle, tiny_data.test),
    }


def infer(url: str, model: str, inputs: dict, **kw) -> dict[str, np.ndarray]:
    r = post(url, model, inputs, **kw)
    assert r.status_code == 200, r.text
    return oip.decode_response(r.content, r.headers)


def test_server_health_and_metadata(cloud_tiny_url, tiny_bundle):
    get = lambda path: httpx.get(cloud_tiny_url + path)  # noqa: E731
    assert get("/v2/health/live").json() == {"live": True}
    assert get("/v2/health/ready").status_code == 200
    meta = get("/v2").json()
    assert meta["name"] == "ddnn-cloud" and "binary_tensor_data" in meta["extensions"]
    m = load_bundle(tiny_bundle).manifest
    cloud = get("/v2/models/tiny-cloud").json()
    assert cloud["versions"] == ["1"] and cloud["platform"] == "onnxruntime_onnx"
    sample = list(m.cloud.inputs[0].sample_shape)
    # (binary edge features decode to ±1: the range a generic client keeps to)
    assert cloud["inputs"] == [{"name": "edge_features", "datatype": "FP32",
                                "shape": [-1, *sample], "parameters": {"range": [-1.0, 1.0]}}]
    outputs = [{"name": "scores", "datatype": "FP32", "shape": [-1, 3]},
               {"name": "entropy", "datatype": "FP32", "shape": [-1]}]
    assert cloud["outputs"] == outputs
    packed = get("/v2/models/tiny-cloud-packed").json()  # the same, in the bundle's edge codec
    assert packed["inputs"] == [
        {"name": "edge_features_packed", "datatype": "UINT8",
         "shape": [-1, (int(np.prod(sample)) + 7) // 8],
         "parameters": {"codec": "binary", "unpacked_name": "edge_features",
                        "unpacked_datatype": "FP32", "unpacked_shape": [-1, *sample]}}]
    assert packed["outputs"] == outputs
    full = get("/v2/models/tiny-full/versions/1").json()
    assert full["inputs"] == [{"name": "views", "datatype": "FP32", "shape": [-1, 3, 3, 16, 16],
                               "parameters": {"range": [0.0, 1.0]}},
                              {"name": "present", "datatype": "BOOL", "shape": [-1, 3]}]
    assert get("/v2/models/tiny-full/ready").json()["ready"] is True
    assert get("/v2/models/tiny-cloud/versions/1/ready").status_code == 200
    assert get("/v2/models/tiny-cloud/config").json()["max_batch_size"] == 64
    assert "/v2/models/{model_name}/infer" in get("/openapi.json").json()["paths"]
    assert get("/docs").status_code == 200


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_full_model_equals_evaluate(cloud_tiny_url, reference, binary):
    out = infer(cloud_tiny_url, "tiny-full", {"views": reference["X"],
                                              "present": reference["present"]},
                binary=binary, binary_outputs=binary)
    want = reference["exits"]["cloud"]
    np.testing.assert_allclose(out["scores"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["entropy"], entropy_of_logits(want), atol=1e-6)
    accuracy = float((out["scores"].argmax(1) == reference["label"]).mean())
    assert accuracy == reference["evaluate"]["accuracy"]["cloud"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_cloud_model_equals_evaluate(cloud_tiny_url, tiny_bundle, reference, binary):
    out = infer(cloud_tiny_url, "tiny-cloud", {"edge_features": reference["edge_features"]},
                binary=binary, binary_outputs=binary)
    # The cloud segment answers with its own scores; the edge stacks them on its answer where
    # the bundle stacks its exits, and then they are the hierarchy's cloud exit.
    np.testing.assert_allclose(out["scores"], reference["segments"]["cloud"], rtol=1e-5,
                               atol=1e-5)
    stacking = load_bundle(tiny_bundle).manifest.stacking or Stacking()
    answer = stack(reference["exits"]["edge"], out["scores"], stacking.cloud)
    np.testing.assert_allclose(answer, reference["exits"]["cloud"], rtol=1e-5, atol=1e-5)
    accuracy = float((answer.argmax(1) == reference["label"]).mean())
    assert accuracy == reference["evaluate"]["accuracy"]["cloud"]


def test_versions_outputs_and_request_ids(cloud_tiny_url, reference):
    inputs = {"edge_features": reference["edge_features"][:4]}
    r = post(cloud_tiny_url, "tiny-cloud", inputs, version="1", outputs=["entropy"],
             binary_outputs=False, request_id="req-7")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    obj = r.json()
    assert (obj["id"], obj["model_name"], obj["model_version"]) == ("req-7", "tiny-cloud", "1")
    assert [o["name"] for o in obj["outputs"]] == ["entropy"]
    # One output in binary, one in JSON, as a standard client may ask.
    head = json.dumps({"inputs": [{"name": "edge_features", "datatype": "FP32",
                                   "shape": list(inputs["edge_features"].shape),
                                   "data": inputs["edge_features"].ravel().tolist()}],
                       "outputs": [{"name": "scores", "parameters": {"binary_data": True}},
                                   {"name": "entropy"}]}).encode()
    r = httpx.post(cloud_tiny_url + "/v2/models/tiny-cloud/infer", content=head)
    out = oip.decode_response(r.content, r.headers)
    np.testing.assert_allclose(out["scores"], reference["segments"]["cloud"][:4], atol=1e-5)
    assert json.loads(r.content[:int(r.headers[oip.HEADER_LENGTH])])["outputs"][1]["data"]


def test_gzip_request_body(cloud_tiny_url, reference):
    body, headers = oip.encode_request({"edge_features": reference["edge_features"][:2]})
    r = httpx.post(cloud_tiny_url + "/v2/models/tiny-cloud/infer", content=gzip.compress(body),
                   headers={**headers, "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    r = httpx.post(cloud_tiny_url + "/v2/models/tiny-cloud/infer", content=b"not gzip",
                   headers={**headers, "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip" in r.json()["error"]


async def _concurrently(url: str, model: str, samples: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def one(inputs):
            body, headers = oip.encode_request(inputs)
            r = await client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            return oip.decode_response(r.content, r.headers)

        return await asyncio.gather(*(one(s) for s in samples))


def test_concurrent_requests_are_batched(cloud_server, tiny_bundle, reference):
    url = cloud_server(bundle=tiny_bundle, max_batch_size=8, max_queue_delay_ms=250,
                       poll_interval=0)
    idx = list(range(16))
    samples = [{"views": reference["X"][i:i + 1], "present": reference["present"][i:i + 1]}
               for i in idx]
    results = asyncio.run(_concurrently(url, "tiny-full", samples))
    got = np.concatenate([r["scores"] for r in results])
    np.testing.assert_allclose(got, reference["exits"]["cloud"][idx], rtol=1e-4, atol=1e-4)
    metrics = httpx.get(url + "/metrics").text
    labels = '{model="tiny-full",version="1"}'
    runs = float(metrics.split(f"ddnn_cloud_batch_size_count{labels} ")[1].split()[0])
    total = float(metrics.split(f"ddnn_cloud_batch_size_sum{labels} ")[1].split()[0])
    assert total == 16 and runs < 16  # at least one ONNX Runtime call served several requests
    assert f'ddnn_cloud_batch_size_bucket{{le="8.0",model="tiny-full",version="1"}} {runs:.1f}' \
        in metrics  # and none went past the maximum batch size
    assert f"ddnn_cloud_queue_depth{labels} 0" in metrics


def test_batching_off_runs_each_request_alone(cloud_server, tiny_bundle, reference):
    url = cloud_server(bundle=tiny_bundle, batching=False, poll_interval=0)
    samples = [{"edge_features": reference["edge_features"][i:i + 2]} for i in range(0, 12, 2)]
    results = asyncio.run(_concurrently(url, "tiny-cloud", samples))
    got = np.concatenate([r["scores"] for r in results])
    np.testing.assert_allclose(got, reference["segments"]["cloud"][:12], rtol=1e-4, atol=1e-4)
    metrics = httpx.get(url + "/metrics").text
    assert 'ddnn_cloud_batch_size_count{model="tiny-cloud",version="1"} 6' in metrics
    assert httpx.get(url + "/v2/models/tiny-cloud/config").json()["max_batch_size"] == 0


def test_metrics_count_requests_and_errors(cloud_tiny_url, reference):
    infer(cloud_tiny_url, "tiny-cloud", {"edge_features": reference["edge_features"][:1]})
    post(cloud_tiny_url, "tiny-cloud", {"wrong": reference["edge_features"][:1]})
    post(cloud_tiny_url, "nope", {"x": np.zeros(1, np.float32)})
    r = httpx.get(cloud_tiny_url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    assert ('ddnn_cloud_requests_total{code="200",encoding="binary",model="tiny-cloud",'
            'version="1"}') in text
    assert 'code="400"' in text and 'ddnn_cloud_errors_total{kind="bad_request"}' in text
    assert 'ddnn_cloud_errors_total{kind="not_found"}' in text
    assert 'ddnn_cloud_request_seconds_bucket{le="+Inf",model="tiny-cloud",version="1"}' in text
    assert 'ddnn_cloud_model_ready{model="tiny-full",version="1"} 1' in text
    assert "ddnn_cloud_bundles_failed 0" in text


def test_a_standard_v2_client_works_unchanged(cloud_tiny_url, reference):
    """Triton's HTTP client (in the dev extra), unchanged, against the cloud."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(cloud_tiny_url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("tiny-full")
        assert client.get_model_metadata("tiny-cloud")["inputs"][0]["name"] == "edge_features"
        X, present = reference["X"][:5], reference["present"][:5]
        views = httpclient.InferInput("views", list(X.shape), "FP32")
        views.set_data_from_numpy(X, binary_data=True)
        mask = httpclient.InferInput("present", list(present.shape), "BOOL")
        mask.set_data_from_numpy(present, binary_data=False)
        outputs = [httpclient.InferRequestedOutput("scores", binary_data=True),
                   httpclient.InferRequestedOutput("entropy", binary_data=False)]
        result = client.infer("tiny-full", [views, mask], outputs=outputs, model_version="1")
        np.testing.assert_allclose(result.as_numpy("scores"), reference["exits"]["cloud"][:5],
                                   atol=1e-5)
        assert result.as_numpy("entropy").shape == (5,)
        with pytest.raises(Exception, match="unknown model"):
            client.infer("nope", [views, mask])
    finally:
        client.close()


def _raw(head: dict, binary: bytes = b"", header: str | None = None) -> tuple[bytes, dict]:
    text = json.dumps(head).encode()
    headers = {oip.HEADER_LENGTH: header or str(len(text))} if binary or header else {}
    return text + binary, headers


_FEAT = {"name": "edge_features", "datatype": "FP32", "shape": [1, 16, 4, 4]}
_FEAT_BYTES = np.zeros((1, 16, 4, 4), np.float32).tobytes()
_BAD_REQUESTS = {
    "not json": ("tiny-cloud", b"\x00garbage", {}, 400, "not valid JSON"),
    "json array": ("tiny-cloud", b"[1, 2]", {}, 400, "must be a JSON object"),
    "empty body": ("tiny-cloud", b"", {}, 400, "empty"),
    "wrong tensor name": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "name": "x",
                                                           "data": [0.0] * 256}]}),
                          400, "has no input 'x'"),
    "missing input": ("tiny-full", *_raw({"inputs": [{"name": "present", "datatype": "BOOL",
                                                       "shape": [1, 3],
                                                       "data": [True] * 3}]}),
                      400, "needs input 'views'"),
    "wrong shape": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "shape": [1, 16, 4, 5],
                                                     "data": [0.0] * 320}]}),
                    400, r"must have shape \[-1, 16, 4, 4\]"),
    "wrong rank": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "shape": [256], "data": [0] * 256}]}),
                   400, "must have shape"),
    "wrong datatype": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "datatype": "FP64",
                                                        "data": [0.0] * 256}]}),
                       400, "must be FP32, got FP64"),
    "batch disagreement": ("tiny-full", *_raw({"inputs": [
        {"name": "views", "datatype": "FP32", "shape": [2, 3, 3, 16, 16],
         "parameters": {"binary_data_size": 2 * 3 * 768 * 4}},
        {"name": "present", "datatype": "BOOL", "shape": [1, 3], "data": [True] * 3}]},
        bytes(2 * 3 * 768 * 4)), 400, "disagree on the batch size"),
    "empty batch": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "shape": [0, 16, 4, 4],
                                                     "data": []}]}), 400, "at least one sample"),
    "NaN input": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "parameters": {
        "binary_data_size": 1024}}]}, np.full(256, np.nan, np.float32).tobytes()),
        400, "NaN or infinite"),
    "unknown output": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "data": [0.0] * 256}],
                                           "outputs": [{"name": "logits"}]}),
                       400, "has no output 'logits'"),
    "truncated binary": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "parameters": {
        "binary_data_size": 1024}}]}, _FEAT_BYTES[:500]), 400, "truncated body"),
    "lying binary_data_size": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "parameters": {
        "binary_data_size": 1000}}]}, _FEAT_BYTES[:1000]), 400, "needs 1024"),
    "trailing bytes": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "parameters": {
        "binary_data_size": 1024}}]}, _FEAT_BYTES + b"xx"), 400, "2 bytes after"),
    "lying header length": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "parameters": {
        "binary_data_size": 1024}}]}, _FEAT_BYTES, header="999999"), 400, "1..body length"),
    "header length not a number": ("tiny-cloud", *_raw({"inputs": []}, b"x", header="12x"),
                                   400, "must be an integer"),
    "BYTES datatype": ("tiny-cloud", *_raw({"inputs": [{**_FEAT, "datatype": "BYTES",
                                                        "data": ["a"]}]}), 400, "BYTES"),
    "views out of range": ("tiny-full", *_raw({"inputs": [
        {"name": "views", "datatype": "FP32", "shape": [1, 3, 3, 16, 16],
         "parameters": {"binary_data_size": 3 * 768 * 4}},
        {"name": "present", "datatype": "BOOL", "shape": [1, 3], "data": [True] * 3}]},
        np.full(3 * 768, 1e30, np.float32).tobytes()), 400, r"values in \[0, 1\]"),
    "unknown model": ("tiny-edge", b"{}", {}, 404, "unknown model 'tiny-edge'"),
}


@pytest.mark.parametrize("case", list(_BAD_REQUESTS))
def test_bad_requests_get_4xx_and_the_server_keeps_serving(cloud_tiny_url, reference, case):
    model, body, headers, status, match = _BAD_REQUESTS[case]
    r = httpx.post(f"{cloud_tiny_url}/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}
    assert re.search(match, r.json()["error"]), r.json()["error"]
    infer(cloud_tiny_url, "tiny-cloud", {"edge_features": reference["edge_features"][:1]})


def test_unknown_versions_routes_and_methods(cloud_tiny_url):
    body, headers = oip.encode_request({"edge_features": np.zeros((1, 16, 4, 4), np.float32)})
    r = httpx.post(cloud_tiny_url + "/v2/models/tiny-cloud/versions/7/infer", content=body,
                   headers=headers)
    assert r.status_code == 404 and "has no version '7'" in r.json()["error"]
    assert httpx.get(cloud_tiny_url + "/v2/models/tiny-cloud/versions/7").status_code == 404
    assert httpx.get(cloud_tiny_url + "/v2/models/nope/ready").status_code == 404
    r = httpx.get(cloud_tiny_url + "/v2/models/tiny-cloud/infer")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(cloud_tiny_url + "/v3/anything").json() == {"error": "Not Found"}


def test_one_failing_request_does_not_fail_its_batch():
    from concurrent.futures import ThreadPoolExecutor

    from ddnn.cloud.batching import Batcher

    sizes = []

    def predict(inputs):
        sizes.append(len(inputs["x"]))
        if (inputs["x"] < 0).any():
            raise oip.OipError("negative input")
        return {"y": inputs["x"] * 2}

    async def main():
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher("m", predict, pool, max_batch_size=8, max_queue_delay=0.5)
            with batcher.expecting(), batcher.expecting(), batcher.expecting():
                calls = [asyncio.ensure_future(batcher.submit({"x": np.full((1, 2), v)}, 1))
                         for v in (1.0, -1.0, 3.0)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            await batcher.close()
        return results

    good, bad, other = asyncio.run(main())
    assert sizes == [3, 1, 1, 1]  # the batch failed, then each request ran alone
    assert isinstance(bad, oip.OipError)
    np.testing.assert_array_equal(good["y"], [[2.0, 2.0]])
    np.testing.assert_array_equal(other["y"], [[6.0, 6.0]])
