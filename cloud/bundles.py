"""Bundle downloads for over-the-air updates (:mod:`ddnn.plumbing.ota`): the files of every served
bundle version, ``GET /v1/bundles/{name}/{version}/{file}``.

Only what the repository verified when it loaded the bundle is handed out:

* ``manifest.json`` and ``manifest.sig`` are the exact bytes that were verified (checksums, and
  the signature with ``--bundle-key``), from memory — never the files as they are now;
* a segment file only when the verified manifest names it, and only as bytes that match the
  manifest's sha256 again when they are handed out: read whole from a regular file inside the
  bundle directory (opened without following symlinks, and still the file that was verified:
  same device, inode, size and modification time), hashed, and sent only if the hash is the
  verified one. A file edited since — even in place with its size and time kept — a symlink or
  anything else is 404 until the verified bytes are back or the bundle is reloaded (a scan
  reloads a bundle whose files' sizes or times changed).

No path from a request ever reaches the file system but a name from the verified manifest. The
bearer token applies as on every other route.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from ddnn.bundle import MANIFEST
from ddnn.cloud.repository import Identity, identity
from ddnn.cloud.service import CloudService
from ddnn.oip import ModelNotFoundError
from ddnn.signing import SIGNATURE

_OCTETS = "application/octet-stream"


def add_bundle_routes(app: FastAPI, service: CloudService) -> None:
    repo = service.repository

    @app.get("/v1/bundles/{name}/{version}/{file}", tags=["bundles"],
             summary="A file of a served bundle version (manifest.json, manifest.sig, segments)")
    async def bundle_file(name: str, version: str, file: str) -> Response:
        entry = repo.served_bundle(name, version)
        if entry is None:
            raise ModelNotFoundError(f"no served bundle {name}:{version}")
        bundle = entry.runtime.bundle
        if file == MANIFEST and bundle.manifest_bytes is not None:
            return Response(bundle.manifest_bytes, media_type="application/json")
        if file == SIGNATURE and bundle.signature_bytes is not None:
            return Response(bundle.signature_bytes, media_type=_OCTETS)
        verified = entry.files.get(file)
        digest = {seg.file: seg.sha256 for seg in bundle.manifest.segments().values()}.get(file)
        if verified is None or digest is None:
            raise ModelNotFoundError(f"bundle {name}:{version} has no file {file!r}")
        content = await asyncio.to_thread(_read_verified, entry.path / file, verified, digest)
        if content is None:
            raise ModelNotFoundError(f"bundle {name}:{version}: {file!r} changed since it was "
                                     "verified; it is served again once the bundle reloads "
                                     "or the verified bytes are back")
        return Response(content, media_type=_OCTETS)


def _read_verified(path: Path, verified: Identity, sha256: str) -> bytes | None:
    """The file's bytes if it is still the regular file that was verified and they still hash to
    ``sha256``; None otherwise. Read whole, then hashed: what is sent is what was hashed."""
    try:  # O_NOFOLLOW: a symlink put in its place fails; O_NONBLOCK: so does a FIFO
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if identity(st) != verified:
            return None
        with open(fd, "rb", closefd=False) as f:
            content = f.read(st.st_size + 1)  # one byte more: a file that grew is refused
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(content) != st.st_size or hashlib.sha256(content).hexdigest() != sha256:
        return None
    return content
