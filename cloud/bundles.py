"""Bundle downloads for over-the-air updates (:mod:`ddnn.plumbing.ota`): the files of every served
bundle version, ``GET /v1/bundles/{name}/{version}/{file}``.

Only the files a served manifest names can be read (``manifest.json``, its signature
``manifest.sig`` when present, and each segment's ONNX file), so no path from a request ever
reaches the file system. The bearer token applies as on every other route.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import FileResponse

from ddnn.bundle import MANIFEST, read_manifest
from ddnn.cloud.service import CloudService
from ddnn.errors import BundleError
from ddnn.oip import ModelNotFoundError
from ddnn.signing import SIGNATURE


def add_bundle_routes(app: FastAPI, service: CloudService) -> None:
    repo = service.repository

    @app.get("/v1/bundles/{name}/{version}/{file}", tags=["bundles"],
             summary="A file of a served bundle version (manifest.json, manifest.sig, segments)")
    async def bundle_file(name: str, version: str, file: str) -> FileResponse:
        path = repo.bundle_path(name, version)
        if path is None:
            raise ModelNotFoundError(f"no served bundle {name}:{version}")
        try:
            segments = read_manifest(path).segments().values()
        except BundleError as e:  # removed or damaged since it was loaded
            raise ModelNotFoundError(f"bundle {name}:{version} is unavailable: {e}") from None
        allowed = {MANIFEST, SIGNATURE, *(seg.file for seg in segments)}
        if file not in allowed or not (path / file).is_file():
            raise ModelNotFoundError(f"bundle {name}:{version} has no file {file!r}")
        return FileResponse(path / file, media_type="application/octet-stream")
