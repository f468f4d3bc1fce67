"""Operating the cloud: bearer token, body limits, TLS, the CLI, settings from the environment."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import zlib

import httpx
import numpy as np
import pytest

from ddnn import oip
from ddnn.cloud.cli import settings_from
from ddnn.errors import ConfigError
from ddnn.segment import sha256_file
from ddnn.tools.broker import free_port
from tests.support.cloud import cloud_wait_ready

FEATURES = {"edge_features": np.zeros((1, 16, 4, 4), np.float32)}


def test_bearer_token_and_body_limit(cloud_server, tiny_bundle):
    url = cloud_server(bundle=tiny_bundle, token="s3cret", max_body_bytes=4096, poll_interval=0)
    auth = {"Authorization": "Bearer s3cret"}
    assert httpx.get(url + "/v2/health/ready").status_code == 200  # probes need no token
    r = httpx.get(url + "/v2")
    assert r.status_code == 401 and r.json() == {"error": "missing bearer token"}
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.get(url + "/v2", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json() == {"error": "invalid bearer token"}
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/v2", headers=auth).status_code == 200

    body, headers = oip.encode_request(FEATURES)
    infer = url + "/v2/models/tiny-cloud/infer"
    assert httpx.post(infer, content=body, headers=headers).status_code == 401
    assert httpx.post(infer, content=body, headers={**headers, **auth}).status_code == 200

    big, big_headers = oip.encode_request({"edge_features": np.zeros((8, 16, 4, 4), np.float32)})
    r = httpx.post(infer, content=big, headers={**big_headers, **auth})
    assert r.status_code == 413 and "exceeds the limit of 4096" in r.json()["error"]
    # Without a Content-Length (chunked), the limit holds while reading.
    r = httpx.post(infer, content=iter([big[:3000], big[3000:]]), headers={**big_headers, **auth})
    assert r.status_code == 413
    # A small compressed body that inflates past the limit is refused too.
    bomb = zlib.compress(big + bytes(100_000))
    r = httpx.post(infer, content=bomb, headers={**big_headers, **auth,
                                                 "Content-Encoding": "deflate"})
    assert r.status_code == 413 and "decompressed body" in r.json()["error"]
    assert httpx.post(infer, content=body, headers={**headers, **auth}).status_code == 200
    lean = url + "/lean/tiny-cloud/1"  # the lean route: the same token, the same bound
    assert httpx.post(lean, content=bytes(1024)).status_code == 401
    assert httpx.post(lean, content=bytes(8 * 1024), headers=auth).status_code == 413
    assert httpx.post(lean, content=bytes(1024), headers=auth).status_code == 200
    metrics = httpx.get(url + "/metrics", headers=auth).text
    assert 'ddnn_cloud_errors_total{kind="unauthorized"} 5' in metrics
    assert 'ddnn_cloud_errors_total{kind="too_large"} 4' in metrics


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(cloud_server, tiny_bundle, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    url = cloud_server(bundle=tiny_bundle, ssl_certfile=cert, ssl_keyfile=key, poll_interval=0,
                       wait_ready=False)
    assert url.startswith("https://")
    context = ssl.create_default_context(cafile=str(cert))
    cloud_wait_ready(url, verify=context)
    body, headers = oip.encode_request(FEATURES)
    r = httpx.post(url + "/v2/models/tiny-cloud/infer", content=body, headers=headers,
                   verify=context)
    assert r.status_code == 200
    assert oip.decode_response(r.content, r.headers)["scores"].shape == (1, 3)


def test_settings_from_flags_over_environment(tiny_bundle):
    env = {"DDNN_CLOUD_BUNDLE": str(tiny_bundle), "DDNN_CLOUD_MAX_BATCH_SIZE": "8",
           "DDNN_CLOUD_BATCHING": "false", "DDNN_CLOUD_PORT": "9000"}
    s = settings_from(argparse.Namespace(port="9100", ort_threads="2"), env)
    assert (s.bundle, s.max_batch_size, s.batching, s.port, s.ort_threads) == (
        tiny_bundle, 8, False, 9100, 2)
    with pytest.raises(ConfigError, match="DDNN_CLOUD_BATCHING: invalid value 'maybe'"):
        settings_from(argparse.Namespace(), {**env, "DDNN_CLOUD_BATCHING": "maybe"})
    with pytest.raises(ConfigError, match="exactly one of --bundle"):
        settings_from(argparse.Namespace(repository=str(tiny_bundle)), env)
    with pytest.raises(ConfigError, match="max_batch_size must be at least 1"):
        settings_from(argparse.Namespace(max_batch_size="0"), env)
    assert settings_from(argparse.Namespace(token="t"), env).describe()["token"] == "***"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddnn", "cloud", *args],
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_cli_serves_and_stops_cleanly_on_sigterm(tiny_bundle):
    port = free_port()
    proc = _cli("--bundle", str(tiny_bundle), "--port", str(port), "--max-queue-delay-ms", "1",
                env={"DDNN_CLOUD_MAX_BATCH_SIZE": "8", "DDNN_CLOUD_TOKEN": "tok"})
    try:
        url = f"http://127.0.0.1:{port}"
        cloud_wait_ready(url)
        config = httpx.get(url + "/v2/models/tiny-cloud/config",
                           headers={"Authorization": "Bearer tok"}).json()
        assert config["max_batch_size"] == 8
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "'max_batch_size': 8" in out and "'token': '***'" in out and "tok'" not in out


def test_cli_refuses_a_bundle_it_cannot_serve(tiny_bundle, tmp_path):
    bad = shutil.copytree(tiny_bundle, tmp_path / "bad")
    (bad / "edge.onnx").write_bytes(b"garbage")
    proc = _cli("--bundle", str(bad), "--port", str(free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "ddnn: error:" in out and "checksum mismatch" in out
    # A graph ONNX Runtime refuses passes the checksums and fails at start-up instead.
    mf = json.loads((bad / "manifest.json").read_text())
    mf["segments"]["edge"]["sha256"] = sha256_file(bad / "edge.onnx")
    (bad / "manifest.json").write_text(json.dumps(mf))
    proc = _cli("--bundle", str(bad), "--port", str(free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "ddnn: error: the cloud service did not start" in out and "cannot load" in out
