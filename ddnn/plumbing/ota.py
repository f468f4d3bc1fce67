"""Bundle updates over the air: announce a version, fetch it from the cloud, verify, swap.

An operator (or CI) announces a bundle version on the deployment's retained bundle topic,
``{prefix}/{deployment}/bundle``, as JSON ``{"name": ..., "version": ..., "url": ...}``
(``ddnn announce``). Devices and edges subscribed to it download the manifest and the files it
names from ``url`` (by default their cloud's ``/v1/bundles/{name}/{version}``) into a staging
directory beside their bundle, verify them with :func:`ddnn.bundle.load_bundle` (checksums, and
the signature when a public key is configured), check that the new version can replace the
running one, and hand it to the tier, which swaps its runtime atomically. A bad update is
refused with one log line and the running version keeps serving. Standard library only.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddnn.bundle import MANIFEST, Bundle, Manifest, check_name, load_bundle
from ddnn.errors import BundleError, ConfigError, DdnnError

log = logging.getLogger(__name__)

SIGNATURE = "manifest.sig"  # ddnn.signing's file, fetched when the cloud has it
MAX_FILE = 512 << 20  # bytes: a bigger download is refused, not written


@dataclass(frozen=True)
class Announcement:
    """A bundle version announced on the bundle topic."""

    name: str
    version: str
    url: str | None = None  # where to fetch it; None: the tier's cloud

    @classmethod
    def parse(cls, payload: bytes) -> Announcement:
        try:
            d = json.loads(payload.decode("utf-8"))
            ann = cls(check_name("model name", d["name"]),
                      check_name("model version", str(d["version"])), d.get("url"))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BundleError(f"unreadable bundle announcement ({type(e).__name__}: {e})"
                              ) from None
        if ann.url is not None and urllib.parse.urlsplit(ann.url).scheme not in ("http",
                                                                                  "https"):
            raise BundleError(f"bundle URL {ann.url!r} must be http(s)://")
        return ann

    def to_bytes(self) -> bytes:
        body = {"name": self.name, "version": self.version}
        if self.url:
            body["url"] = self.url
        return json.dumps(body).encode()


def bundle_url(cloud: str, name: str, version: str) -> str:
    """Where the cloud serves a bundle version's files (``cloud/bundles.py``)."""
    return f"{cloud.rstrip('/')}/v1/bundles/{name}/{version}"


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


def _get(url: str, token: str | None, timeout: float, optional: bool = False) -> bytes | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as r:
            data = r.read(MAX_FILE + 1)
    except urllib.error.HTTPError as e:
        if optional and e.code == 404:
            return None
        raise BundleError(f"GET {url}: HTTP {e.code}") from None
    except (OSError, ValueError) as e:
        raise BundleError(f"GET {url}: {e}") from None
    if len(data) > MAX_FILE:
        raise BundleError(f"GET {url}: larger than {MAX_FILE} bytes")
    return data


