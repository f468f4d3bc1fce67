"""The cloud tier: an Open Inference Protocol (KServe v2) service for ddnn bundles.

FastAPI and uvicorn serve ``{name}-cloud`` and ``{name}-full`` of every bundle in a repository,
with ONNX Runtime and dynamic batching; ``ddnn cloud`` runs it. Never imports torch or onnx.
"""

from ddnn.cloud.settings import CloudSettings

__all__ = ["CloudSettings"]
