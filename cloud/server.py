"""Running the cloud app under uvicorn: in the foreground (the CLI) or in a thread (tests)."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ddnn.cloud.protocol import ConnectionLimits, guarded_protocol, httptools_available
from ddnn.cloud.settings import CloudSettings
from ddnn.errors import ConfigError

log = logging.getLogger(__name__)

# --ssl-client-cert -> what the server's TLS context asks of clients.
CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def http_options(settings: CloudSettings) -> dict:
    """The HTTP protocol and its bounds: httptools under :mod:`ddnn.cloud.protocol`'s guard
    (head size, header and body read times), or h11 with its head bound when httptools is
    not installed."""
    if httptools_available():
        limits = ConnectionLimits(settings.max_header_bytes, settings.header_timeout,
                                  settings.body_timeout)
        return {"http": guarded_protocol(limits)}
    log.warning("httptools is not installed: serving with h11, whose head size is bounded but "
                "whose header and body read times are not")
    return {"http": "h11", "h11_max_incomplete_event_size": settings.max_header_bytes}


def uvicorn_config(settings: CloudSettings, **overrides):
    """The uvicorn configuration for ``settings`` (TLS, access log, no websockets, bounded
    request heads and read times)."""
    import uvicorn

    from ddnn.cloud.app import create_app

    options = {**http_options(settings), **overrides}
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        ws="none",  # the protocol needs no websockets; skipping them skips their imports
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
        lifespan="on",
        access_log=settings.access_log,
        log_config=None,  # keep the process's logging setup (ddnn's format and level)
        ssl_certfile=str(settings.ssl_certfile) if settings.ssl_certfile else None,
        ssl_keyfile=str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
        ssl_keyfile_password=settings.ssl_keyfile_password,
        ssl_ca_certs=str(settings.ssl_ca_certs) if settings.ssl_ca_certs else None,
        # uvicorn never asks for a client certificate unless told: without this, a CA given
        # with --ssl-ca-certs would be loaded and never used.
        ssl_cert_reqs=CERT_REQS[settings.ssl_client_cert or "none"],
        timeout_graceful_shutdown=10,
        server_header=False,  # "server: uvicorn" on every answer: bytes on the edge's WAN link
        **options,
    )


def serve(settings: CloudSettings) -> None:
    """Serve in the foreground until SIGINT or SIGTERM (uvicorn handles both cleanly)."""
    import uvicorn

    config = uvicorn_config(settings)
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    # it found; a no-op handler there makes a requested stop exit with status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    except SystemExit:  # uvicorn's way of reporting a failed start-up
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        error = getattr(config.app.state, "startup_error", None) or "see the log above"
        raise ConfigError(f"the cloud service did not start: {error}")
    log.info("ddnn cloud stopped")


@dataclass(frozen=True)
class RunningServer:
    """A server started by :func:`run_server`."""

    host: str
    port: int
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


@contextlib.contextmanager
def run_server(settings: CloudSettings, timeout: float = 60.0) -> Iterator[RunningServer]:
    """Run the service in a background thread on ``settings.host`` (port 0: a free port).

    Yields once uvicorn has started — which means the repository's first scan is done — and
    stops the server on exit.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    port = sock.getsockname()[1]
    config = uvicorn_config(settings)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # reported to the caller, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=target, name="ddnn-cloud-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                error = getattr(config.app.state, "startup_error", None) or (
                    errors[0] if errors else "timed out" if thread.is_alive() else "see the log")
                raise ConfigError(f"the cloud service did not start: {error}")
            time.sleep(0.01)  # polling uvicorn's started flag, not guessing a duration
        yield RunningServer(settings.host, port, settings.scheme)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
