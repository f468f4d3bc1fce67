"""Mutual TLS on the cloud: ``--ssl-ca-certs`` makes the TLS handshake require a client
certificate that chains to the deployment's CA. Real certificates (deploy/make-certs.sh and
openssl), a real uvicorn server on a loopback port, real clients (httpx and the tiers'
``KeepAliveConnection``)."""

from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from ddnn import oip
from ddnn.cloud.cli import settings_from
from ddnn.cloud.server import uvicorn_config
from ddnn.cloud.settings import CloudSettings
from ddnn.errors import ConfigError
from ddnn.plumbing.http import KeepAliveConnection
from tests.support.cloud import cloud_wait_ready

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """The deployment's CA, the cloud's certificate (SAN 127.0.0.1) and client certificates
    (make-certs.sh), plus a client certificate from a CA the cloud does not know (openssl)."""
    out = tmp_path_factory.mktemp("pki")
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(out),
                    "--broker-host", "127.0.0.1", "--devices", "cam0", "--edges", "edge0",
                    "--cloud-host", "127.0.0.1", "--install-dir", str(out)],
                   check=True, capture_output=True, text=True)
    foreign = out / "foreign"
    foreign.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj", "/CN=edge0",
                    "-addext", "extendedKeyUsage=clientAuth",
                    "-keyout", str(foreign / "edge0.key"), "-out", str(foreign / "edge0.crt")],
                   check=True, capture_output=True)
    return out


def _client(pki: Path, cert: str | None) -> ssl.SSLContext:
    """A client context trusting the deployment's CA, presenting ``cert`` (a clients/ or
    foreign/ name) or nothing."""
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert:
        ctx.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    return ctx


def _infer(url: str, verify: ssl.SSLContext) -> httpx.Response:
    body, headers = oip.encode_request({"edge_features": np.zeros((1, 16, 4, 4), np.float32)})
    return httpx.post(url + "/v2/models/tiny-cloud/infer", content=body, headers=headers,
                      verify=verify, timeout=10)


def _tls_server(cloud_server, tiny_bundle, pki, **settings) -> str:
    return cloud_server(bundle=tiny_bundle, poll_interval=0, wait_ready=False,
                        ssl_certfile=pki / "cloud.crt", ssl_keyfile=pki / "cloud.key", **settings)


def test_ca_certs_require_a_client_certificate_from_the_ca(cloud_server, tiny_bundle, pki):
    url = _tls_server(cloud_server, tiny_bundle, pki, ssl_ca_certs=pki / "ca.crt")
    assert url.startswith("https://")
    good = _client(pki, "clients/edge0")
    cloud_wait_ready(url, verify=good)
    r = _infer(url, good)
    assert r.status_code == 200
    assert oip.decode_response(r.content, r.headers)["scores"].shape == (1, 3)
    # No certificate, or one from a CA the cloud does not know: refused in the TLS handshake,
    # before any HTTP (the health check too: mutual TLS guards every route). With TLS 1.3 the
    # client hears of it on its first read, as the server's alert or the connection closing.
    for cert in (None, "foreign/edge0"):
        for send in (lambda v: _infer(url, v),
                     lambda v: httpx.get(url + "/v2/health/live", verify=v, timeout=10)):
            with pytest.raises(httpx.TransportError):
                send(_client(pki, cert))


def test_the_handshake_itself_fails_without_a_client_certificate(cloud_server, tiny_bundle,
                                                                 pki):
    """With TLS 1.2 the client learns of the refusal in the handshake proper (with TLS 1.3, on
    its first read, as above): the server ends the handshake, no request is ever sent; with
    a certificate from the CA the same handshake completes."""
    import socket

    url = _tls_server(cloud_server, tiny_bundle, pki, ssl_ca_certs=pki / "ca.crt")
    port = int(url.rsplit(":", 1)[1])
    for cert in (None, "foreign/edge0", "clients/edge0"):
        ctx = _client(pki, cert)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            if cert == "clients/edge0":
                with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                    assert tls.version() == "TLSv1.2"
            else:
                with pytest.raises(ssl.SSLError):  # the server's alert, or it hanging up
                    ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def test_the_tiers_http_client_presents_its_certificate(cloud_server, tiny_bundle, pki):
    """ddnn.plumbing.http.KeepAliveConnection (the edge's cloud client underneath) with
    cert_file/key_file gets answers; without them it gets an OSError, never a response."""
    url = _tls_server(cloud_server, tiny_bundle, pki, ssl_ca_certs=pki / "ca.crt")
    cloud_wait_ready(url, verify=_client(pki, "clients/edge0"))
    ca = str(pki / "ca.crt")
    conn = KeepAliveConnection(url, "cloud", 10.0, ca, cert_file=str(pki / "clients/edge0.crt"),
                               key_file=str(pki / "clients/edge0.key"))
    for _ in range(2):  # the same kept-alive connection
        status, _, _ = conn.request("GET", "/v2/health/ready", None, {})
        assert status == 200
    conn.close()
    bare = KeepAliveConnection(url, "cloud", 10.0, ca)
    with pytest.raises(OSError):
        bare.request("GET", "/v2/health/ready", None, {})
    bare.close()


def test_keep_alive_connection_client_certificate_errors(pki):
    crt, key = str(pki / "clients/edge0.crt"), str(pki / "clients/edge0.key")
    with pytest.raises(ConfigError, match="client certificate is set but"):
        KeepAliveConnection("http://127.0.0.1:1", "cloud", 1.0, cert_file=crt, key_file=key)
    with pytest.raises(ConfigError, match="cannot load the cloud client certificate"):
        KeepAliveConnection("https://127.0.0.1:1", "cloud", 1.0, cert_file=crt,
                            key_file=str(pki / "clients/cam0.key"))  # not this cert's key
    with pytest.raises(ConfigError, match="key file needs its certificate"):
        KeepAliveConnection("https://127.0.0.1:1", "cloud", 1.0, key_file=key)


