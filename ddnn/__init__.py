"""ddnn: distributed deep neural network inference over devices, edge and cloud.

This package is the contract every tier shares. It needs numpy only; ONNX Runtime is imported
lazily by :mod:`ddnn.runtime` where a tier actually runs a segment.
"""

from ddnn.errors import BundleError, CodecError, DatasetError, DdnnError

__version__ = "0.1.0"
__all__ = ["BundleError", "CodecError", "DatasetError", "DdnnError", "__version__"]
