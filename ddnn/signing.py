"""Optional bundle signing: an Ed25519 signature over the exact bytes of ``manifest.json``.

The manifest already carries every segment file's sha256, so signing it covers the whole bundle:
a changed ONNX file fails its checksum, a changed manifest fails the signature. The signature
lives beside the manifest in ``manifest.sig`` (base64, one line). Keys are PEM files (PKCS#8
private key, SubjectPublicKeyInfo public key), the same format as ``openssl genpkey -algorithm
ed25519``, so a bundle can also be signed or checked with OpenSSL alone (docs/security.md).

The ``cryptography`` package is imported only when a key is used (``pip install 'ddnn[sign]'``),
so devices that do not verify bundles do not need it.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from ddnn.errors import BundleError, ConfigError

MANIFEST = "manifest.json"  # the same name as ddnn.bundle.MANIFEST (no import cycle)
SIGNATURE = "manifest.sig"
PRIVATE_KEY = "bundle-signing.key"
PUBLIC_KEY = "bundle-signing.pub"


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ConfigError("bundle signing needs the 'cryptography' package: "
                          "pip install 'ddnn[sign]' (or pip install cryptography)") from None
    return serialization, ed25519, InvalidSignature


def generate_keypair(out_dir: str | Path) -> tuple[Path, Path]:
    """Write a new Ed25519 key pair into ``out_dir``; returns (private key, public key) paths.

    The private key file is created with mode 0600 and never overwritten.
    """
    serialization, ed25519, _ = _crypto()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = out / PRIVATE_KEY, out / PUBLIC_KEY
    for p in (priv_path, pub_path):
        if p.exists():
            raise ConfigError(f"{p} already exists; refusing to overwrite a key")
    key = ed25519.Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(priv)
    pub_path.write_bytes(pub)
    return priv_path, pub_path


def _load_key(path: str | Path, private: bool):
    serialization, ed25519, _ = _crypto()
    kind = "private" if private else "public"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the bundle {kind} key {path}: {e.strerror or e}") from None
    try:
        if private:
            key = serialization.load_pem_private_key(data, password=None)
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not a PEM {kind} key: {e}") from None
    expected = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, expected):
        raise ConfigError(f"{path} is not an Ed25519 {kind} key")
    return key


def sign_bundle(bundle_dir: str | Path, private_key_path: str | Path) -> Path:
    """Sign ``bundle_dir/manifest.json`` as it is on disk; writes and returns ``manifest.sig``.

    Sign last: any later change to the manifest (a threshold edited by hand) voids the signature.
    """
    key = _load_key(private_key_path, private=True)
    manifest = Path(bundle_dir) / MANIFEST
    try:
        data = manifest.read_bytes()
    except OSError as e:
        raise BundleError(f"{bundle_dir}: cannot read {MANIFEST} ({e.strerror or e})") from None
    sig_path = Path(bundle_dir) / SIGNATURE
    sig_path.write_text(base64.b64encode(key.sign(data)).decode("ascii") + "\n", encoding="ascii")
    return sig_path


def verify_manifest_bytes(data: bytes, encoded: bytes | None, public_key_path: str | Path,
                          where: str) -> None:
    """Check a base64 signature (``manifest.sig``'s bytes) against manifest bytes in memory.

    ``encoded`` None means there is no signature: refused as "unsigned". ``where`` names the
    bundle in the messages. Used by :func:`verify_bundle` and by over-the-air downloads, which
    verify the manifest before fetching anything it names.
    """
    _, _, invalid_signature = _crypto()
    key = _load_key(public_key_path, private=False)
    if encoded is None:
        raise BundleError(f"{where}: bundle is unsigned (no {SIGNATURE}) but a bundle key is "
                          f"configured; sign it with `ddnn bundle sign`")
    try:
        signature = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise BundleError(f"{where}: bad signature ({SIGNATURE} is not base64)") from None
    try:
        key.verify(signature, data)
    except invalid_signature:
        raise BundleError(f"{where}: bad signature: {MANIFEST} was changed after signing, or was "
                          f"signed with another key than {public_key_path}") from None


def read_signed_files(bundle_dir: str | Path) -> tuple[bytes, bytes | None]:
    """The bytes of ``manifest.json`` and of ``manifest.sig`` (None when absent)."""
    d = Path(bundle_dir)
    try:
        data = (d / MANIFEST).read_bytes()
    except OSError as e:
        raise BundleError(f"{d}: cannot read {MANIFEST} ({e.strerror or e})") from None
    try:
        encoded = (d / SIGNATURE).read_bytes()
    except FileNotFoundError:
        encoded = None
    except OSError as e:
        raise BundleError(f"{d}: cannot read {SIGNATURE} ({e.strerror or e})") from None
    return data, encoded


def verify_bundle(bundle_dir: str | Path, public_key_path: str | Path) -> bytes:
    """Check ``manifest.sig`` against ``manifest.json``; returns the verified manifest bytes.

    Raises :class:`BundleError` saying "unsigned" when there is no signature and "bad signature"
    when it does not match (the manifest was changed, or signed by another key). Callers should
    parse the returned bytes rather than read the file again.
    """
    _crypto()
    _load_key(public_key_path, private=False)  # a bad key is a ConfigError before any file
    data, encoded = read_signed_files(bundle_dir)
    verify_manifest_bytes(data, encoded, public_key_path, str(bundle_dir))
    return data
