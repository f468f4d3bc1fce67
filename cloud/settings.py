"""The cloud service's settings: one typed, frozen object from flags or ``DDNN_CLOUD_*``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddnn.errors import ConfigError
from ddnn.plumbing.options import Option, boolean, describe, optional_int, path, section

ENV_PREFIX = "DDNN_CLOUD_"
CLIENT_CERT_MODES = ("required", "optional", "none")  # --ssl-client-cert


@dataclass(frozen=True, kw_only=True)
class CloudSettings:
    """Everything ``ddnn cloud`` can be told; every field is a flag and an environment variable."""

    bundle: Path | None = None  # serve this one bundle directory (a repository of one)
    repository: Path | None = None  # serve every bundle directory found under this directory
    host: str = "127.0.0.1"  # loopback by default: exposing the service is a deliberate choice
    port: int = 8000
    batching: bool = True  # gather concurrent requests into one ONNX Runtime call
    max_batch_size: int = 64  # samples per ONNX Runtime call when batching
    max_queue_delay_ms: float = 2.0  # how long a request may wait for others to join its batch
    max_queue: int = 1024  # samples waiting per model before new requests get 503
    inference_threads: int = 1  # worker threads calling ONNX Runtime (batches run one at a time)
    # ONNX Runtime intra-op threads per session. 1 by default: ORT's own pool spin-waits between
    # runs and starves the event loop of CPU; None lets ORT pick (all cores).
    ort_threads: int | None = 1
    poll_interval: float = 2.0  # seconds between repository scans; 0 turns hot reload off
    max_body_bytes: int = 32 << 20  # larger request bodies get 413 before they are read
    max_header_bytes: int = 64 << 10  # request line + headers; larger: 431, connection closed
    header_timeout: float = 10.0  # seconds a client may take to send its request line and headers
    body_timeout: float = 60.0  # seconds from the end of the headers to the end of the body
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this
    token: str | None = None  # the edges' token: "Authorization: Bearer TOKEN" on every route
    # The devices' read-only token: bundle downloads only (ddnn.cloud.access), never inference.
    download_token: str | None = None
    ssl_certfile: Path | None = None  # TLS certificate (PEM); with ssl_keyfile turns on HTTPS
    ssl_keyfile: Path | None = None
    ssl_keyfile_password: str | None = None
    ssl_ca_certs: Path | None = None  # CA bundle that client certificates must chain to
    # Client certificates (mutual TLS): "required" (the handshake fails without a certificate
    # that chains to ssl_ca_certs), "optional" (one that is presented must chain to it) or
    # "none" (never asked for). Unset: "required" when ssl_ca_certs is given, else "none".
    ssl_client_cert: str | None = None
    # With ssl_ca_certs: a client certificate's role (its subject's OU, make-certs.sh) decides
    # what it may call: edge everything, device bundle downloads only. False: any certificate
    # of the CA may call what its token allows (a CA that issues no roles).
    ssl_client_roles: bool = True
    access_log: bool = False  # one log line per request (off: it costs throughput)
    bundle_key: Path | None = None  # Ed25519 public key (PEM): serve only bundles signed by it

    def __post_init__(self) -> None:
        if (self.bundle is None) == (self.repository is None):
            raise ConfigError("give exactly one of --bundle DIR or --repository DIR")
        root = self.bundle or self.repository
        if not Path(root).is_dir():
            raise ConfigError(f"{root}: no such directory")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_batch_size", "max_queue", "inference_threads", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_header_bytes < 1024:
            raise ConfigError(f"max_header_bytes must be at least 1024, got "
                              f"{self.max_header_bytes}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.ort_threads is not None and self.ort_threads < 1:
            raise ConfigError(f"ort_threads must be at least 1, got {self.ort_threads}")
        if self.max_queue_delay_ms < 0 or self.poll_interval < 0:
            raise ConfigError("max_queue_delay_ms and poll_interval must not be negative")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
        self._check_client_certificates()
        if self.bundle_key is not None and not Path(self.bundle_key).is_file():
            raise ConfigError(f"bundle key {self.bundle_key}: no such file")
        self._check_tokens()

    def _check_tokens(self) -> None:
        for name in ("token", "download_token"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"the {name.replace('_', ' ')} must not be empty")
        if self.download_token is not None:
            if self.token is None:
                raise ConfigError("--download-token needs --token: without it every route is "
                                  "open, and a read-only token means nothing")
            if self.download_token == self.token:
                raise ConfigError("--download-token must differ from --token (the devices' "
                                  "token must not be the edges')")

    def _check_client_certificates(self) -> None:
        mode = self.ssl_client_cert
        if mode is None:  # resolved here, so the start-up log shows what is enforced
            mode = "required" if self.ssl_ca_certs is not None else "none"
            object.__setattr__(self, "ssl_client_cert", mode)
        if mode not in CLIENT_CERT_MODES:
            raise ConfigError(f"ssl_client_cert must be one of {', '.join(CLIENT_CERT_MODES)}, "
                              f"got {mode!r}")
        if self.ssl_ca_certs is not None:
            if self.ssl_certfile is None:
                raise ConfigError("--ssl-ca-certs verifies client certificates over HTTPS: it "
                                  "needs --ssl-certfile and --ssl-keyfile")
            if not Path(self.ssl_ca_certs).is_file():
                raise ConfigError(f"--ssl-ca-certs {self.ssl_ca_certs}: no such file")
        elif mode != "none":
            raise ConfigError(f"--ssl-client-cert {mode} needs --ssl-ca-certs (the CA that "
                              "client certificates must chain to)")

    @property
    def root(self) -> Path:
        """The directory the model repository scans."""
        return Path(self.bundle or self.repository)  # type: ignore[arg-type]

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def describe(self) -> dict:
        """The resolved settings for the start-up log, secrets masked."""
        return describe(self, OPTIONS)


# The options table: one row per field above (its default is the field's default).
OPTIONS = (
    *section("What it serves", (
        Option("bundle", path, "DIR", "serve this bundle directory (a repository of one bundle)"),
        Option("repository", path, "DIR", "serve every bundle directory under this directory; new "
                                          "versions dropped in are picked up without a restart"),
        Option("poll-interval", float, "SECONDS",
               "seconds between repository scans for new or changed bundles (0: never)"),
        Option("bundle-key", path, "FILE",
               "Ed25519 public key (PEM): serve only bundles whose manifest it signed (ddnn "
               "bundle sign); others are refused and listed UNAVAILABLE"),
    )),
    *section("Listening", (
        Option("host", str, "ADDR", "address to listen on (0.0.0.0: every interface)"),
        Option("port", int, "PORT", "TCP port to listen on"),
        Option("access-log", boolean, "BOOL", "log one line per request"),
    )),
    *section("Inference and batching", (
        Option("batching", boolean, "BOOL",
               "dynamic batching: run concurrent requests of a model as one ONNX Runtime call"),
        Option("max-batch-size", int, "N", "most samples in one batched ONNX Runtime call"),
        Option("max-queue-delay-ms", float, "MS",
               "longest a request waits for others to join its batch, in milliseconds"),
        Option("max-queue", int, "N",
               "samples that may wait per model; requests beyond it get 503"),
        Option("inference-threads", int, "N", "worker threads calling ONNX Runtime"),
        Option("ort-threads", optional_int, "N",
               "ONNX Runtime intra-op threads per session ('none': ONNX Runtime's choice, every "
               "core; its idle threads spin, which costs the HTTP side CPU)"),
    )),
    *section("Bounds on clients", (
        Option("max-body-bytes", int, "BYTES", "largest accepted request body (larger: 413)"),
        Option("max-header-bytes", int, "BYTES",
               "largest request line plus headers (larger: 431, and the connection is closed)"),
        Option("header-timeout", float, "SECONDS",
               "seconds a client may take from connecting (or its request's first byte) to the end "
               "of its headers (then 408, and the connection is closed)"),
        Option("body-timeout", float, "SECONDS",
               "seconds a client may take from the end of its headers to the end of its body (then "
               "the connection is closed)"),
        Option("keep-alive-timeout", float, "SECONDS",
               "an idle keep-alive connection is closed after this many seconds"),
    )),
    *section("Access: tokens and TLS", (
        Option("token", str, "TOKEN", "the edges' token: require 'Authorization: Bearer TOKEN' on "
                                      "every route but the health checks (prefer the environment "
                                      "variable to the flag)", secret=True),
        Option("download-token", str, "TOKEN",
               "the devices' read-only token (their --ota-token): good for bundle downloads "
               "(GET /v1/bundles/...) only, 403 elsewhere; needs --token", secret=True),
        Option("ssl-certfile", path, "FILE",
               "TLS certificate (PEM); with --ssl-keyfile serves HTTPS"),
        Option("ssl-keyfile", path, "FILE", "TLS private key (PEM)"),
        Option("ssl-keyfile-password", str, "TEXT", "password of the TLS private key",
               secret=True),
        Option("ssl-ca-certs", path, "FILE",
               "CA certificate(s) (PEM) that client certificates must chain to: mutual TLS. "
               "With it a client without such a certificate is refused in the TLS handshake "
               "(see --ssl-client-cert); needs --ssl-certfile"),
        Option("ssl-client-cert", str, "MODE",
               "client certificates: required (the handshake fails without one that chains to "
               "--ssl-ca-certs), optional (one that is presented must chain to it), none (never "
               "asked for); unset: required with --ssl-ca-certs, else none",
               choices=CLIENT_CERT_MODES),
        Option("ssl-client-roles", boolean, "BOOL",
               "with --ssl-ca-certs, a client certificate's role (the OU of its subject, "
               "deploy/make-certs.sh) decides what it may call: OU=edge every route, OU=device "
               "bundle downloads only, others the health checks only (403); false: any "
               "certificate of the CA, the token decides"),
    )),
)
