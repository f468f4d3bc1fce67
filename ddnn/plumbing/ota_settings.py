"""What a tier tells its over-the-air updater, as option groups: its policy, where bundles may
come from, and the hooks it is told through (:class:`~ddnn.plumbing.ota.BundleUpdater`).

The device and the edge nest :class:`UpdatePolicy` in their settings (``--ota-*`` rows); the
device also :class:`UpdateSource` (``--ota-origin``, ``--ota-token``, ``--ota-ca-file``,
``--ota-cert-file``, ``--ota-key-file``), the edge builds its source from its cloud link.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddnn.errors import ConfigError
from ddnn.plumbing.options import Option, boolean, path

if TYPE_CHECKING:
    from ddnn.bundle import Bundle
    from ddnn.plumbing.announcement import Announcement


@dataclass(frozen=True, kw_only=True)
class UpdatePolicy:
    """Which announced versions a tier applies, how hard it tries, how long it watches one."""

    allow_unsigned: bool = False  # apply unsigned over-the-air bundles (explicit opt-out)
    allow_downgrade: bool = False  # apply a version not newer than the running one
    retry_max: float = 60.0  # longest wait between fetches of an announced version
    # Seconds an applied version may be rolled back in; 0: none. The tiers default to 60 s.
    probation: float = 0.0

    def __post_init__(self) -> None:
        if self.retry_max < 0.1:
            raise ConfigError(f"ota_retry_max must be at least 0.1, got {self.retry_max}")
        if self.probation < 0:
            raise ConfigError(f"ota_probation must not be negative, got {self.probation}")


@dataclass(frozen=True, kw_only=True)
class UpdateSource:
    """Where over-the-air bundles may be fetched from: one http(s) origin (the cloud), with the
    bearer token sent to it only, and the CA and client certificate of its TLS. Without an
    origin: from the announced URL, and the token is sent nowhere."""

    origin: str | None = None
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if self.origin is not None:
            u = urllib.parse.urlsplit(self.origin)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConfigError(f"--ota-origin {self.origin!r} must be http(s)://host[:port]")
        if self.key_file and not self.cert_file:
            raise ConfigError("--ota-key-file needs --ota-cert-file")


NO_PROBATION = UpdatePolicy()  # an updater's default policy: signed, newer, no probation
ANNOUNCED_URL = UpdateSource()  # an updater's default source: the announced URL, no token


def _ignore(*args) -> None:
    pass


@dataclass(frozen=True, kw_only=True)
class UpdateHooks:
    """How an updater tells its tier: ``apply`` swaps the tier's runtime (and may raise to
    refuse); the others are told, for metrics, statuses and the ingest."""

    apply: Callable[[Bundle], None]
    on_result: Callable[[bool], None] = _ignore  # True: applied, False: refused
    on_announce: Callable[[Announcement], None] = _ignore  # a version is coming
    on_retry: Callable[[Announcement, str], None] = _ignore  # a fetch failed for now
    on_refused: Callable[[Announcement], None] = _ignore  # that version is refused for good
    on_rollback: Callable[[str, str], None] = _ignore  # (version, why) failed its probation


BUNDLE_KEY_OPTION = Option(
    "bundle-key", path, "PUBKEY",
    "Ed25519 public key (PEM): refuse a bundle that is unsigned or not signed by it")

# The rows of UpdatePolicy in the device's and the edge's options tables.
UPDATE_OPTIONS = (
    Option("ota-allow-unsigned", boolean, "BOOL",
           "apply over-the-air bundles that carry no signature by --bundle-key (unsafe: anyone "
           "who can publish on the bundle topic and serve files picks the model)",
           key="allow_unsigned"),
    Option("ota-allow-downgrade", boolean, "BOOL",
           "apply an over-the-air bundle whose version is not newer than the running one",
           key="allow_downgrade"),
    Option("ota-retry-max", float, "SECONDS",
           "longest wait in seconds between attempts to fetch an announced bundle the cloud "
           "cannot serve yet (exponential backoff from 1 s; the target survives restarts)",
           key="retry_max"),
    Option("ota-probation", float, "SECONDS",
           "probation of an applied over-the-air bundle: failing its health check for a quarter "
           "of it rolls the previous bundle back in, and that version is not applied again "
           "(0: no probation)", key="probation"),
)

# The rows of UpdateSource in the device's table (the edge's source is its cloud link).
SOURCE_OPTIONS = (
    Option("ota-origin", str, "URL",
           "fetch over-the-air bundles only from this http(s) origin (e.g. the cloud's URL); "
           "unset: from the announced URL, signature still required", key="origin"),
    Option("ota-token", str, "TOKEN",
           "bearer token sent to --ota-origin when fetching bundles (a cloud run with --token); "
           "never sent anywhere else", secret=True, key="token"),
    Option("ota-ca-file", str, "FILE",
           "CA certificate (PEM) the --ota-origin's HTTPS certificate must chain to (default: "
           "the system's CAs)", key="ca_file"),
    Option("ota-cert-file", str, "FILE",
           "client certificate (PEM) presented to --ota-origin, for a cloud that requires one "
           "(ddnn cloud --ssl-ca-certs; make-certs.sh issues the device's with OU=device)",
           key="cert_file"),
    Option("ota-key-file", str, "FILE", "private key (PEM) of --ota-cert-file", key="key_file"),
)
