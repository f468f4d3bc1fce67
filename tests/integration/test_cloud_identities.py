"""Each tier its own identity towards the cloud: the edges' token and certificate infer; the
devices' read-only token and certificate download bundles and nothing else; a certificate of
the deployment's CA is no longer good for everything. A device updates over the air from a
mutual-TLS cloud with what make-certs.sh gave it (``--ota-cert-file``, ``--ota-key-file``, the
download token). Real certificates (deploy/make-certs.sh, their role in the subject's OU), a
real uvicorn server with mutual TLS on a loopback port."""

from __future__ import annotations

import argparse
import shutil
import ssl

import httpx
import numpy as np
import pytest

from ddnn import oip
from ddnn.bundle import load_bundle
from ddnn.cloud.access import certificate_role, rdns
from ddnn.cloud.protocol import rfc4514
from ddnn.cloud.settings import CloudSettings
from ddnn.errors import ConfigError
from tests.support.brokers import Pki, make_pki
from tests.support.cloud import cloud_wait_ready

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    out = tmp_path_factory.mktemp("pki")
    pki = make_pki(out, "--broker-host", "127.0.0.1", "--devices", "cam0", "--edges", "edge0",
                   "--cloud-host", "127.0.0.1", "--install-dir", str(out / "clients"))
    shutil.copy(out / "ca.crt", out / "clients")  # where the env files say it is installed
    return pki


def cloud_env(pki: Pki) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (pki.dir / "env" / "cloud.env").read_text()
                .splitlines())


