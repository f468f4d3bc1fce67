"""Downloading a bundle version for an over-the-air update: bounded, one origin, signature first.

:func:`fetch_bundle` fetches ``manifest.json`` and ``manifest.sig`` (small, capped), verifies
them, then only the files the verified manifest names, each capped by its declared size and
hashed while it streams, all under one deadline; on any failure nothing is left on disk. The
policy behind it is in :mod:`ddnn.plumbing.ota`.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import shutil
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddnn import bounded_json
from ddnn.bundle import MANIFEST, Bundle, Manifest, load_bundle
from ddnn.errors import BundleError
from ddnn.plumbing.retry import RETRY_STATUSES
from ddnn.signing import SIGNATURE

log = logging.getLogger(__name__)

MAX_FILE = 512 << 20  # bytes: a bigger download is refused, not written
MAX_MANIFEST = 1 << 20  # bytes of manifest.json (a real one is a few KiB)
MAX_SIGNATURE = 4 << 10  # bytes of manifest.sig (base64 of 64 bytes)
MAX_REDIRECTS = 3  # same-origin redirects followed per file
_CHUNK = 1 << 16
_REDIRECTS = (301, 302, 303, 307, 308)
# RETRY_STATUSES (the one retry policy's "not now" answers: overloaded, restarting) are worth
# fetching again later (:class:`Unreachable`); so is a 404 for the manifest (the version is not
# served yet).


class Unreachable(BundleError):
    """The bundle could not be fetched *now* (the server is down, slow or not ready); nothing
    is wrong with the bundle itself, so a later attempt may succeed."""


class NotServed(BundleError):
    """HTTP 404 for a file: for the manifest the version is not served yet; for a file the
    manifest names, the server's copy is missing or damaged."""


