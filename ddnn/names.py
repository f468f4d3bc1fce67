"""The one rule for names that travel: model names, versions, deployments, device and edge ids.

They appear in MQTT topic levels, URL paths, file names and message headers, so they keep to a
small lowercase alphabet: 1-64 characters of ``a-z``, ``0-9``, ``.``, ``_`` and ``-``, starting
with a letter or digit. Lowercase because topics are case-sensitive: ``Cam0`` beside ``cam0``
would be two devices an operator reads as one.
"""

from __future__ import annotations

import re

from ddnn.errors import ConfigError, DdnnError

MAX_NAME = 64  # characters
# fullmatch, never ``$``: ``$`` also matches before a trailing newline.
_NAME = re.compile(rf"[a-z0-9][a-z0-9._-]{{0,{MAX_NAME - 1}}}")
RULE = (f"1-{MAX_NAME} lowercase letters, digits, '.', '_' or '-', starting with a letter or "
        "digit")


def is_name(value: object) -> bool:
    """True when ``value`` is a string that follows the name rule."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def check_name(kind: str, value: object, error: type[DdnnError] = ConfigError) -> str:
    """Return ``value`` if it is a valid name, else raise ``error`` naming ``kind``."""
    if not is_name(value):
        raise error(f"invalid {kind} {value!r:.80}: use {RULE}")
    return value  # type: ignore[return-value]
