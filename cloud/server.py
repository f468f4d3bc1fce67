"""Running the cloud app under uvicorn, as a part of a lifecycle (:class:`CloudServer`): for
the CLI until a signal (:func:`serve`), or for the tests and benchmarks in a ``with`` block
(:func:`run_server`)."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ddnn.cloud.protocol import ConnectionLimits, guarded_protocol, httptools_available
from ddnn.cloud.settings import CloudSettings
from ddnn.errors import ConfigError
from ddnn.plumbing.lifecycle import Lifecycle
from ddnn.plumbing.signals import stop_on_signals

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


class CloudServer:
    """uvicorn serving the cloud app in a thread: a part of a
    :class:`~ddnn.plumbing.lifecycle.Lifecycle`. :meth:`start` returns once uvicorn has started
    — which means the repository's first scan is done — or raises :class:`ConfigError`;
    :meth:`stop` shuts it down gracefully. ``sock``: serve on this bound socket (else uvicorn
    binds ``settings.host`` and ``settings.port`` itself)."""

    def __init__(self, settings: CloudSettings, sock: socket.socket | None = None,
                 timeout: float = 60.0):
        self.settings, self.sock, self.timeout = settings, sock, timeout
        self.config = None
        self.server = None
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def start(self) -> CloudServer:
        import uvicorn

        self.config = uvicorn_config(self.settings)
        self.server = uvicorn.Server(self.config)
        self._thread = threading.Thread(target=self._run, name="ddnn-cloud-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                error = getattr(self.config.app.state, "startup_error", None) or (
                    self._errors[0] if self._errors
                    else "timed out" if self._thread.is_alive() else "see the log above")
                self.stop()
                raise ConfigError(f"the cloud service did not start: {error}")
            time.sleep(0.01)  # polling uvicorn's started flag, not guessing a duration
        return self

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock] if self.sock is not None else None)
        except SystemExit:  # uvicorn's way of reporting a failed start-up (told by start())
            pass
        except BaseException as e:  # reported to the caller, not lost in the thread
            self._errors.append(e)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True  # graceful: requests under way are answered
        if self._thread is not None:
            self._thread.join(self.timeout)


def serve(settings: CloudSettings) -> None:
    """Serve until SIGINT or SIGTERM (a graceful shutdown), or until uvicorn ends."""
    stop = threading.Event()
    stop_on_signals(stop)
    server = CloudServer(settings)
    with Lifecycle().add("cloud-server", server):
        while server.alive() and not stop.wait(0.2):
            pass
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
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    port = sock.getsockname()[1]
    try:
        with Lifecycle().add("cloud-server", CloudServer(settings, sock, timeout)):
            yield RunningServer(settings.host, port, settings.scheme)
    finally:
        sock.close()
