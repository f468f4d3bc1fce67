"""Packed edge features against the real cloud service: same answers, fewer bytes, clear refusals,
and an edge that negotiates them per version and falls back to FP32."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import numpy as np
import pytest

from ddnn import oip
from ddnn.bundle import load_bundle
from ddnn.codec import FeatureCodec
from ddnn.dataset import load_dataset
from ddnn.edge.cloud_client import CloudClient, UnknownVersion
from ddnn.runtime import BundleRuntime
from tests.support.cloud import cloud_inputs, post


@pytest.fixture(scope="module")
def features(tiny_bundle, tiny_data) -> np.ndarray:
    """Edge features of real test frames, as the edge forwards them (±1: the binary codec)."""
    ds = load_dataset(tiny_data.test)
    rt = BundleRuntime(load_bundle(tiny_bundle))
    x = cloud_inputs(rt, ds.X[:24].astype(np.float32), ds.present[:24])
    assert load_bundle(tiny_bundle).manifest.codec["edge_features"] == "binary"
    assert set(np.unique(x)) <= {-1.0, 1.0}
    return x


def _answer(url: str, inputs: dict, model: str = "tiny-cloud-packed", **kw
            ) -> dict[str, np.ndarray]:
    r = post(url, model, inputs, version="1", **kw)
    assert r.status_code == 200, r.text
    return oip.decode_response(r.content, r.headers)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_packed_and_fp32_requests_give_bit_identical_answers(cloud_tiny_url, features):
    rows = FeatureCodec("binary").encode_rows(features)
    assert rows.shape == (24, features[0].size // 8)
    fp32 = _answer(cloud_tiny_url, {"edge_features": features}, model="tiny-cloud")
    for binary in (True, False):  # JSON numbers work too
        out = _answer(cloud_tiny_url, {"edge_features_packed": rows}, binary=binary)
        assert _same(out["scores"], fp32["scores"]) and _same(out["entropy"], fp32["entropy"])
    one = _answer(cloud_tiny_url, {"edge_features_packed": rows[3:4]})
    assert _same(one["scores"], fp32["scores"][3:4])


@pytest.mark.parametrize(("model", "inputs", "message"), [
    ("tiny-cloud-packed", lambda x, r: {"edge_features_packed": r[:, :-1]},
     "input 'edge_features_packed' must have shape [-1, 32] (-1: any batch size), got [2, 31]"),
    ("tiny-cloud-packed", lambda x, r: {"edge_features_packed": r.view(np.int8)},
     "input 'edge_features_packed' must be UINT8, got INT8"),
    ("tiny-cloud-packed", lambda x, r: {"edge_features_packed": r[None]},
     "must have shape [-1, 32]"),
    ("tiny-cloud-packed", lambda x, r: {"edge_features_packed": r, "edge_features": x},
     "model tiny-cloud-packed has no input 'edge_features'"),
    ("tiny-cloud", lambda x, r: {"edge_features_packed": r},
     "model tiny-cloud has no input 'edge_features_packed'; its inputs are ['edge_features']"),
])
def test_bad_packed_inputs_get_a_400_that_says_why(cloud_tiny_url, features, model, inputs,
                                                  message):
    x = features[:2]
    r = post(cloud_tiny_url, model, inputs(x, FeatureCodec("binary").encode_rows(x)))
    assert r.status_code == 400
    assert message in r.json()["error"]


def test_a_standard_v2_client_sends_fp32_or_packed(cloud_tiny_url, features):
    """Triton's HTTP client, unchanged: FP32 to one model, packed rows to the other."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(cloud_tiny_url.removeprefix("http://"))
    try:
        (packed_meta,) = client.get_model_metadata("tiny-cloud-packed", "1")["inputs"]
        assert packed_meta["parameters"]["unpacked_shape"] == [-1, *features.shape[1:]]
        config = client.get_model_config("tiny-cloud-packed")
        assert [(t["data_type"], t["dims"]) for t in config["input"]] == [("TYPE_UINT8", [32])]
        x = httpclient.InferInput("edge_features", list(features.shape), "FP32")
        x.set_data_from_numpy(features, binary_data=True)
        fp32 = client.infer("tiny-cloud", [x]).as_numpy("scores")
        rows = FeatureCodec(packed_meta["parameters"]["codec"]).encode_rows(features)
        p = httpclient.InferInput(packed_meta["name"], list(rows.shape), "UINT8")
        p.set_data_from_numpy(rows, binary_data=True)
        packed = client.infer("tiny-cloud-packed", [p], model_version="1").as_numpy("scores")
        assert _same(packed, fp32)
    finally:
        client.close()


