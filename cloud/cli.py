"""``ddnn cloud``: serve bundles over the Open Inference Protocol (KServe v2) REST API.

Every option also reads an environment variable, ``DDNN_CLOUD_`` plus the option's name in upper
case with dashes as underscores (``--max-batch-size`` ← ``DDNN_CLOUD_MAX_BATCH_SIZE``); a flag
given on the command line wins. FastAPI, uvicorn and ONNX Runtime are imported only when the
command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ddnn.cloud.settings import ENV_PREFIX, OPTIONS, CloudSettings
from ddnn.plumbing import options


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
    options.add_options(p, OPTIONS, CloudSettings, ENV_PREFIX)
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                  ) -> CloudSettings:
    """Resolve flags over ``DDNN_CLOUD_*`` variables over defaults into settings."""
    return options.settings_from(args, OPTIONS, CloudSettings, ENV_PREFIX, environ)


def run(args: argparse.Namespace) -> int:
    from ddnn.bundle import load_bundle
    from ddnn.cloud.server import serve

    settings = settings_from(args)
    if settings.bundle is not None:
        # Refuse a bad (or unsigned, with a key) bundle with a one-line error before binding.
        load_bundle(settings.bundle, public_key=settings.bundle_key)
    serve(settings)
    return 0
