"""The bundle announcement: which version a deployment is to run, as the retained JSON message
on its bundle topic (``ddnn announce``), and as the target a tier keeps on disk until it is
applied or refused (so a tier that restarts meanwhile takes it up again)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ddnn import bounded_json
from ddnn.bundle import check_name
from ddnn.errors import BundleError
from ddnn.plumbing.download import Origin
from ddnn.plumbing.probation import write_json

log = logging.getLogger("ddnn.plumbing.ota")  # what the updater logs, under its name


@dataclass(frozen=True)
class Announcement:
    """A bundle version announced on the bundle topic."""

    name: str
    version: str
    url: str | None = None  # where to fetch it; None: the tier's cloud

    @classmethod
    def parse(cls, payload: bytes) -> Announcement:
        try:
            d = bounded_json.loads(payload.decode("utf-8"))
            ann = cls(check_name("model name", d["name"]),
                      check_name("model version", str(d["version"])), d.get("url"))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BundleError(f"unreadable bundle announcement ({type(e).__name__}: {e})"
                              ) from None
        if ann.url is not None:
            if not isinstance(ann.url, str):
                raise BundleError(f"bundle URL {ann.url!r} must be a string")
            Origin.of(ann.url)  # http(s), a host, a valid port, no credentials
        return ann

    def to_bytes(self) -> bytes:
        body = {"name": self.name, "version": self.version}
        if self.url:
            body["url"] = self.url
        return json.dumps(body).encode()


def bundle_url(cloud: str, name: str, version: str) -> str:
    """Where the cloud serves a bundle version's files (``cloud/bundles.py``)."""
    return f"{cloud.rstrip('/')}/v1/bundles/{name}/{version}"


class TargetFile:
    """The announced version a tier is to run, kept on disk until it is applied or refused,
    so a tier that restarts meanwhile takes it up again."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> Announcement | None:
        try:
            return Announcement.parse(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, BundleError) as e:
            log.warning("ignoring the unreadable update target %s: %s", self.path, e)
            return None

    def save(self, ann: Announcement) -> None:
        try:
            write_json(self.path, json.loads(ann.to_bytes()))
        except OSError as e:  # a read-only disk: the update still runs, it is just not saved
            log.warning("cannot save the update target %s: %s", self.path, e)

    def forget(self, ann: Announcement) -> None:
        """Forget ``ann`` if it is still the saved target (not a newer one)."""
        saved = self.read()
        if saved is not None and (saved.name, saved.version) == (ann.name, ann.version):
            self.path.unlink(missing_ok=True)
