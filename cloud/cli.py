"""``ddnn cloud``: serve bundles over the Open Inference Protocol (KServe v2) REST API.

Every option also reads an environment variable, ``DDNN_CLOUD_`` plus the option's name in upper
case with dashes as underscores (``--max-batch-size`` ← ``DDNN_CLOUD_MAX_BATCH_SIZE``); a flag
given on the command line wins. FastAPI, uvicorn and ONNX Runtime are imported only when the
command runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ddnn.cloud.settings import ENV_PREFIX, CloudSettings
from ddnn.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _env(option: str) -> str:
    return ENV_PREFIX + option.upper().replace("-", "_")


def _flag(value: str) -> bool:
    v = value.strip().lower()
    if v not in _TRUE | _FALSE:
        raise ConfigError(f"expected a boolean (true/false), got {value!r}")
    return v in _TRUE


def _optional_int(value: str) -> int | None:
    return None if value.strip().lower() in ("", "none", "auto") else int(value)


# (option, type, metavar, help); defaults come from CloudSettings so the two cannot drift.
_OPTIONS = [
    ("bundle", Path, "DIR", "serve this bundle directory (a repository of one bundle)"),
    ("repository", Path, "DIR", "serve every bundle directory under this directory; new "
                                "versions dropped in are picked up without a restart"),
    ("host", str, "ADDR", "address to listen on (0.0.0.0: every interface)"),
    ("port", int, "PORT", "TCP port to listen on"),
    ("batching", _flag, "BOOL",
     "dynamic batching: run concurrent requests of a model as one ONNX Runtime call"),
    ("max-batch-size", int, "N", "most samples in one batched ONNX Runtime call"),
    ("max-queue-delay-ms", float, "MS",
     "longest a request waits for others to join its batch, in milliseconds"),
    ("max-queue", int, "N", "samples that may wait per model; requests beyond it get 503"),
    ("inference-threads", int, "N", "worker threads calling ONNX Runtime"),
    ("ort-threads", _optional_int, "N",
     "ONNX Runtime intra-op threads per session ('none': ONNX Runtime's choice, every core; "
     "its idle threads spin, which costs the HTTP side CPU)"),
    ("poll-interval", float, "SECONDS",
     "seconds between repository scans for new or changed bundles (0: never)"),
    ("max-body-bytes", int, "BYTES", "largest accepted request body (larger: 413)"),
    ("token", str, "TOKEN", "require 'Authorization: Bearer TOKEN' on every route but the "
                            "health checks (prefer the environment variable to the flag)"),
    ("ssl-certfile", Path, "FILE", "TLS certificate (PEM); with --ssl-keyfile serves HTTPS"),
    ("ssl-keyfile", Path, "FILE", "TLS private key (PEM)"),
    ("ssl-keyfile-password", str, "TEXT", "password of the TLS private key"),
    ("ssl-ca-certs", Path, "FILE", "CA certificates to verify client certificates against"),
    ("access-log", _flag, "BOOL", "log one line per request"),
    ("bundle-key", Path, "FILE", "Ed25519 public key (PEM): serve only bundles whose manifest "
                                 "it signed (ddnn bundle sign); others are refused and listed "
                                 "UNAVAILABLE"),
]


def register(sub, data_sub, formatter) -> None:
    """Add ``ddnn cloud`` to the subcommands."""
    p = sub.add_parser(
        "cloud",
        help="serve bundles over the Open Inference Protocol (KServe v2) REST API",
        description="Serve the cloud segment ({name}-cloud: edge features → class scores) and "
        "the whole model ({name}-full: raw views → class scores) of each bundle over the Open "
        "Inference Protocol (KServe v2) with ONNX Runtime and dynamic batching. Every option "
        f"also reads the environment variable {ENV_PREFIX}<OPTION> (e.g. "
        f"{ENV_PREFIX}MAX_BATCH_SIZE); a flag wins over the variable.",
        formatter_class=formatter,
    )
    fields = CloudSettings.__dataclass_fields__
    for option, _kind, metavar, help_text in _OPTIONS:
        default = fields[option.replace("-", "_")].default
        secret = " (hidden)" if option in ("token", "ssl-keyfile-password") else ""
        # SUPPRESS: an absent flag leaves no attribute, so the variable or the default applies.
        p.add_argument(f"--{option}", default=argparse.SUPPRESS, metavar=metavar,
                       help=f"{help_text} (env {_env(option)}{secret}; default: {default})")
    p.set_defaults(func=_run)


def settings_from(args: argparse.Namespace, environ: dict[str, str] | None = None
                  ) -> CloudSettings:
    """Resolve flags over ``DDNN_CLOUD_*`` variables over defaults into settings."""
    environ = dict(os.environ if environ is None else environ)
    values = {}
    for option, kind, _metavar, _help in _OPTIONS:
        raw = getattr(args, option.replace("-", "_"), None)
        if raw is None:
            raw = environ.get(_env(option))
        if raw is None:
            continue
        try:
            values[option.replace("-", "_")] = kind(raw)
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"--{option} / {_env(option)}: invalid value {raw!r} ({e})") from None
    return CloudSettings(**values)


def _run(args: argparse.Namespace) -> int:
    from ddnn.bundle import load_bundle
    from ddnn.cloud.server import serve

    settings = settings_from(args)
    if settings.bundle is not None:
        # Refuse a bad (or unsigned, with a key) bundle with a one-line error before binding.
        load_bundle(settings.bundle, public_key=settings.bundle_key)
    serve(settings)
    return 0
