"""The HTTP face of the cloud service: the Open Inference Protocol (KServe v2) REST API.

Routes are thin: they read and bound the body, call :class:`~cloud.service.CloudService`, and
frame the answer. Errors take the protocol's ``{"error": "..."}`` form: a client's mistake keeps
its 4xx status; anything else is logged with its traceback and answered as a plain 500.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from ddnn import __version__
from ddnn.cloud.access import Access
from ddnn.cloud.bundles import add_bundle_routes
from ddnn.cloud.service import CloudService
from ddnn.cloud.settings import CloudSettings
from ddnn.oip import JSON_TYPE, LEAN_ROUTE, OipError, PayloadTooLargeError, error_body
from ddnn.plumbing.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

SERVER_NAME = "ddnn-cloud"
EXTENSIONS = ["binary_tensor_data", "model_repository"]
_INFLATE_CHUNK = 1 << 20
_TRITON_TYPES = {"BOOL": "TYPE_BOOL", "FP32": "TYPE_FP32", "UINT8": "TYPE_UINT8"}
INFER_PATHS = ("/v2/models/{model_name}/infer",
               "/v2/models/{model_name}/versions/{model_version}/infer")
# ddnn's lean route (docs/cloud.md): a raw binary request answered by the raw bytes of the
# model's first output and its length alone; a client opts in by calling it.
LEAN_PATHS = (f"{LEAN_ROUTE}/{{model_name}}", f"{LEAN_ROUTE}/{{model_name}}/{{model_version}}")
_INFER_DOC = {"requestBody": {"required": True, "description": (
    "A v2 inference request: JSON tensors, or a JSON header followed by binary tensors (then "
    "`Inference-Header-Content-Length` gives the header's length and each binary tensor its "
    "`binary_data_size`)."), "content": {"application/json": {"schema": {"type": "object"}},
                                       "application/octet-stream": {}}}}
_LEAN_DOC = {"requestBody": {"required": True, "description": (
    "The raw bytes of the model's one input, a whole number of samples (a raw binary request). "
    "The answer is the raw bytes of the model's first output (`scores`: FP32, little-endian, "
    "one row per sample) with no header but its length."),
    "content": {"application/octet-stream": {}}}}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message), status, headers=headers, media_type=JSON_TYPE)


async def read_body(request: Request, limit: int) -> bytes | bytearray:
    """The request body, refused with 413 past ``limit`` bytes (before or after decompression).

    Read into one growing buffer (joining chunks would hold the body twice); an encoded body is
    inflated in a worker thread (zlib lets go of the interpreter lock), at most ``limit + 1``
    bytes of it, so neither its size nor its inflating stalls the event loop."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise OipError(f"invalid Content-Length {declared!r}")
        if int(declared) > limit:
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of "
                                       f"{limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            body += chunk
    except ClientDisconnect:  # gone, or closed by the body timeout (ddnn.cloud.protocol)
        raise OipError("the client disconnected before the end of its body") from None
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise OipError(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    return await asyncio.to_thread(_inflate, body, encoding, limit)


def _inflate(body: bytearray, encoding: str, limit: int) -> bytearray:
    """``body`` inflated into one buffer, a chunk at a time (zlib's own one-shot output is
    assembled from blocks, which holds the result twice); 413 past ``limit`` bytes."""
    inflater = zlib.decompressobj(31 if encoding == "gzip" else 15)
    out, pending = bytearray(), body
    try:
        while True:
            chunk = inflater.decompress(pending, _INFLATE_CHUNK)
            if len(out) + len(chunk) > limit:
                raise PayloadTooLargeError(f"decompressed body exceeds the limit of {limit} bytes")
            out += chunk
            pending = inflater.unconsumed_tail
            if inflater.eof or not (pending or chunk):
                break
    except zlib.error as e:
        raise OipError(f"body is not valid {encoding} data: {e}") from None
    if not inflater.eof:
        raise OipError(f"{encoding} body is truncated")
    return out


def create_app(settings: CloudSettings) -> FastAPI:
    """The FastAPI application serving ``settings``' repository."""
    service = CloudService(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        log.info("ddnn cloud %s starting with %s", __version__, settings.describe())
        try:
            await service.start()
        except Exception as e:
            _app.state.startup_error = e  # for run_server's caller; uvicorn only logs it
            await service.stop()
            raise
        log.info("serving models: %s", ", ".join(service.repository.names()) or "none")
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="ddnn cloud",
        version=__version__,
        description="Open Inference Protocol (KServe v2) service for ddnn bundles: "
        "`{name}-cloud` (edge features → class scores), `{name}-cloud-packed` (the same features "
        "packed in the bundle's edge codec) and `{name}-full` (raw views → class scores). "
        "Request and response bodies are v2 inference JSON, optionally followed by binary "
        "tensors (`Inference-Header-Content-Length`).",
        lifespan=lifespan,
    )
    app.state.service = service
    if settings.token or (settings.ssl_ca_certs and settings.ssl_client_roles):
        app.add_middleware(Access, settings=settings, on_refuse=service.metrics.error)

    @app.exception_handler(OipError)
    async def _oip_error(_request: Request, e: OipError) -> Response:
        service.metrics.error(e.status)
        return _error(e.status, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException) -> Response:
        service.metrics.error(e.status_code)
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError) -> Response:
        service.metrics.error(400)
        return _error(400, f"invalid request: {e.errors()}")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=e)
        service.metrics.error(500)
        return _error(500, "internal server error")

    add_server_routes(app, service)
    add_model_routes(app, service)
    add_inference_routes(app, service)
    add_bundle_routes(app, service)
    return app


