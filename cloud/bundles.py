"""Bundle downloads for over-the-air updates (:mod:`ddnn.plumbing.ota`): the files of every served
bundle version, ``GET /v1/bundles/{name}/{version}/{file}``.

Only what the repository verified when it loaded the bundle is handed out:

* ``manifest.json`` and ``manifest.sig`` are the exact bytes that were verified (checksums, and
  the signature with ``--bundle-key``), from memory — never the files as they are now;
* a segment file only when the verified manifest names it, and only while it is the very file
  whose checksum was verified (same device, inode, size and modification time): a regular file
  inside the bundle directory, opened without following symlinks. A file changed since (the
  next scan reloads the bundle), a symlink or anything else is 404.

No path from a request ever reaches the file system but a name from the verified manifest. The
bearer token applies as on every other route.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from ddnn.bundle import MANIFEST
from ddnn.cloud.repository import identity
from ddnn.cloud.service import CloudService
from ddnn.oip import ModelNotFoundError
from ddnn.signing import SIGNATURE

_CHUNK = 1 << 20
_OCTETS = "application/octet-stream"


def _stream(fd: int) -> Iterator[bytes]:
    try:
        while chunk := os.read(fd, _CHUNK):
            yield chunk
    finally:
        os.close(fd)


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
        if verified is None:
            raise ModelNotFoundError(f"bundle {name}:{version} has no file {file!r}")
        try:  # O_NOFOLLOW: a symlink put in its place fails; O_NONBLOCK: so does a FIFO
            fd = os.open(entry.path / file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            raise ModelNotFoundError(f"bundle {name}:{version}: {file!r} is unavailable") from None
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if identity(st) != verified:
            os.close(fd)
            raise ModelNotFoundError(f"bundle {name}:{version}: {file!r} changed since it was "
                                     "verified; it is served again once the bundle reloads")
        return StreamingResponse(_stream(fd), media_type=_OCTETS,
                                 headers={"Content-Length": str(st.st_size)})
