"""What every bundle manifest begins with, whatever kind of bundle it describes.

The format and its version, the kind (a hierarchy, ``"ddnn"``, or a raw-offload reference,
``"raw"``), and the rules for a model's name, version and class list. :mod:`ddnn.bundle`
(hierarchy manifests and loading) and :mod:`ddnn.raw_manifest` both read them from here.
"""

from __future__ import annotations

from typing import Any

from ddnn import names
from ddnn.errors import BundleError

FORMAT = "ddnn-bundle"
FORMAT_VERSION = 2


def check_name(kind: str, value: str) -> str:
    """Validate a model name or version by the name rule (:mod:`ddnn.names`)."""
    return names.check_name(kind, value, BundleError)


def class_names(value: Any) -> tuple[str, ...]:
    """The manifest's class list: distinct non-empty strings (a bare string is not a list)."""
    if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
        raise BundleError(f"classes must be a list of non-empty strings, got {value!r:.80}")
    if len(set(value)) != len(value):
        raise BundleError(f"classes must be distinct, got {value!r:.80}")
    return tuple(value)


# What a bundle holds: a hierarchy (the tiers' segments), or a raw-offload reference (one
# model on raw views, served as {name}-raw).
KIND_NAMES = {"ddnn": "a hierarchy bundle", "raw": "a raw-offload reference bundle"}


def check_format(d: Any, kind: str) -> int:
    """The manifest's format version, once its format and kind are what the caller reads."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise BundleError(f"not a ddnn bundle manifest (format must be {FORMAT!r})")
    version = d.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise BundleError(f"invalid bundle format_version {version!r}")
    if version > FORMAT_VERSION:
        raise BundleError(
            f"bundle format version {version} is newer than this ddnn supports "
            f"({FORMAT_VERSION}); upgrade ddnn"
        )
    found = d.get("kind", "ddnn")
    if found != kind:
        what = KIND_NAMES.get(found, f"of unknown kind {found!r}")
        raise BundleError(f"this bundle is {what}, not {KIND_NAMES[kind]}")
    return version