def add_server_routes(app: FastAPI, service: CloudService) -> None:
    """Server metadata, liveness, readiness and ``/metrics``."""
    repo = service.repository

    @app.get("/v2", summary="Server metadata", tags=["server"])
    async def server_metadata() -> dict:
        return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}

    @app.get("/v2/health/live", summary="Server liveness", tags=["server"])
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready", summary="Server readiness (a model is loaded)", tags=["server"])
    async def ready() -> Response:
        if not repo.ready:
            return _error(400, "no model is loaded yet")
        return JSONResponse({"ready": True})

    @app.get("/metrics", summary="Prometheus metrics", tags=["server"])
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)


def add_model_routes(app: FastAPI, service: CloudService) -> None:
    """Model metadata, readiness and (Triton-style) configuration."""
    repo = service.repository
    settings = service.settings

    @app.get("/v2/models/{model_name}", summary="Model metadata", tags=["models"])
    @app.get("/v2/models/{model_name}/versions/{model_version}", summary="Model version metadata",
             tags=["models"])
    async def model_metadata(model_name: str, model_version: str | None = None) -> dict:
        model = repo.get(model_name, model_version)
        return model.metadata(repo.versions(model_name))

    @app.get("/v2/models/{model_name}/ready", summary="Model readiness", tags=["models"])
    @app.get("/v2/models/{model_name}/versions/{model_version}/ready",
             summary="Model version readiness", tags=["models"])
    async def model_ready(model_name: str, model_version: str | None = None) -> dict:
        model = repo.get(model_name, model_version)  # served models are loaded, hence ready
        return {"name": model.name, "version": model.version, "ready": True}

    @app.get("/v2/models/{model_name}/config", summary="Model configuration (Triton style)",
             tags=["models"])
    @app.get("/v2/models/{model_name}/versions/{model_version}/config",
             summary="Model version configuration (Triton style)", tags=["models"])
    async def model_config(model_name: str, model_version: str | None = None) -> dict:
        model = repo.get(model_name, model_version)

        def tensors(metas):
            return [{"name": t.name, "data_type": _TRITON_TYPES[t.datatype],
                     "dims": list(t.shape[1:])}
                    for t in metas]

        return {"name": model.name, "platform": "onnxruntime_onnx",
                "max_batch_size": settings.max_batch_size if settings.batching else 0,
                "input": tensors(model.inputs), "output": tensors(model.outputs),
                "dynamic_batching": {"max_queue_delay_microseconds":
                                     int(settings.max_queue_delay_ms * 1000)}
                if settings.batching else None}


def add_inference_routes(app: FastAPI, service: CloudService) -> None:
    """Inference (the hot path) and the repository extension."""
    repo = service.repository
    settings = service.settings

    async def infer_endpoint(request: Request) -> Response:
        params = request.path_params
        body = await read_body(request, settings.max_body_bytes)
        content, headers = await service.infer(params["model_name"], params.get("model_version"),
                                               body, request.headers)
        return Response(content, headers=headers)

    async def lean_endpoint(request: Request) -> Response:
        params = request.path_params
        body = await read_body(request, settings.max_body_bytes)
        content, _ = await service.infer(params["model_name"], params.get("model_version"),
                                         body, request.headers, lean=True)
        return Response(content)  # no media type: content-length is the one header

    # The hot path skips FastAPI's parameter solving (a third of a request's server time with
    # one-sample requests): plain Starlette routes, matched first. The FastAPI routes below are
    # never reached; they document the same paths on the OpenAPI page.
    app.router.routes[:0] = [Route(path, endpoint, methods=["POST"])
                             for paths, endpoint in ((INFER_PATHS, infer_endpoint),
                                                     (LEAN_PATHS, lean_endpoint))
                             for path in paths]

    @app.post(INFER_PATHS[0], summary="Inference", tags=["inference"], openapi_extra=_INFER_DOC)
    @app.post(INFER_PATHS[1], summary="Inference on a model version", tags=["inference"],
              openapi_extra=_INFER_DOC)
    async def infer(model_name: str, request: Request, model_version: str | None = None
                    ) -> Response:
        return await infer_endpoint(request)

    @app.post(LEAN_PATHS[0], summary="Lean inference (ddnn extension)", tags=["inference"],
              openapi_extra=_LEAN_DOC)
    @app.post(LEAN_PATHS[1], summary="Lean inference on a model version (ddnn extension)",
              tags=["inference"], openapi_extra=_LEAN_DOC)
    async def lean_infer(model_name: str, request: Request, model_version: str | None = None
                         ) -> Response:
        return await lean_endpoint(request)

    @app.post("/v2/repository/index", summary="Repository index, failed bundles included",
              tags=["repository"])
    async def repository_index() -> list[dict]:
        return repo.index()

    @app.post("/v2/repository/models/{model_name}/load",
              summary="Rescan the repository now and report the model", tags=["repository"])
    async def repository_load(model_name: str) -> dict:
        await repo.poll()
        model = repo.get(model_name)
        return {"name": model.name, "version": model.version, "versions": repo.versions(model_name)}
