"""Bundle signing: Ed25519 over the exact bytes of manifest.json, signature in manifest.sig."""

from __future__ import annotations

import base64
import shutil
import stat
import subprocess
import sys

import pytest

from ddnn import signing
from ddnn.errors import BundleError, ConfigError

MANIFEST = b'{"format": "ddnn-bundle", "model": {"name": "tiny", "version": "1"}}\n'


@pytest.fixture
def keys(tmp_path):
    return signing.generate_keypair(tmp_path / "keys")


@pytest.fixture
def bundle_dir(tmp_path):
    d = tmp_path / "bundle"
    d.mkdir()
    (d / "manifest.json").write_bytes(MANIFEST)
    return d


def test_keygen_writes_a_private_key_only_its_owner_reads(keys):
    priv, pub = keys
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert priv.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        signing.generate_keypair(priv.parent)


def test_signed_manifest_verifies_and_returns_its_bytes(keys, bundle_dir):
    priv, pub = keys
    sig = signing.sign_bundle(bundle_dir, priv)
    assert sig.name == "manifest.sig" and len(base64.b64decode(sig.read_text())) == 64
    assert signing.verify_bundle(bundle_dir, pub) == MANIFEST


def test_unsigned_bundle_is_refused(keys, bundle_dir):
    with pytest.raises(BundleError, match="unsigned"):
        signing.verify_bundle(bundle_dir, keys[1])


@pytest.mark.parametrize("tamper", [
    lambda d: (d / "manifest.json").write_bytes(MANIFEST.replace(b"tiny", b"tina")),
    lambda d: (d / "manifest.json").write_bytes(MANIFEST + b" "),  # even whitespace counts
    lambda d: (d / "manifest.sig").write_text(base64.b64encode(b"\0" * 64).decode()),
    lambda d: (d / "manifest.sig").write_text("not base64!"),
    lambda d: (d / "manifest.sig").write_text(base64.b64encode(b"short").decode()),
], ids=["manifest-changed", "manifest-whitespace", "zero-signature", "not-base64", "short"])
def test_tampered_bundle_is_refused(keys, bundle_dir, tamper):
    signing.sign_bundle(bundle_dir, keys[0])
    tamper(bundle_dir)
    with pytest.raises(BundleError, match="bad signature"):
        signing.verify_bundle(bundle_dir, keys[1])


def test_a_signature_by_another_key_is_refused(keys, bundle_dir, tmp_path):
    other_priv, _ = signing.generate_keypair(tmp_path / "other")
    signing.sign_bundle(bundle_dir, other_priv)
    with pytest.raises(BundleError, match="bad signature.*another key"):
        signing.verify_bundle(bundle_dir, keys[1])


def test_bad_key_files_are_config_errors(keys, bundle_dir, tmp_path):
    priv, pub = keys
    signing.sign_bundle(bundle_dir, priv)
    with pytest.raises(ConfigError, match="cannot read"):
        signing.verify_bundle(bundle_dir, tmp_path / "missing.pub")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        signing.verify_bundle(bundle_dir, priv)  # the private key where the public one goes
    with pytest.raises(ConfigError, match="not a PEM private key"):
        signing.sign_bundle(bundle_dir, pub)


def test_keys_from_other_algorithms_are_refused(bundle_dir, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "ec.pub").write_bytes(pem)
    with pytest.raises(ConfigError, match="not an Ed25519 public key"):
        signing.verify_bundle(bundle_dir, tmp_path / "ec.pub")


def test_missing_cryptography_says_what_to_install(monkeypatch, bundle_dir, tmp_path):
    for name in [m for m in sys.modules if m.split(".")[0] == "cryptography"] + ["cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    with pytest.raises(ConfigError, match=r"ddnn\[sign\]"):
        signing.verify_bundle(bundle_dir, tmp_path / "any.pub")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_openssl_interoperates(tmp_path, bundle_dir):
    """Keys from `openssl genpkey`; signatures checkable with `openssl pkeyutl` (see the docs)."""
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(priv)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(priv), "-pubout", "-out", str(pub)], check=True)
    sig = signing.sign_bundle(bundle_dir, priv)
    assert signing.verify_bundle(bundle_dir, pub) == MANIFEST
    raw = tmp_path / "sig.bin"
    raw.write_bytes(base64.b64decode(sig.read_text()))
    done = subprocess.run(["openssl", "pkeyutl", "-verify", "-pubin", "-inkey", str(pub),
                           "-rawin", "-in", str(bundle_dir / "manifest.json"), "-sigfile",
                           str(raw)], capture_output=True, text=True)
    assert done.returncode == 0 and "Signature Verified Successfully" in done.stdout