def context(pki: Pki, who: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if who:
        ctx.load_cert_chain(*map(str, pki.client(who)))
    return ctx


@pytest.fixture(scope="module")
def cloud(pki, tiny_bundle):
    """A mutual-TLS cloud with make-certs.sh's env/cloud.env: both tokens and the CA."""
    from ddnn.cloud.server import run_server

    env = cloud_env(pki)
    settings = CloudSettings(bundle=tiny_bundle, host="127.0.0.1", port=0, poll_interval=0,
                             ssl_certfile=pki.dir / "cloud.crt", ssl_keyfile=pki.dir / "cloud.key",
                             ssl_ca_certs=pki.ca, token=env["DDNN_CLOUD_TOKEN"],
                             download_token=env["DDNN_CLOUD_DOWNLOAD_TOKEN"])
    with run_server(settings) as running:
        cloud_wait_ready(running.url, verify=context(pki, "edge0"))
        yield running.url


@pytest.fixture(scope="module")
def shape(tiny_bundle) -> tuple[int, ...]:
    return load_bundle(tiny_bundle).manifest.cloud.inputs[0].sample_shape


def call(url: str, pki: Pki, who: str | None, token: str | None, route: str,
         shape: tuple[int, ...]) -> int:
    """The status of ``route`` (infer, metadata, download, metrics, health) called with
    ``who``'s certificate and ``token``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(verify=context(pki, who), timeout=10) as client:
        if route == "infer":
            body, extra = oip.encode_request({"edge_features": np.zeros((1, *shape), np.float32)})
            r = client.post(f"{url}/v2/models/tiny-cloud/infer", content=body,
                            headers={**headers, **extra})
        else:
            path = {"metadata": "/v2/models/tiny-cloud", "health": "/v2/health/ready",
                    "download": "/v1/bundles/tiny/1/manifest.json", "metrics": "/metrics"}[route]
            r = client.get(url + path, headers=headers)
    return r.status_code


@pytest.mark.parametrize("who,token,route,status", [
    # the edge: its certificate and token open every route
    ("edge0", "edge", "infer", 200), ("edge0", "edge", "metadata", 200),
    ("edge0", "edge", "download", 200), ("edge0", "edge", "metrics", 200),
    # a device: its certificate and the read-only token download bundles, and only that
    ("cam0", "download", "download", 200), ("cam0", "download", "infer", 403),
    ("cam0", "download", "metadata", 403), ("cam0", "download", "metrics", 403),
    # a device holding the edges' token (leaked): its certificate still says device
    ("cam0", "edge", "infer", 403), ("cam0", "edge", "download", 200),
    # the edge with the devices' token: the token says device
    ("edge0", "download", "infer", 403),
    # an operator's certificate (bundle announcements on the broker) is nothing here
    ("operator", "edge", "infer", 403), ("operator", "download", "download", 403),
    # no token, or a wrong one; health checks stay open to any certificate of the CA
    ("edge0", None, "infer", 401), ("edge0", "wrong", "download", 401),
    ("cam0", None, "health", 200), ("operator", None, "health", 200),
])
def test_each_identity_calls_only_its_routes(cloud, pki, shape, who, token, route, status):
    env = cloud_env(pki)
    value = {"edge": env["DDNN_CLOUD_TOKEN"], "download": env["DDNN_CLOUD_DOWNLOAD_TOKEN"],
             "wrong": "not-a-token", None: None}[token]
    assert call(cloud, pki, who, value, route, shape) == status


def test_make_certs_gives_each_identity_its_role_and_credentials(pki):
    env = cloud_env(pki)
    device = dict(line.split("=", 1) for line in (pki.dir / "env/cam0.env").read_text()
                  .splitlines())
    edge = dict(line.split("=", 1) for line in (pki.dir / "env/edge0.env").read_text()
                .splitlines())
    assert device["DDNN_DEVICE_OTA_TOKEN"] == env["DDNN_CLOUD_DOWNLOAD_TOKEN"]
    assert edge["DDNN_EDGE_CLOUD_TOKEN"] == env["DDNN_CLOUD_TOKEN"]
    assert env["DDNN_CLOUD_TOKEN"] not in (pki.dir / "env/cam0.env").read_text()
    assert device["DDNN_DEVICE_OTA_ORIGIN"] == "https://127.0.0.1:8000"
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    for who, role in (("cam0", "device"), ("edge0", "edge"), ("operator", "operator")):
        cert = x509.load_pem_x509_certificate(pki.client(who)[0].read_bytes())
        units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        assert [u.value for u in units] == [role]


def test_subject_names_round_trip_with_escapes():
    subject = ((("organizationName", "a,b+c"),), (("organizationalUnitName", "edge"),),
               (("commonName", "#x\\y"),))
    assert rdns(rfc4514(subject)) == [("CN", "#x\\y"), ("OU", "edge"), ("O", "a,b+c")]
    two = ((("organizationalUnitName", "edge"),), (("organizationalUnitName", "device"),))
    assert certificate_role({"extensions": {"tls": {"client_cert_name": rfc4514(two)}}}) is None


def test_token_settings(tiny_bundle):
    with pytest.raises(ConfigError, match="needs --token"):
        CloudSettings(bundle=tiny_bundle, download_token="d" * 32)
    with pytest.raises(ConfigError, match="must differ"):
        CloudSettings(bundle=tiny_bundle, token="t" * 32, download_token="t" * 32)
    from ddnn.cloud.cli import settings_from

    s = settings_from(argparse.Namespace(), {"DDNN_CLOUD_BUNDLE": str(tiny_bundle),
                                             "DDNN_CLOUD_TOKEN": "t" * 32,
                                             "DDNN_CLOUD_DOWNLOAD_TOKEN": "d" * 32})
    assert s.download_token == "d" * 32 and s.describe()["download_token"] == "***"


def test_a_device_updates_from_a_mutual_tls_cloud_with_its_own_identity(
        pki, tiny_bundle, tiny_data, tmp_path):
    """The device's settings, from its env file alone (make-certs.sh), fetch a signed bundle
    from a cloud that requires client certificates and checks roles; without the certificate
    the handshake fails (an outage to the updater: retried, never applied)."""
    from dataclasses import replace

    from ddnn.bundle import load_bundle as load
    from ddnn.cloud.server import run_server
    from ddnn.device.cli import settings_from
    from ddnn.plumbing.announcement import Announcement
    from ddnn.plumbing.ota import BundleUpdater
    from ddnn.plumbing.ota_settings import UpdateHooks
    from ddnn.signing import generate_keypair
    from tests.support.data import version_copy

    key, pub = generate_keypair(tmp_path / "keys")
    version_copy(tiny_bundle, tmp_path / "repo" / "tiny-2", "2", key)
    env = cloud_env(pki)
    settings = CloudSettings(repository=tmp_path / "repo", host="127.0.0.1", port=0,
                             poll_interval=0, ssl_certfile=pki.dir / "cloud.crt",
                             ssl_keyfile=pki.dir / "cloud.key", ssl_ca_certs=pki.ca,
                             token=env["DDNN_CLOUD_TOKEN"],
                             download_token=env["DDNN_CLOUD_DOWNLOAD_TOKEN"], bundle_key=pub)
    device_env = dict(line.split("=", 1) for line in (pki.dir / "env/cam0.env").read_text()
                      .splitlines())
    with run_server(settings) as cloud:
        device_env |= {"DDNN_DEVICE_OTA_ORIGIN": cloud.url, "DDNN_DEVICE_BUNDLE": str(tiny_bundle),
                       "DDNN_DEVICE_DATA": str(tiny_data.test), "DDNN_DEVICE_VIEW": "0",
                       "DDNN_DEVICE_BROKER": "mqtts://127.0.0.1:8883"}
        source = settings_from(argparse.Namespace(), device_env).update_source
        assert source.cert_file and source.token == env["DDNN_CLOUD_DOWNLOAD_TOKEN"]
        applied = []
        for src in (replace(source, cert_file=None, key_file=None), source):
            updater = BundleUpdater(load(tiny_bundle), UpdateHooks(apply=applied.append),
                                    source=src, public_key=pub, tag=f"t{len(applied)}",
                                    staging_root=tmp_path / "staging", timeout=10)
            ok = updater.update(Announcement("tiny", "2"))
            assert ok == (src is source), updater.last_error
    assert [b.manifest.version for b in applied] == ["2"]
