"""Typed errors with one root, so callers can catch what they can act on.

Every error a user can cause (a bad file, a bad option, a bad message) is a :class:`DdnnError`;
the CLI prints those as one line and exits non-zero, and services count and drop them.
"""


class DdnnError(Exception):
    """Root of every error ddnn raises on purpose."""


class ConfigError(DdnnError, ValueError):
    """An option or setting is invalid."""


class DatasetError(DdnnError, ValueError):
    """A dataset file is missing, malformed or inconsistent with the contract."""


class BundleError(DdnnError):
    """A bundle is missing, tampered with, or incompatible with this version of ddnn."""


class CodecError(DdnnError, ValueError):
    """A tensor cannot be encoded, or bytes cannot be decoded, with the requested codec."""
