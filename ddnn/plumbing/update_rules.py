"""Which announced bundle versions a tier takes over the air, judged before and after the fetch.

Anyone who may publish on the broker can announce, so an announcement is trusted for nothing
but the name and version to look for: the bundle is fetched from the tier's origin only (its
cloud), must be signed unless the tier allows unsigned bundles, must be newer than the running
version unless it allows downgrades, and must fit the running hierarchy (:func:`compatible`).
:class:`~ddnn.plumbing.ota.BundleUpdater` asks these rules before it fetches anything and again
of the verified manifest.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddnn.bundle import Manifest
from ddnn.errors import BundleError, ConfigError
from ddnn.plumbing.announcement import Announcement, bundle_url
from ddnn.plumbing.download import Origin
from ddnn.plumbing.ota_settings import UpdatePolicy, UpdateSource
from ddnn.versions import is_newer, parse_version

log = logging.getLogger("ddnn.plumbing.ota")  # the updater's logger: one place to filter


def compatible(running: Manifest, new: Manifest) -> None:
    """Raise :class:`BundleError` unless ``new`` can replace ``running`` in a live hierarchy:
    the same model name, views, classes, input and wire tensors (devices and edge update one
    after the other, so for a moment they exchange messages of both versions)."""
    checks = {
        "model name": (running.name, new.name),
        "views": (running.views, new.views),
        "classes": (running.classes, new.classes),
        "input shape": (running.input_shape, new.input_shape),
        "codecs": (running.codec, new.codec),
        "device features": (running.devices[0].output("features").shape,
                            new.devices[0].output("features").shape),
    }
    for what, (a, b) in checks.items():
        if a != b:
            raise BundleError(f"incompatible update: {what} {b} differs from the running {a}")


class UpdateRules:
    """The rules of one tier's updates: its ``policy``, its ``source`` (the origin bundles come
    from) and the ``public_key`` they must be signed by (None: refused, unless unsigned ones are
    allowed)."""

    def __init__(self, policy: UpdatePolicy, source: UpdateSource,
                 public_key: str | Path | None):
        self.policy, self.source, self.public_key = policy, source, public_key
        try:
            self.origin = Origin.of(source.origin) if source.origin else None
        except BundleError as e:
            raise ConfigError(f"cloud URL for bundle updates: {e}") from None
        if public_key is None and not policy.allow_unsigned:
            log.warning("no bundle key: over-the-air bundle updates will be refused (configure "
                        "--bundle-key, or allow unsigned updates explicitly)")

    def url(self, ann: Announcement) -> str:
        """Where the announced version is fetched from (its URL, else the tier's cloud)."""
        if ann.url is not None:
            return ann.url
        if self.source.origin is None:
            raise ConfigError("the announcement has no url and this tier knows no cloud")
        return bundle_url(self.source.origin, ann.name, ann.version)

    def precheck(self, ann: Announcement, running: Manifest) -> str:
        """What can be refused from the announcement alone; returns the URL to fetch."""
        url = self.url(ann)
        if self.origin is not None and Origin.of(url) != self.origin:
            raise BundleError(f"the announced URL {url!r:.200} is not on the cloud's origin "
                              f"{self.origin}; bundles are fetched from the cloud only")
        if self.public_key is None and not self.policy.allow_unsigned:
            raise BundleError("over-the-air bundles must be signed and no bundle key is "
                              "configured (--bundle-key); unsigned updates are refused unless "
                              "allowed explicitly")
        self.check_version(ann.name, ann.version, running)
        return url

    def check_version(self, name: str, version: str, running: Manifest) -> None:
        """Refuse a version of the running model that is not newer (unless downgrades are
        allowed)."""
        if self.policy.allow_downgrade or name != running.name:
            return  # another model is refused by compatible()
        if not is_newer(version, running.version):
            ordered = parse_version(version) is not None and \
                parse_version(running.version) is not None
            why = "" if ordered else (" (only versions that are integers or dotted integers "
                                      "can be ordered)")
            raise BundleError(f"version {version} is not newer than the running "
                              f"{running.version}{why}; downgrades are refused unless allowed "
                              "explicitly")

    def check_manifest(self, m: Manifest, ann: Announcement, url: str,
                       running: Manifest) -> None:
        """The verified manifest fetched from ``url``: the announced version, newer, and
        compatible with the running one."""
        if (m.name, m.version) != (ann.name, ann.version):
            raise BundleError(f"{url} holds {m.name}:{m.version}, not "
                              f"{ann.name}:{ann.version}")
        self.check_version(m.name, m.version, running)
        compatible(running, m)
