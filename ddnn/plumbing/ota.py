"""Bundle updates over the air: announce a version, fetch it from the cloud, verify, swap.

An operator (or CI) announces a bundle version on the deployment's retained bundle topic,
``{prefix}/{deployment}/bundle``, as JSON ``{"name": ..., "version": ..., "url": ...}``
(``ddnn announce``). Devices and edges subscribed to it fetch the version from ``url`` (by
default their cloud's ``/v1/bundles/{name}/{version}``), verify it and hand it to the tier, which
swaps its runtime atomically. A bad update is refused with one log line and the running version
keeps serving. Standard library only.

Anyone who may publish on the broker can announce, so an announcement is trusted for nothing but
the name and version to look for:

* **Origin**: a tier with a cloud fetches only from the cloud's origin (scheme, host and port);
  an announcement pointing elsewhere is refused. Redirects are followed only within the origin
  the download started on, and the cloud's bearer token is sent only to the cloud's origin.
* **Signature first**: the manifest and its signature are fetched (small, capped) and verified
  before anything the manifest names is downloaded; without a bundle key an over-the-air
  bundle is refused unless the tier opted out (``allow_unsigned=True``).
* **Versions only go forward**: a version not newer than the running one is refused unless the
  tier allows downgrades (``allow_downgrade=True``); versions compare as integers or dotted
  integers (``2 < 10``, ``1.9 < 1.10``), and versions that are not numbers cannot be ordered.
* **Bounded**: every file is capped by the size the manifest declares (else :data:`MAX_FILE`)
  and hashed while it streams; one deadline covers the whole download, however slowly the
  server trickles; a failed or refused download leaves nothing on disk.

Those rules are :mod:`ddnn.plumbing.update_rules` (:class:`UpdateRules`).

An accepted announcement is the tier's target until it is applied or refused: kept on disk
beside the bundle (``.ddnn-ota/target-{tag}.json``), fetched again with backoff while the
server cannot serve it (:class:`~ddnn.plumbing.download.Unreachable`), and taken up again by
a tier that restarts meanwhile. An applied version is on probation for a while, and rolled back
if it fails its health check (:mod:`ddnn.plumbing.probation`). The version a tier last knew good
(accepted, or rolled back to) is what it runs after a restart (:mod:`ddnn.plumbing.good_version`).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from ddnn.bundle import Bundle, Manifest
from ddnn.errors import BundleError, DdnnError
from ddnn.plumbing.announcement import Announcement, TargetFile, bundle_url
from ddnn.plumbing.download import Origin, Unreachable, fetch_bundle
from ddnn.plumbing.good_version import staging_root as default_staging_root
from ddnn.plumbing.ota_settings import (
    ANNOUNCED_URL,
    NO_PROBATION,
    UpdateHooks,
    UpdatePolicy,
    UpdateSource,
)
from ddnn.plumbing.probation import UpdateGuard, VersionProbe
from ddnn.plumbing.retry import RetryPolicy
from ddnn.plumbing.throttle import LogThrottle
from ddnn.plumbing.update_rules import UpdateRules, compatible
from ddnn.versions import is_newer

# Besides the updater, what announcing and fetching code reads from here, where it lived first.
__all__ = ["Announcement", "BundleUpdater", "Origin", "bundle_url", "compatible"]

log = logging.getLogger(__name__)

class BundleUpdater:
    """Follows a tier's bundle topic: fetches, verifies and applies announced versions.

    ``hooks.apply(bundle)`` swaps the tier's runtime (and may raise to refuse). Updates run on
    a thread of their own, one at a time; the MQTT thread only hands the announcement over.

    ``source`` (:class:`~ddnn.plumbing.ota_settings.UpdateSource`): with an origin (the tier's
    cloud, a device's ``--ota-origin``), bundles are fetched only from it and its token goes
    only there; without one, the announced URL is used, with no token. Its ``ca_file`` is the
    CA an https origin's certificate chains to (default: the system's CAs), its
    ``cert_file``/``key_file`` this tier's client certificate, for a cloud that requires one.
    ``public_key``: bundles must be signed by it; without one every announced version is
    refused unless ``policy.allow_unsigned``. ``policy.allow_downgrade``: accept a version that
    is not newer than the running one. ``timeout``: seconds for one whole download.

    **Persistent and retried**: an accepted announcement is the tier's *target*, written to
    ``{staging_root}/target[-{tag}].json`` until it is applied or refused. A fetch that fails
    because the server cannot serve it now (down, 5xx, a 404 for the manifest, too slow:
    :class:`~ddnn.plumbing.download.Unreachable`) is retried with ``retry``'s backoff (default:
    from 1 s up to ``policy.retry_max``), for as long as it takes; ``on_retry(announcement,
    why)`` is told each time. A tier that restarts
    meanwhile finds its target at start, announces it again (``on_announce``: keep taking its
    messages) and keeps retrying. Anything wrong with the bundle itself refuses it for good
    (``on_result(False)``), and the running version keeps serving.

    **On probation** (``policy.probation`` seconds, :class:`~ddnn.plumbing.probation.UpdateGuard`):
    ``probe`` looks at an applied version; one that fails is rolled back (``on_rollback(ref,
    why)``) and never applied again here, after a restart either.
    """

    def __init__(self, running: Bundle, hooks: UpdateHooks, *,
                 policy: UpdatePolicy = NO_PROBATION, source: UpdateSource = ANNOUNCED_URL,
                 public_key: str | Path | None = None, tag: str = "",
                 staging_root: Path | None = None, probe: VersionProbe | None = None,
                 timeout: float = 120.0, retry: RetryPolicy | None = None):
        self.running = running
        self.tag = tag  # in staging names: tiers sharing a bundle directory never collide
        self.hooks, self.policy, self.source = hooks, policy, source
        self.public_key, self.timeout = public_key, timeout
        self.rules = UpdateRules(policy, source, public_key)
        self.staging_root = staging_root or default_staging_root(running)
        self.target = TargetFile(self.staging_root / (f"target-{tag}.json" if tag
                                                      else "target.json"))
        self.applied = 0
        self.refused = 0
        self.failures = 0  # failed fetches in a row of the current target
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._pending: Announcement | None = None  # the target, until applied or refused
        if retry is None:  # 1 s doubling up to the policy's longest wait
            retry = RetryPolicy(min(1.0, policy.retry_max), policy.retry_max)
        self._backoff = retry.backoff()
        self._wake = threading.Event()
        self._done = threading.Event()
        # Probation of what is applied; a version left on probation by a crash is rolled back.
        self.guard = UpdateGuard(running, hooks.apply, root=self.staging_root, tag=tag,
                                 window=policy.probation, probe=probe, public_key=public_key,
                                 on_rollback=hooks.on_rollback)
        self._skipped = LogThrottle()  # rolled-back versions announced again (logged once)
        # Failed fetches of the target: logged at the first and at each doubling, so an outage
        # of days stays a few lines.
        self._fetch_failures_log = LogThrottle(doubling=True)
        self._thread: threading.Thread | None = None

    def start(self) -> BundleUpdater:
        """Roll back a version a crash left on probation, start the update thread, and take up
        the target a previous process left."""
        self.guard.resume()
        self._thread = threading.Thread(target=self._loop, name="bundle-updater", daemon=True)
        self._thread.start()
        self._resume()
        return self

    # --- the persisted target -----------------------------------------------------------------

    def _resume(self) -> None:
        """Take up the target a previous process left (announced, not yet applied)."""
        ann = self.target.read()
        m = self.running.manifest
        if ann is None:
            # The version this tier last rolled back is likely still announced, and devices
            # may run it well: its messages are taken from the start, before MQTT connects.
            last = self.guard.rolled_back.last()
            name, _, version = last[0].partition(":") if last else ("", "", "")
            if name == m.name and is_newer(version, m.version):
                self.hooks.on_announce(Announcement(name, version))
            return
        if (ann.name, ann.version) == (m.name, m.version) or self._rolled_back(ann):
            self.target.forget(ann)  # applied, rolled back, or the tier was redeployed with it
            return
        try:
            self.rules.precheck(ann, self.running.manifest)
        except DdnnError as e:
            log.warning("dropping the saved update target %s:%s: %s", ann.name, ann.version, e)
            self.target.forget(ann)
            return
        log.info("resuming the update to %s:%s (announced before this process started); "
                 "running %s meanwhile", ann.name, ann.version, self.running.ref)
        self._take(ann)

    # --- announcements --------------------------------------------------------------------------

    def on_message(self, payload: bytes) -> None:
        """An announcement arrived (MQTT thread): it becomes the target, latest wins."""
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
        with self._lock:
            if self._pending == ann:
                return  # already the target (retrying it): keep its backoff
        if self._rolled_back(ann):
            return
        try:
            self.rules.precheck(ann, self.running.manifest)
        except DdnnError as e:  # refused before anything is fetched or announced to the tier
            self._refuse(ann, str(e))
            return
        self.target.save(ann)
        self._take(ann)

    def _rolled_back(self, ann: Announcement) -> bool:
        """True for a version rolled back here: not applied, but still announced to the tier
        (other tiers may run it well, and the wire format is the running one's)."""
        ref = f"{ann.name}:{ann.version}"
        why = self.guard.rolled_back.why(ref)
        if why is None:
            return False
        if self._skipped(ref):
            log.info("not applying %s: rolled back here before (%s); still running %s", ref,
                     why, self.running.ref)
        self.hooks.on_announce(ann)
        return True

    def _take(self, ann: Announcement) -> None:
        self.hooks.on_announce(ann)
        with self._lock:
            self._pending = ann
            self._backoff.succeeded()  # a new target is tried at once
            self.failures = 0
            self._fetch_failures_log.forget()
        self._wake.set()

    def _loop(self) -> None:
        while not self._done.is_set():
            rolled_back_to = self.guard.check()  # the version on probation, when a look is due
            if rolled_back_to is not None:
                self.running = rolled_back_to
            with self._lock:
                ann = self._pending
                due = ann is not None and self._backoff.ready()
                wait = 0.5 if ann is None else self._backoff.retry_at - time.monotonic()
            look = self.guard.due_in()
            if not due:
                self._wake.wait(min(max(wait, 0.01), 0.5, 0.5 if look is None else look))
                self._wake.clear()
                continue
            outcome = self._update(ann)  # type: ignore[arg-type]
            with self._lock:
                if self._pending != ann:
                    continue  # a newer target came meanwhile: it goes next, at once
                if outcome == "retry":
                    self._backoff.failed()
                else:
                    self._pending = None

    # --- one attempt ----------------------------------------------------------------------------

    def update(self, ann: Announcement) -> bool:
        """Fetch, verify and apply one version; False (and the old version keeps running)
        when anything about it is wrong, or it cannot be fetched now."""
        return self._update(ann) == "applied"

    def _update(self, ann: Announcement) -> str:
        """One attempt: ``applied``, ``refused`` (for good) or ``retry`` (fetch failed now)."""
        try:
            bundle = self._fetch_and_apply(ann)
        except Unreachable as e:  # nothing wrong with the bundle: the server cannot serve now
            self._retry_later(ann, str(e))
            return "retry"
        except (DdnnError, OSError) as e:
            self._refuse(ann, str(e))
            return "refused"
        except Exception as e:  # anything unforeseen refuses this version, never the updater
            log.exception("unexpected error applying %s:%s", ann.name, ann.version)
            self._refuse(ann, f"{type(e).__name__}: {e}")
            return "refused"
        log.info("bundle updated over the air: %s -> %s", self.running.ref, bundle.ref)
        self.guard.applied(bundle)
        self.running = bundle
        self.failures = 0
        self._fetch_failures_log.forget()
        self.last_error = None
        self.target.forget(ann)
        self.applied += 1  # last: whoever sees the count sees the rest of the update done
        self.hooks.on_result(True)
        return "applied"

    def _fetch_and_apply(self, ann: Announcement) -> Bundle:
        running = self.running.manifest
        suffix = f"-{self.tag}" if self.tag else ""
        staging = self.staging_root / f"{ann.name}-{ann.version}{suffix}"
        url = self.rules.precheck(ann, running)

        def check(m: Manifest) -> None:  # on the verified manifest, before its files
            self.rules.check_manifest(m, ann, url, running)

        if staging.resolve() == self.running.path.resolve():
            raise BundleError(f"{staging} holds the running bundle")
        src = self.source
        bundle = fetch_bundle(url, staging, token=src.token, timeout=self.timeout,
                              public_key=self.public_key,
                              allow_unsigned=self.policy.allow_unsigned, token_origin=src.origin,
                              ca_file=src.ca_file, cert_file=src.cert_file,
                              key_file=src.key_file, check=check)
        try:
            check(bundle.manifest)  # what was loaded from disk, once more
            self.guard.arm(bundle)  # a crash from here on condemns it (probation)
            self.hooks.apply(bundle)
        except BaseException:
            self.guard.disarm()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return bundle

    def _retry_later(self, ann: Announcement, why: str) -> None:
        self.failures += 1
        self.last_error = why
        # Count before the log line: whoever reads the line (an operator, a test) then finds
        # the retry in the metrics too.
        self.hooks.on_retry(ann, why)
        if self._fetch_failures_log():
            log.warning("cannot fetch bundle %s:%s now (%s; %d failed tries); retrying with "
                        "backoff, still running %s", ann.name, ann.version, why, self.failures,
                        self.running.ref)

    def _refuse(self, ann: Announcement | None, why: str) -> None:
        self.refused += 1
        self.last_error = why
        what = f"{ann.name}:{ann.version}" if ann else "an announcement"
        log.error("refused bundle update %s: %s; still running %s", what, why, self.running.ref)
        if ann is not None:
            self.target.forget(ann)
            self.hooks.on_refused(ann)
        self.hooks.on_result(False)

    # --- state ----------------------------------------------------------------------------------

    def status(self) -> dict:
        """For health checks and status messages: what runs, what is wanted, what went wrong."""
        with self._lock:
            target = self._pending
        return {"running": self.running.ref,
                "target": f"{target.name}:{target.version}" if target else None,
                "failures": self.failures, "last_error": self.last_error,
                "applied": self.applied, "refused": self.refused, **self.guard.status()}

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, clean: bool = True) -> None:
        """Stop the updater; ``clean=False`` (the tier is failing) leaves a version on
        probation to be rolled back at the next start."""
        self._done.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.guard.stop(clean)
