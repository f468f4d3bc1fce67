"""The cloud's model repository: hot reload, failed reloads, versions, without restarts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from ddnn import oip
from ddnn.cloud.repository import latest_key
from ddnn.errors import ConfigError
from ddnn.segment import sha256_file
from tests.support.polling import wait_for


def copy_bundle(src: Path, dst: Path, version: str) -> Path:
    """A copy of a bundle with another ``model.version`` (checksums cover the ONNX files only)."""
    shutil.copytree(src, dst)
    mf = dst / "manifest.json"
    data = json.loads(mf.read_text())
    data["model"]["version"] = version
    mf.write_text(json.dumps(data))
    return dst


def versions(url: str, model: str = "tiny-cloud") -> list[str]:
    r = httpx.get(f"{url}/v2/models/{model}")
    return r.json()["versions"] if r.status_code == 200 else []


def served_version(url: str, version: str | None = None) -> str:
    body, headers = oip.encode_request({"edge_features": np.zeros((1, 16, 4, 4), np.float32)},
                                       binary_outputs=False)
    path = "/v2/models/tiny-cloud" + (f"/versions/{version}" if version else "") + "/infer"
    r = httpx.post(url + path, content=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["model_version"]


def unavailable(url: str) -> dict[str, str]:
    index = httpx.post(url + "/v2/repository/index").json()
    return {e["version"]: e["reason"] for e in index
            if e["state"] == "UNAVAILABLE" and e["name"] == "tiny-cloud"}


def test_the_latest_version_follows_the_one_version_order():
    assert max(["2", "10", "9"], key=latest_key) == "10"
    assert max(["1.9", "1.10", "1.2"], key=latest_key) == "1.10"
    assert max(["a", "b2", "b10"], key=latest_key) == "b2"  # not numeric: as strings
    assert max(["beta", "1"], key=latest_key) == "1"  # numeric versions come after the rest


def test_hot_reload_and_failed_reloads(cloud_server, tiny_bundle, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(tiny_bundle, repo / "tiny-v1")
    url = cloud_server(repository=repo, poll_interval=0.1)
    assert versions(url) == ["1"] and served_version(url) == "1"

    # A new version dropped in becomes the default; the old one stays addressable.
    copy_bundle(tiny_bundle, repo / "tiny-v2", "2")
    wait_for(lambda: versions(url) == ["1", "2"] and versions(url, "tiny-full") == ["1", "2"])
    assert served_version(url) == "2" and served_version(url, "1") == "1"

    # A version with a tampered segment is reported; version 2 keeps serving as the default.
    staging = copy_bundle(tiny_bundle, tmp_path / "staging3", "3")
    data = bytearray((staging / "cloud.onnx").read_bytes())
    data[-10] ^= 0xFF
    (staging / "cloud.onnx").write_bytes(bytes(data))
    staging.rename(repo / "tiny-v3")
    reasons = wait_for(lambda: unavailable(url))
    assert "checksum mismatch for cloud.onnx" in reasons["3"]
    assert versions(url) == ["1", "2"] and served_version(url) == "2"
    metrics = httpx.get(url + "/metrics").text
    assert "ddnn_cloud_bundles_failed 1" in metrics
    assert 'ddnn_cloud_bundle_loads_total{result="failed"}' in metrics

    # Fixing the files is picked up too.
    shutil.copy(tiny_bundle / "cloud.onnx", repo / "tiny-v3" / "cloud.onnx")
    wait_for(lambda: versions(url) == ["1", "2", "3"])
    assert served_version(url) == "3" and not unavailable(url)

    # A graph ONNX Runtime refuses (its checksum updated to match) is reported the same way.
    bad = copy_bundle(tiny_bundle, tmp_path / "staging4", "4")
    (bad / "edge.onnx").write_bytes(b"this is not an onnx graph")
    mf = json.loads((bad / "manifest.json").read_text())
    mf["segments"]["edge"]["sha256"] = sha256_file(bad / "edge.onnx")
    (bad / "manifest.json").write_text(json.dumps(mf))
    bad.rename(repo / "tiny-v4")
    reasons = wait_for(lambda: unavailable(url))
    assert "ONNX Runtime cannot load" in reasons["4"] and served_version(url) == "3"

    # Tampering with a version already served keeps its loaded copy serving.
    (repo / "tiny-v1" / "cloud.onnx").write_bytes(b"garbage")
    wait_for(lambda: "1" in unavailable(url))
    assert served_version(url, "1") == "1"

    # Removing a directory stops serving its version.
    shutil.rmtree(repo / "tiny-v3")
    wait_for(lambda: versions(url) == ["1", "2"])
    assert served_version(url) == "2"


def test_duplicate_versions_and_explicit_rescans(cloud_server, tiny_bundle, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    url = cloud_server(repository=repo, poll_interval=0, wait_ready=False)
    assert httpx.get(url + "/v2/health/ready").status_code == 400  # nothing to serve yet
    assert httpx.get(url + "/v2/health/live").status_code == 200
    shutil.copytree(tiny_bundle, repo / "a")
    shutil.copytree(tiny_bundle, repo / "b")
    r = httpx.post(url + "/v2/repository/models/tiny-cloud/load")
    assert r.status_code == 200 and r.json()["versions"] == ["1"]
    assert "already served from" in unavailable(url)["1"]
    assert httpx.get(url + "/v2/health/ready").status_code == 200
    r = httpx.post(url + "/v2/repository/models/other-cloud/load")
    assert r.status_code == 404 and "unknown model" in r.json()["error"]


def test_a_lone_bundle_that_fails_to_load_stops_the_start(cloud_server, tiny_bundle, tmp_path):
    bad = shutil.copytree(tiny_bundle, tmp_path / "bad")
    (bad / "cloud.onnx").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"checksum mismatch for cloud\.onnx"):
        cloud_server(bundle=bad)