def test_a_raw_binary_request_goes_to_a_model_with_one_input(cloud_tiny_url, features):
    """Triton's raw binary request: no JSON, the body is the one input's bytes, every output
    comes back binary."""
    rows = FeatureCodec("binary").encode_rows(features[:3])
    fp32 = _answer(cloud_tiny_url, {"edge_features": features[:3]}, model="tiny-cloud")
    for model, x in (("tiny-cloud-packed", rows), ("tiny-cloud", features[:3])):
        body, headers = oip.encode_raw_request(x)
        r = httpx.post(f"{cloud_tiny_url}/v2/models/{model}/versions/1/infer", content=body,
                       headers=headers)
        assert r.status_code == 200, r.text
        out = oip.decode_response(r.content, r.headers)
        assert list(out) == ["scores", "entropy"] and _same(out["scores"], fp32["scores"])
    body, headers = oip.encode_raw_request(rows[:1, :-1])
    r = httpx.post(f"{cloud_tiny_url}/v2/models/tiny-cloud-packed/infer", content=body,
                   headers=headers)
    assert r.status_code == 400 and "a whole number of samples of 32 bytes" in r.text
    r = httpx.post(f"{cloud_tiny_url}/v2/models/tiny-full/infer", content=b"\0" * 64,
                   headers=headers)
    assert r.status_code == 400 and "needs a model with exactly one input" in r.text


def test_the_lean_route_answers_raw_scores_with_their_length_alone(cloud_tiny_url, features):
    """ddnn's lean route: a raw binary request in, the first output's bytes out, no JSON, no
    date, no content type; errors as on the v2 routes. The v2 answer keeps its headers."""
    rows = FeatureCodec("binary").encode_rows(features[:3])
    want = _answer(cloud_tiny_url, {"edge_features": features[:3]}, model="tiny-cloud")["scores"]
    meta = httpx.get(f"{cloud_tiny_url}/v2/models/tiny-cloud-packed/versions/1").json()
    assert meta["parameters"]["lean"] is True and meta["outputs"][0]["name"] == "scores"
    assert "lean" not in httpx.get(f"{cloud_tiny_url}/v2/models/tiny-full").json()["parameters"]
    with httpx.Client(base_url=cloud_tiny_url) as client:  # one keep-alive connection
        for path, body in (("/lean/tiny-cloud-packed/1", rows), ("/lean/tiny-cloud-packed", rows),
                           ("/lean/tiny-cloud/1", features[:3])):
            r = client.post(path, content=body.tobytes(), headers={oip.HEADER_LENGTH: "9"})
            assert r.status_code == 200, r.text
            assert list(r.headers) == ["content-length"]
            assert _same(oip.decode_raw_response(r.content, 3, "FP32"), want)
        v2 = client.post("/v2/models/tiny-cloud-packed/versions/1/infer",
                         content=rows.tobytes(), headers={oip.HEADER_LENGTH: "0"})
        assert v2.status_code == 200 and {"date", "content-type"} <= set(v2.headers)
        for path, body, status, message in (
                ("/lean/tiny-cloud-packed/1", rows.tobytes()[:-1], 400, "a whole number of"),
                ("/lean/tiny-cloud-packed/1", b"", 400, "a whole number of"),
                ("/lean/tiny-full/1", bytes(64), 400, "needs a model with exactly one input"),
                ("/lean/tiny-nothing/1", rows.tobytes(), 404, "tiny-nothing"),
                ("/lean/tiny-cloud-packed/7", rows.tobytes(), 404, "7")):
            r = client.post(path, content=body)
            assert r.status_code == status and message in r.json()["error"], (path, r.text)
    with pytest.raises(oip.OipError, match="does not hold 3 rows"):
        oip.decode_raw_response(want.tobytes()[:-4], 3, "FP32")
    metrics = httpx.get(f"{cloud_tiny_url}/metrics").text
    assert 'code="200",encoding="lean",model="tiny-cloud-packed",version="1"} 2' in metrics


# --- the edge's client --------------------------------------------------------------------------