def test_optional_client_certificates(cloud_server, tiny_bundle, pki):
    """optional: a client without a certificate gets in (the token still guards the routes);
    a certificate that is presented must chain to the CA."""
    url = _tls_server(cloud_server, tiny_bundle, pki, ssl_ca_certs=pki / "ca.crt",
                      ssl_client_cert="optional")
    cloud_wait_ready(url, verify=_client(pki, None))
    assert _infer(url, _client(pki, None)).status_code == 200
    assert _infer(url, _client(pki, "clients/edge0")).status_code == 200
    with pytest.raises(httpx.TransportError):
        _infer(url, _client(pki, "foreign/edge0"))


def test_client_certificate_settings(tiny_bundle, pki):
    tls = {"bundle": tiny_bundle, "ssl_certfile": pki / "cloud.crt",
           "ssl_keyfile": pki / "cloud.key"}
    assert CloudSettings(**tls).ssl_client_cert == "none"
    mtls = CloudSettings(**tls, ssl_ca_certs=pki / "ca.crt")
    assert mtls.ssl_client_cert == "required" and mtls.describe()["ssl_client_cert"] == "required"
    assert uvicorn_config(mtls).ssl_cert_reqs == ssl.CERT_REQUIRED
    optional = CloudSettings(**tls, ssl_ca_certs=pki / "ca.crt", ssl_client_cert="optional")
    assert uvicorn_config(optional).ssl_cert_reqs == ssl.CERT_OPTIONAL
    assert uvicorn_config(CloudSettings(**tls)).ssl_cert_reqs == ssl.CERT_NONE
    with pytest.raises(ConfigError, match="needs --ssl-ca-certs"):
        CloudSettings(**tls, ssl_client_cert="required")
    with pytest.raises(ConfigError, match="needs --ssl-certfile"):
        CloudSettings(bundle=tiny_bundle, ssl_ca_certs=pki / "ca.crt")
    with pytest.raises(ConfigError, match="no such file"):
        CloudSettings(**tls, ssl_ca_certs=pki / "missing.crt")
    env = {"DDNN_CLOUD_BUNDLE": str(tiny_bundle),
           "DDNN_CLOUD_SSL_CERTFILE": str(tls["ssl_certfile"]),
           "DDNN_CLOUD_SSL_KEYFILE": str(tls["ssl_keyfile"]),
           "DDNN_CLOUD_SSL_CA_CERTS": str(pki / "ca.crt")}
    assert settings_from(argparse.Namespace(), env).ssl_client_cert == "required"
    with pytest.raises(ConfigError, match="not one of required, optional, none"):
        settings_from(argparse.Namespace(), {**env, "DDNN_CLOUD_SSL_CLIENT_CERT": "maybe"})


def test_the_edge_settings_give_its_cloud_client_the_certificate(cloud_server, tiny_bundle, pki):
    """--cloud-cert-file/--cloud-key-file reach the edge's cloud client: it is ready with them
    and gets nothing from a mutual-TLS cloud without them."""
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    url = _tls_server(cloud_server, tiny_bundle, pki, ssl_ca_certs=pki / "ca.crt")
    cloud_wait_ready(url, verify=_client(pki, "clients/edge0"))
    base = dict(bundle=tiny_bundle, http_port=0, cloud=url, cloud_ca_file=str(pki / "ca.crt"))
    certified = EdgeSettings(**base, cloud_cert_file=str(pki / "clients/edge0.crt"),
                             cloud_key_file=str(pki / "clients/edge0.key"))
    with EdgeService.from_settings(certified) as with_cert, \
            EdgeService.from_settings(EdgeSettings(**base)) as without:
        assert with_cert.aggregator.cloud.ready()
        assert not without.aggregator.cloud.ready()


def test_over_the_air_downloads_present_the_client_certificate(cloud_server, tiny_bundle, pki,
                                                               tmp_path):
    """An edge fetching a bundle from a mutual-TLS cloud presents its certificate (otherwise
    the handshake fails, which looks like an outage and is retried, never applied)."""
    import shutil

    from ddnn.plumbing.download import Unreachable, fetch_bundle
    from ddnn.plumbing.ota import bundle_url
    from ddnn.signing import generate_keypair, sign_bundle

    signed = tmp_path / "signed"
    shutil.copytree(tiny_bundle, signed)
    key, pub = generate_keypair(tmp_path / "keys")
    sign_bundle(signed, key)
    url = cloud_server(bundle=signed, poll_interval=0, wait_ready=False, bundle_key=pub,
                       ssl_certfile=pki / "cloud.crt", ssl_keyfile=pki / "cloud.key",
                       ssl_ca_certs=pki / "ca.crt")
    cloud_wait_ready(url, verify=_client(pki, "clients/edge0"))
    source = bundle_url(url, "tiny", "1")
    with pytest.raises(Unreachable):
        fetch_bundle(source, tmp_path / "bare", public_key=pub, ca_file=pki / "ca.crt",
                     timeout=10)
    assert not (tmp_path / "bare").exists() and not (tmp_path / "bare.part").exists()
    got = fetch_bundle(source, tmp_path / "with-cert", public_key=pub, ca_file=pki / "ca.crt",
                       cert_file=pki / "clients/edge0.crt", key_file=pki / "clients/edge0.key",
                       timeout=10)
    assert got.manifest.version == "1" and got.signature_bytes