def fetch_bundle(url: str, staging: Path, *, token: str | None = None, timeout: float = 30.0,
                 public_key: str | Path | None = None) -> Bundle:
    """Download a bundle from ``url`` into ``staging`` and verify it; returns the loaded bundle.

    Files land in ``{staging}.part`` first, which is renamed when complete, so a half-done
    download is never taken for a bundle.
    """
    part = staging.with_name(staging.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        raw = _get(f"{url}/{MANIFEST}", token, timeout)
        try:
            manifest = Manifest.from_dict(json.loads(raw))
        except ValueError as e:
            raise BundleError(f"{url}/{MANIFEST}: not JSON ({e})") from None
        (part / MANIFEST).write_bytes(raw)
        sig = _get(f"{url}/{SIGNATURE}", token, timeout, optional=True)
        if sig is not None:
            (part / SIGNATURE).write_bytes(sig)
        for seg in manifest.segments().values():  # file names were checked by from_dict
            (part / seg.file).write_bytes(_get(f"{url}/{seg.file}", token, timeout))
        shutil.rmtree(staging, ignore_errors=True)
        part.rename(staging)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    if public_key is not None:
        return load_bundle(staging, public_key=public_key)
    return load_bundle(staging)


class BundleUpdater:
    """Follows a tier's bundle topic: fetches, verifies and applies announced versions.

    ``apply(bundle)`` swaps the tier's runtime (and may raise to refuse). Updates run on a
    thread of their own, one at a time; the MQTT thread only hands the announcement over.
    """

    def __init__(self, running: Bundle, apply: Callable[[Bundle], None], *,
                 cloud: str | None = None, token: str | None = None,
                 public_key: str | Path | None = None, staging_root: Path | None = None,
                 timeout: float = 30.0, on_result: Callable[[bool], None] | None = None,
                 tag: str = "", on_announce: Callable[[Announcement], None] | None = None):
        self.running = running
        self.tag = tag  # in staging names: tiers sharing a bundle directory never collide
        self._apply = apply
        self._on_result = on_result  # True: applied, False: refused (for metrics)
        self._on_announce = on_announce  # a version is coming (before it is fetched)
        self.cloud, self.token, self.public_key, self.timeout = cloud, token, public_key, timeout
        self.staging_root = staging_root or running.path.parent / ".ddnn-ota"
        self.applied = 0
        self.refused = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._pending: Announcement | None = None
        self._wake = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bundle-updater", daemon=True)
        self._thread.start()

    def on_message(self, payload: bytes) -> None:
        """An announcement arrived (MQTT thread): queue it, latest wins."""
        if not payload:
            return  # a cleared retained message
        try:
            ann = Announcement.parse(payload)
        except BundleError as e:
            self._refuse(None, str(e))
            return
        m = self.running.manifest
        if (ann.name, ann.version) == (m.name, m.version):
            return  # already running it (the retained announcement at every connection)
        if self._on_announce:
            self._on_announce(ann)
        with self._lock:
            self._pending = ann
        self._wake.set()

    def _loop(self) -> None:
        while not self._done.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:
                ann, self._pending = self._pending, None
            if ann is not None:
                self.update(ann)

    def update(self, ann: Announcement) -> bool:
        """Fetch, verify and apply one version; False (and the old version keeps running)
        when anything about it is wrong."""
        running = self.running.manifest
        url = ann.url or (bundle_url(self.cloud, ann.name, ann.version) if self.cloud else None)
        try:
            if url is None:
                raise ConfigError("the announcement has no url and this tier knows no cloud")
            suffix = f"-{self.tag}" if self.tag else ""
            staging = self.staging_root / f"{ann.name}-{ann.version}{suffix}"
            bundle = fetch_bundle(url, staging, token=self.token, timeout=self.timeout,
                                  public_key=self.public_key)
            m = bundle.manifest
            if (m.name, m.version) != (ann.name, ann.version):
                raise BundleError(f"{url} holds {bundle.ref}, not {ann.name}:{ann.version}")
            compatible(running, m)
            self._apply(bundle)
        except (DdnnError, OSError) as e:
            self._refuse(ann, str(e))
            return False
        except Exception as e:  # anything unforeseen refuses this version, never the updater
            log.exception("unexpected error applying %s:%s", ann.name, ann.version)
            self._refuse(ann, f"{type(e).__name__}: {e}")
            return False
        log.info("bundle updated over the air: %s:%s -> %s", running.name, running.version,
                 bundle.ref)
        self.running = bundle
        self.applied += 1
        self.last_error = None
        if self._on_result:
            self._on_result(True)
        return True

    def _refuse(self, ann: Announcement | None, why: str) -> None:
        self.refused += 1
        self.last_error = why
        what = f"{ann.name}:{ann.version}" if ann else "an announcement"
        log.error("refused bundle update %s: %s; still running %s", what, why, self.running.ref)
        if self._on_result:
            self._on_result(False)

    def stop(self) -> None:
        self._done.set()
        self._wake.set()
        self._thread.join(timeout=5)


def announce(broker: str, deployment: str, ann: Announcement, prefix: str = "ddnn",
             timeout: float = 10.0) -> None:
    """Publish ``ann`` retained on the deployment's bundle topic and wait for the broker."""
    from ddnn.plumbing.mqtt import MqttClient, MqttError, MqttOptions
    from ddnn.topics import Topics

    topic = Topics(deployment, prefix).bundle
    client = MqttClient(broker, f"ddnn-announce-{deployment}", MqttOptions()).start()
    try:
        if not client.wait_connected(timeout):
            raise MqttError(f"broker {broker} not reachable in {timeout:.0f} s")
        info = client.publish(topic, ann.to_bytes(), 1, retain=True)
        info.wait_for_publish(timeout)
    finally:
        client.stop()
    log.info("announced %s:%s on %s", ann.name, ann.version, topic)


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser(
        "announce", help="announce a bundle version to a deployment (over-the-air update)",
        description="Publish a bundle version on the deployment's retained bundle topic. "
        "Devices and edges fetch it over HTTP (from --url, or --cloud's /v1/bundles/NAME/"
        "VERSION, or their own cloud), verify it and swap it in; a bad one is refused and the "
        "running version keeps serving. The cloud must serve that version (--repository).",
        formatter_class=formatter)
    p.add_argument("--broker", required=True, help="MQTT broker URL")
    p.add_argument("--deployment", default="default", help="deployment name (topic level)")
    p.add_argument("--topic-prefix", default="ddnn", help="first topic level(s)")
    p.add_argument("--name", required=True, help="model name of the bundle")
    p.add_argument("--version", dest="bundle_version", required=True, help="bundle version")
    p.add_argument("--cloud", default=None,
                   help="cloud base URL: the files are fetched from its /v1/bundles/NAME/VERSION")
    p.add_argument("--url", default=None, help="fetch the bundle from this base URL instead")
    p.set_defaults(func=_announce)


def _announce(args) -> int:
    url = args.url or (bundle_url(args.cloud, args.name, args.bundle_version)
                       if args.cloud else None)
    ann = Announcement(check_name("model name", args.name),
                       check_name("model version", args.bundle_version), url)
    announce(args.broker, args.deployment, ann, args.topic_prefix)
    print(f"announced {ann.name}:{ann.version} to deployment {args.deployment}")
    return 0