def test_the_edge_negotiates_packing_per_version(cloud_tiny_url, features):
    packed = CloudClient(cloud_tiny_url, "tiny-cloud", codec="binary")
    plain = CloudClient(cloud_tiny_url, "tiny-cloud")  # no codec: FP32, never asks
    try:
        assert packed.packed("1") is None
        scores, entropy = packed.infer(features, "1")
        assert packed.packed("1") is True
        want, want_entropy = plain.infer(features, "1")
        assert plain.packed("1") is None
        assert _same(scores, want) and _same(entropy, want_entropy)
        scores_only, none = packed.infer(features[:5], "1", entropy=False)
        assert none is None and _same(scores_only, want[:5])
        # Scores alone go on the lean route: the packed rows and nothing else, raw scores back;
        # a lone frame that wants its entropy too goes as a v2 raw binary request.
        sent = []
        request = packed._cloud.request
        packed._cloud.request = lambda *a: sent.append(a) or request(*a)  # a spy on the wire
        one, none = packed.infer(features[7:8], "1", entropy=False)
        assert none is None and _same(one, want[7:8])
        two, _ = packed.infer(features[7:9], "1", entropy=False)
        assert _same(two, want[7:9])
        one, one_entropy = packed.infer(features[7:8], "1")
        assert _same(one, want[7:8]) and _same(one_entropy, want_entropy[7:8])
        (_, lean, _, lean_headers), (_, lean2, body2, _), (method, path, body, headers) = sent
        assert lean == lean2 == "/lean/tiny-cloud-packed/1"
        assert not {oip.HEADER_LENGTH, "Content-Type"} & set(lean_headers)
        assert body2 == FeatureCodec("binary").encode_rows(features[7:9]).tobytes()
        assert method == "POST" and path.endswith("/v2/models/tiny-cloud-packed/versions/1/infer")
        assert body == FeatureCodec("binary").encode_rows(features[7:8]).tobytes()
        assert headers[oip.HEADER_LENGTH] == "0" and "Content-Type" not in headers
        # Features that did not come through the binary codec travel as FP32, not as signs.
        zeros = np.zeros_like(features[:2])
        assert _same(packed.infer(zeros, "1")[0], plain.infer(zeros, "1")[0])
    finally:
        packed.close()
        plain.close()


def _copy_with_codec(src, dst, codec: str):
    shutil.copytree(src, dst)
    path = dst / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["codec"]["edge_features"] = codec
    path.write_text(json.dumps(manifest))
    return dst


def test_the_edge_sends_fp32_to_a_cloud_that_does_not_advertise_packing(
        cloud_server, tiny_bundle, features, tmp_path):
    bundle = _copy_with_codec(tiny_bundle, tmp_path / "tiny", "float32")
    url = cloud_server(bundle=bundle, poll_interval=0)
    assert httpx.get(f"{url}/v2/models/tiny-cloud-packed/versions/1").status_code == 404
    client = CloudClient(url, "tiny-cloud", codec="binary")
    try:
        assert client.packed("1") is None
        with pytest.raises(UnknownVersion):  # a 404 for the version itself is not "FP32"
            client.infer(features, "2")
        assert client.packed("2") is None and client.up
        scores, _ = client.infer(features, "1")
        assert client.packed("1") is False and client.up  # settled once FP32 was answered
        want = _answer(url, {"edge_features": features}, model="tiny-cloud")["scores"]
        assert _same(scores, want)
    finally:
        client.close()


def test_a_refusal_on_the_packed_path_falls_back_to_fp32_once_and_is_remembered(
        cloud_server, tiny_bundle, features, tmp_path, caplog):
    repo = tmp_path / "repo"
    repo.mkdir()
    bundle = _copy_with_codec(tiny_bundle, repo / "tiny", "binary")
    url = cloud_server(repository=repo, poll_interval=0)
    client = CloudClient(url, "tiny-cloud", codec="binary")
    try:
        before, _ = client.infer(features, "1")
        assert client.packed("1") is True
        # The same version reloaded without a packing codec: its packed model is gone (404).
        manifest = json.loads((bundle / "manifest.json").read_text())
        manifest["codec"]["edge_features"] = "float32"
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        assert httpx.post(f"{url}/v2/repository/models/tiny-cloud/load").status_code == 200
        assert httpx.get(f"{url}/v2/models/tiny-cloud-packed").status_code == 404
        with caplog.at_level(logging.WARNING, logger="ddnn.edge.cloud_client"):
            after, _ = client.infer(features, "1")
            again, _ = client.infer(features, "1")
        assert _same(after, before) and _same(again, before) and client.up
        assert client.packed("1") is False
        refused = [r for r in caplog.records if "refused packed features" in r.getMessage()]
        assert len(refused) == 1
        metrics = httpx.get(f"{url}/metrics").text
        assert 'code="200",encoding="binary",model="tiny-cloud",version="1"} 2' in metrics
    finally:
        client.close()


def test_the_edge_service_gives_its_cloud_client_the_bundles_codec(cloud_tiny_url, tiny_bundle,
                                                                   features):
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    settings = EdgeSettings(bundle=tiny_bundle, http_port=0, cloud=cloud_tiny_url)
    with EdgeService.from_settings(settings) as edge:
        cloud = edge.aggregator.cloud
        assert cloud.codec == FeatureCodec("binary")
        cloud.infer(features[:2], "1", entropy=False)
        assert cloud.packed("1") is True
