"""The one version order of bundles, shared by the cloud repository, over-the-air updates and
everything that makes a new version (training, federation).

A *numeric* version is one or more dot-separated decimal integers: ``"7"``, ``"1.10"``,
``"2.0.3"``. Numeric versions compare part by part as numbers, missing parts counting as zero:
``"1.9" < "1.10"``, ``"1.0" == "1"``. Any other version (``"beta"``, ``"v2"``, ``"2024-05"``)
cannot be placed among them: it orders before every numeric version, and among other such
versions as a plain string. Over-the-air updates never treat such a version as newer than
anything (an operator allows it with ``--ota-allow-downgrade``).
"""

from __future__ import annotations

import re

from ddnn.errors import ConfigError

_NUMERIC = re.compile(r"[0-9]+(\.[0-9]+)*")


def parse_version(version: str) -> tuple[int, ...] | None:
    """``"12"`` -> ``(12,)``, ``"1.10.2"`` -> ``(1, 10, 2)``; None when not numeric."""
    if not _NUMERIC.fullmatch(version):
        return None
    return tuple(int(p) for p in version.split("."))


def _canonical(parts: tuple[int, ...]) -> tuple[int, ...]:
    """Trailing zero parts dropped, so that ``1.0`` and ``1`` are one version."""
    end = len(parts)
    while end > 1 and parts[end - 1] == 0:
        end -= 1
    return parts[:end]


def version_key(version: str) -> tuple:
    """Sort key of the one version order (see the module docstring)."""
    parts = parse_version(version)
    if parts is None:
        return (0, version)
    return (1, _canonical(parts))


def is_newer(new: str, running: str) -> bool:
    """True when ``new`` is strictly newer than ``running``; a version that is not numeric is
    never newer, nor is anything newer than it."""
    a, b = parse_version(new), parse_version(running)
    if a is None or b is None:
        return False
    return _canonical(a) > _canonical(b)


def next_version(version: str) -> str:
    """The version after ``version``: its last numeric part plus one (``"3"`` -> ``"4"``,
    ``"1.9"`` -> ``"1.10"``). A version that is not numeric has no next one: name it."""
    parts = parse_version(version)
    if parts is None:
        raise ConfigError(f"version {version!r} is not numeric (like 3 or 1.10), so it has no "
                          "next version; give the new version explicitly")
    return ".".join(str(p) for p in (*parts[:-1], parts[-1] + 1))