@dataclass(frozen=True)
class Origin:
    """Scheme, host and port of a URL: what a download may talk to."""

    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise BundleError(f"bundle URL {url!r:.200} is not a valid URL ({e})") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise BundleError(f"bundle URL {url!r:.200} must be http(s)://")
        if not parts.hostname:
            raise BundleError(f"bundle URL {url!r:.200} has no host")
        if parts.username is not None or parts.password is not None:
            raise BundleError(f"bundle URL {url!r:.200} must not carry credentials")
        return cls(scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


class _Download:
    """GETs of one bundle download: within one origin, under one deadline for everything.

    Each read waits at most the time left, and a watchdog shuts the socket at the deadline, so a
    server that trickles a byte every few seconds cannot hold the download past it.
    """

    def __init__(self, origin: Origin, deadline: float, timeout: float, *,
                 token: str | None = None, ssl_context: ssl.SSLContext | None = None):
        self.origin, self.deadline, self.timeout = origin, deadline, timeout
        self.token = token  # sent with every request: the caller checked the origin is the cloud
        self.ssl_context = ssl_context

    def _left(self, url: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Unreachable(f"GET {url}: the download did not finish within "
                              f"{self.timeout:g} s")
        return left

    def _connect(self, url: str) -> http.client.HTTPConnection:
        o = self.origin
        if o.scheme == "https":
            return http.client.HTTPSConnection(o.host, o.port, timeout=self._left(url),
                                               context=self.ssl_context
                                               or ssl.create_default_context())
        return http.client.HTTPConnection(o.host, o.port, timeout=self._left(url))

    def get(self, url: str, limit: int, write: Callable[[bytes], None], *,
            optional: bool = False) -> bool:
        """Stream ``url`` into ``write``, refusing more than ``limit`` bytes; False for a 404
        when ``optional``. Raises :class:`BundleError` for anything else."""
        for _ in range(MAX_REDIRECTS + 1):
            target = Origin.of(url)
            if target != self.origin:
                raise BundleError(f"GET {url:.200}: refused: {target} is not the origin of the "
                                  f"download ({self.origin})")
            location = self._get_once(url, limit, write, optional)
            if location is None:
                return True
            if location == "":
                return False
            url = location
        raise BundleError(f"GET {url:.200}: more than {MAX_REDIRECTS} redirects")

    def _get_once(self, url: str, limit: int, write: Callable[[bytes], None],
                  optional: bool) -> str | None:
        """One request: None when done, "" for an optional 404, else the redirect target."""
        parts = urllib.parse.urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = {"Accept-Encoding": "identity", "User-Agent": "ddnn-ota"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        conn = self._connect(url)
        watchdog = threading.Timer(self._left(url), _shut, (conn,))
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            if resp.status in _REDIRECTS:
                location = resp.getheader("Location")
                if not location:
                    raise BundleError(f"GET {url:.200}: HTTP {resp.status} without a Location")
                return urllib.parse.urljoin(url, location)
            if resp.status == 404 and optional:
                return ""
            if resp.status != 200:
                error = Unreachable if resp.status in RETRY_STATUSES else (
                    NotServed if resp.status == 404 else BundleError)
                raise error(f"GET {url:.200}: HTTP {resp.status}")
            declared = resp.getheader("Content-Length")
            if declared is not None and (not declared.strip().isdigit()
                                         or int(declared) > limit):
                raise BundleError(f"GET {url:.200}: the server announces {declared[:20]} bytes; "
                                  f"at most {limit} are accepted")
            total = 0
            while True:
                if conn.sock is not None:
                    conn.sock.settimeout(self._left(url))
                chunk = resp.read1(_CHUNK)
                if not chunk:
                    break
                total += len(chunk)
                if total > limit:
                    raise BundleError(f"GET {url:.200}: more than the {limit} bytes accepted")
                write(chunk)
                self._left(url)
            return None
        except BundleError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            self._left(url)  # past the deadline: say so rather than "connection reset"
            raise Unreachable(f"GET {url:.200}: {type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()
            conn.close()

    def fetch(self, url: str, limit: int, *, optional: bool = False) -> bytes | None:
        """A small file into memory (the manifest and its signature)."""
        chunks: list[bytes] = []
        return b"".join(chunks) if self.get(url, limit, chunks.append, optional=optional) \
            else None


def _shut(conn: http.client.HTTPConnection) -> None:
    """The deadline passed: end the connection under whatever read is waiting on it."""
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _tls_context(ca_file, cert_file, key_file) -> ssl.SSLContext | None:
    """The download's TLS context: a private CA and a client certificate, when given."""
    if not (ca_file or cert_file):
        return None
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if cert_file:
        try:
            context.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
        except (OSError, ssl.SSLError) as e:
            raise BundleError(f"cannot load the client certificate {cert_file}: {e}") from None
    return context


def fetch_bundle(url: str, staging: Path, *, token: str | None = None, timeout: float = 120.0,
                 public_key: str | Path | None = None, allow_unsigned: bool = False,
                 token_origin: str | None = None, ca_file: str | Path | None = None,
                 cert_file: str | Path | None = None, key_file: str | Path | None = None,
                 check: Callable[[Manifest], None] | None = None) -> Bundle:
    """Download the bundle at ``url`` into ``staging``, verify it, and return it loaded.

    The manifest and its signature come first and are verified with ``public_key`` (required
    unless ``allow_unsigned``); ``check(manifest)`` may then refuse the version before anything
    else is fetched. Only the files the manifest names are downloaded, each capped by its
    declared size (else :data:`MAX_FILE`) and checked against its sha256 as it streams. The
    token goes only to ``token_origin`` (the cloud) and only when ``url`` is on it; redirects
    are followed within ``url``'s origin only. ``timeout`` bounds the whole download. Files
    land in ``{staging}.part``, renamed when complete; on any failure neither is left behind.
    ``cert_file``/``key_file``: the client certificate for a mutual-TLS cloud.
    """
    if public_key is None and not allow_unsigned:
        raise BundleError("over-the-air bundles must be signed: configure a bundle key "
                          "(--bundle-key), or opt out explicitly (allow_unsigned)")
    url = url.rstrip("/")
    origin = Origin.of(url)
    send_token = token if token and token_origin and Origin.of(token_origin) == origin else None
    context = _tls_context(ca_file, cert_file, key_file)
    download = _Download(origin, time.monotonic() + timeout, timeout, token=send_token,
                         ssl_context=context)
    part = staging.with_name(staging.name + ".part")
    try:
        raw, sig, manifest = _verified_manifest(download, url, public_key)
        if check is not None:
            check(manifest)
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        (part / MANIFEST).write_bytes(raw)
        if sig is not None:
            (part / SIGNATURE).write_bytes(sig)
        done: set[str] = set()
        for seg in manifest.segments().values():  # file names were checked by from_dict
            if seg.file in done:
                continue
            _fetch_file(download, f"{url}/{seg.file}", part / seg.file, seg.sha256, seg.size)
            done.add(seg.file)
        shutil.rmtree(staging, ignore_errors=True)
        part.rename(staging)
        return load_bundle(staging, public_key=public_key)  # everything once more, from disk
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _verified_manifest(download: _Download, url: str, public_key: str | Path | None
                       ) -> tuple[bytes, bytes | None, Manifest]:
    """The manifest's bytes, its signature's (None: unsigned) and the manifest, verified with
    ``public_key`` when there is one, before anything it names is fetched."""
    try:
        raw = download.fetch(f"{url}/{MANIFEST}", MAX_MANIFEST)
    except NotServed as e:  # not loaded yet (put in the repository after the announcement)
        raise Unreachable(f"{e}: the version is not served (yet)") from None
    sig = download.fetch(f"{url}/{SIGNATURE}", MAX_SIGNATURE, optional=True)
    assert raw is not None
    if public_key is not None:
        from ddnn.signing import verify_manifest_bytes

        verify_manifest_bytes(raw, sig, public_key, url)
    try:
        manifest = Manifest.from_dict(bounded_json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:
        if isinstance(e, BundleError):
            raise
        raise BundleError(f"{url}/{MANIFEST}: not a JSON manifest ({e})") from None
    return raw, sig, manifest


def _fetch_file(download: _Download, url: str, dest: Path, sha256: str,
                size: int | None) -> None:
    limit = MAX_FILE if size is None else min(size, MAX_FILE)
    h = hashlib.sha256()
    with open(dest, "wb") as f:
        def write(chunk: bytes) -> None:
            h.update(chunk)
            f.write(chunk)

        download.get(url, limit, write)
        total = f.tell()
    if size is not None and total != size:
        raise BundleError(f"GET {url:.200}: {total} bytes, the manifest says {size}")
    if h.hexdigest() != sha256:
        raise BundleError(f"GET {url:.200}: checksum mismatch (expected sha256 {sha256[:12]}…, "
                          f"got {h.hexdigest()[:12]}…)")
