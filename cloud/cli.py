"""``ddnn cloud``: serve bundles over the Open Inference Protocol (KServe v2) REST API (the
role's scaffold: :mod:`ddnn.plumbing.role_cli`).

Every option also reads ``DDNN_CLOUD_`` plus its name in upper case with dashes as underscores
(``--max-batch-size`` ← ``DDNN_CLOUD_MAX_BATCH_SIZE``). FastAPI, uvicorn and ONNX Runtime are
imported only when the command runs.
"""

from __future__ import annotations

from ddnn.cloud.settings import ENV_PREFIX, OPTIONS, CloudSettings
from ddnn.plumbing.role_cli import Role

DESCRIPTION = """\
Serve the cloud segment ({name}-cloud: edge features → class scores) and the whole model
({name}-full: raw views → class scores) of each bundle over the Open Inference Protocol
(KServe v2) with ONNX Runtime and dynamic batching."""


def run(settings: CloudSettings) -> int:
    from ddnn.bundle import load_bundle
    from ddnn.cloud.server import serve

    if settings.bundle is not None:
        # Refuse a bad (or unsigned, with a key) bundle with a one-line error before binding.
        load_bundle(settings.bundle, public_key=settings.bundle_key)
    serve(settings)
    return 0


ROLE = Role(name="cloud",
            help="serve bundles over the Open Inference Protocol (KServe v2) REST API",
            description=DESCRIPTION, options=OPTIONS, settings=CloudSettings,
            env_prefix=ENV_PREFIX, run=run, example="MAX_BATCH_SIZE")
register = ROLE.register
settings_from = ROLE.settings_from
