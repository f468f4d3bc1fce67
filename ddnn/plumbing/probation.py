"""Probation of an over-the-air update: a new version that fails its health check is rolled back.

Once :class:`~ddnn.plumbing.ota.BundleUpdater` has applied a version, the version is on probation
for a window (``--ota-probation``, 60 s; 0: none). The tier looks at it every :func:`look_every`
seconds through its :class:`VersionProbe`: did it work since the last look, and what went wrong
(frames failing in its segments, the cloud refusing the version, the worker stalled). It is
**rolled back** once it has been failing for :data:`SUSTAIN` of the window in a row, with no
look in between that saw it work: the bundle it replaced (kept on disk until then) is verified
again and swapped back in, and the version is recorded as rolled back, so the retained
announcement that still names it never brings it back, after a restart either; a newer version
is still applied. It **passes** when the window is over and it is not failing; the bundle it
replaced is then deleted if it was a staged one.

A process that ends during probation without a clean stop (a crash, a kill, a segment that takes
the process down) leaves ``probation-{tag}.json`` behind: the next start rolls that version back
the same way. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ddnn.bundle import Bundle, load_bundle

log = logging.getLogger(__name__)

SUSTAIN = 0.25  # of the window: failing this long in a row rolls the version back
KEEP = 32  # rolled-back versions remembered per tier, the newest
PENDING, PASSED, FAILED = "pending", "passed", "failed"
CRASHED = "the process ended during its probation without a clean stop (a crash or a kill)"


def look_every(window: float) -> float:
    """Seconds between two looks: several per sustained failure, at most one a second."""
    return max(0.05, min(1.0, window * SUSTAIN / 4))


@dataclass(frozen=True)
class Look:
    """What a tier saw of its version since the previous look."""

    worked: bool = False  # it did work (answered frames, processed frames)
    problems: tuple[str, ...] = ()  # what failed, one sentence each; empty: nothing


class VersionProbe(Protocol):
    """A tier's view of the version it runs (``edge.health``, ``device.health``)."""

    def begin(self) -> None:
        """A version was just applied: count from now."""

    def look(self) -> Look:
        """What happened since the previous look (or :meth:`begin`)."""


class Probation:
    """The verdict on one version from its looks over time; the caller gives the times."""

    def __init__(self, ref: str, window: float, started: float):
        self.ref, self.window, self.started = ref, window, started
        self.sustain = window * SUSTAIN
        self.failing_since: float | None = None  # the first look of the current failing run
        self.problems: tuple[str, ...] = ()

    def observe(self, look: Look, now: float) -> str:
        """:data:`PENDING`, :data:`PASSED` or :data:`FAILED` after this look."""
        if look.problems:
            self.problems = look.problems
            if self.failing_since is None:
                self.failing_since = now
            if now - self.failing_since >= self.sustain:
                return FAILED
        elif look.worked:  # a look with nothing to see neither ends nor extends a failing run
            self.failing_since, self.problems = None, ()
        if now - self.started >= self.window and self.failing_since is None:
            return PASSED
        return PENDING

    def status(self, now: float) -> dict:
        failing = None if self.failing_since is None else round(now - self.failing_since, 1)
        return {"version": self.ref, "left_s": round(max(self.started + self.window - now, 0), 1),
                "failing_s": failing, "problems": list(self.problems)}


def write_json(path: Path, data: object) -> None:
    """Replace ``path`` with ``data`` as JSON, fsynced: a crash leaves the old or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable %s: %s", path, e)
        return None


def good_record(root: Path, tag: str) -> Path:
    """Where the version a tier last knew good is kept, for its next start."""
    return root / (f"good-{tag}.json" if tag else "good.json")


class RolledBack:
    """The versions rolled back on one tier (``rolled-back-{tag}.json``): never applied again
    there. ``name:version`` -> why and when; the :data:`KEEP` newest."""

    def __init__(self, path: Path):
        self.path = path
        data = read_json(path)
        self._entries: dict[str, dict] = {
            k: v for k, v in (data.items() if isinstance(data, dict) else ())
            if isinstance(v, dict) and isinstance(v.get("why"), str)}

    def why(self, ref: str) -> str | None:
        entry = self._entries.get(ref)
        return entry["why"] if entry else None

    def last(self) -> tuple[str, dict] | None:
        if not self._entries:
            return None
        return max(self._entries.items(), key=lambda kv: kv[1].get("at", 0))

    def add(self, ref: str, why: str) -> None:
        self._entries[ref] = {"why": why, "at": round(time.time(), 3)}
        newest = sorted(self._entries.items(), key=lambda kv: kv[1].get("at", 0))[-KEEP:]
        self._entries = dict(newest)
        try:
            write_json(self.path, self._entries)
        except OSError as e:  # a read-only disk: rolled back now, not remembered
            log.warning("cannot save the rolled-back versions %s: %s", self.path, e)


class UpdateGuard:
    """Keeps a :class:`~ddnn.plumbing.ota.BundleUpdater`'s applied version on probation and
    rolls it back to the last good bundle when it fails (see the module's docstring).

    ``apply(bundle)``: the updater's, swaps the tier's runtime. ``root``/``tag``: where the
    records live (the updater's staging directory). ``window``: seconds of probation (0: none,
    and a crash condemns nothing). ``probe``: the tier's look at its version (None: only a
    crash rolls back). ``public_key``: the bundle rolled back to is verified with it again.
    ``on_rollback(ref, why)``: told of each rollback. ``clock``: monotonic seconds (tests).
    """

    def __init__(self, running: Bundle, apply: Callable[[Bundle], None], *, root: Path,
                 tag: str = "", window: float = 0.0, probe: VersionProbe | None = None,
                 public_key: str | Path | None = None,
                 on_rollback: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.good = running  # the last version known good: what a rollback returns to
        self.window, self.root, self.public_key = window, root, public_key
        self._apply, self._probe, self._on_rollback, self._clock = (apply, probe, on_rollback,
                                                                    clock)
        self._tag = tag
        suffix = f"-{tag}" if tag else ""
        self.marker = root / f"probation{suffix}.json"
        self.rolled_back = RolledBack(root / f"rolled-back{suffix}.json")
        self._lock = threading.Lock()
        self._trial: tuple[Probation, Bundle] | None = None  # the version on probation
        self._replaced: list[Bundle] = []  # applied during that probation and superseded
        self._next_look = 0.0

    def resume(self) -> None:
        """At start: a version a previous process left on probation is rolled back."""
        data = read_json(self.marker)
        self.marker.unlink(missing_ok=True)
        if not isinstance(data, dict) or not isinstance(data.get("version"), str):
            return
        if data["version"] != self.good.ref:  # else the tier was deployed with it on purpose
            self.rolled_back.add(data["version"], CRASHED)
            # This process starts from its own bundle: the staged copies are of no more use.
            self._discard([Path(str(data.get(k))) for k in ("path", "previous_path")
                           if data.get(k)], keep=self.good.path)
            self._report(data["version"], CRASHED, self.good)

    # --- the updater's steps (its thread) --------------------------------------------------

    def arm(self, bundle: Bundle) -> None:
        """``bundle`` is about to be applied: until it passes, a crash condemns it."""
        if self.window > 0:
            self._mark(bundle)

    def disarm(self) -> None:
        """The version armed was not applied after all."""
        if self.window > 0:
            with self._lock:
                trial = self._trial
            if trial is not None:
                self._mark(trial[1])
            else:
                self.marker.unlink(missing_ok=True)

    def applied(self, bundle: Bundle) -> None:
        """``bundle`` now runs: its probation starts (or, without one, it is good at once)."""
        if self.window <= 0:
            self._discard([self.good.path], keep=bundle.path)
            self._keep(bundle)
            return
        with self._lock:
            if self._trial is not None:
                self._replaced.append(self._trial[1])  # superseded during its probation
            self._trial = (Probation(bundle.ref, self.window, self._clock()), bundle)
            self._next_look = self._clock()
        if self._probe is not None:
            self._probe.begin()
        log.info("%s is on probation for %g s; %s is kept to roll back to", bundle.ref,
                 self.window, self.good.ref)

    def due_in(self) -> float | None:
        """Seconds until the next look; None while no version is on probation."""
        with self._lock:
            return None if self._trial is None else max(self._next_look - self._clock(), 0.0)

    def check(self) -> Bundle | None:
        """Look at the version on probation when a look is due; returns the bundle that runs
        after a rollback, else None."""
        with self._lock:
            trial, now = self._trial, self._clock()
            if trial is None or now < self._next_look:
                return None
            self._next_look = now + look_every(self.window)
        look = self._probe.look() if self._probe is not None else Look()
        verdict = trial[0].observe(look, now)
        if verdict == PASSED:
            self._pass(trial[1])
        elif verdict == FAILED:
            return self._roll_back(trial[1], trial[0], now)
        return None

    def stop(self, clean: bool = True) -> None:
        """The tier stops. A clean stop during probation forgets it (an announcement applies
        the version again, on probation again); otherwise the marker stays, for the next start
        to roll the version back."""
        with self._lock:
            trial = self._trial
        if clean and trial is not None:
            self.marker.unlink(missing_ok=True)
            log.info("stopping during the probation of %s: it starts over when applied again",
                     trial[0].ref)

    def status(self) -> dict:
        """``probation`` (None when none) and the last version rolled back here, ever."""
        with self._lock:
            trial = self._trial[0].status(self._clock()) if self._trial is not None else None
        last = self.rolled_back.last()
        return {"probation": trial, "rolled_back_from": last[0] if last else None,
                "rollback_reason": last[1]["why"] if last else None}

    # --- verdicts ---------------------------------------------------------------------------

    def _pass(self, bundle: Bundle) -> None:
        with self._lock:
            old = [self.good, *self._replaced]
            self._trial, self._replaced = None, []
        self._keep(bundle)
        self.marker.unlink(missing_ok=True)
        self._discard([b.path for b in old], keep=bundle.path)
        log.info("%s passed its probation (%g s)", bundle.ref, self.window)

    def _roll_back(self, bad: Bundle, trial: Probation, now: float) -> Bundle | None:
        with self._lock:
            replaced = self._replaced
            self._trial, self._replaced = None, []
        failing = now - (trial.failing_since or now)
        why = (f"unhealthy for {failing:.1f} s of its {self.window:g} s probation: "
               + "; ".join(trial.problems))
        # Recorded before the swap: if the swap hangs or the process dies, the next start still
        # does not apply this version again.
        self.rolled_back.add(bad.ref, why)
        self.marker.unlink(missing_ok=True)
        try:
            good = load_bundle(self.good.path, public_key=self.public_key)
            self._apply(good)
        except Exception as e:  # nothing to go back to: the version keeps serving
            log.error("cannot roll %s back to %s (%s: %s); still running %s, which is not "
                      "applied again after a restart", bad.ref, self.good.ref,
                      type(e).__name__, e, bad.ref)
            return None
        self._keep(good)
        self._discard([b.path for b in (bad, *replaced)], keep=good.path)
        self._report(bad.ref, why, good)
        return good

    def _keep(self, bundle: Bundle) -> None:
        """``bundle`` is good now: what a rollback returns to, and what a restart runs
        (:mod:`ddnn.plumbing.good_version`)."""
        self.good = bundle
        try:
            write_json(good_record(self.root, self._tag), {"version": bundle.ref,
                                                           "path": str(bundle.path)})
        except OSError as e:  # a read-only disk: a restart runs --bundle
            log.warning("cannot save the good version %s: %s", good_record(self.root, self._tag),
                        e)

    def _report(self, ref: str, why: str, running: Bundle) -> None:
        log.warning("rolled back %s: %s; running %s; %s is not applied again here (a newer "
                    "version is)", ref, why, running.ref, ref)
        if self._on_rollback is not None:
            self._on_rollback(ref, why)

    def _mark(self, bundle: Bundle) -> None:
        try:
            write_json(self.marker, {"version": bundle.ref, "path": str(bundle.path),
                                     "previous": self.good.ref,
                                     "previous_path": str(self.good.path),
                                     "since": round(time.time(), 3)})
        except OSError as e:  # a read-only disk: probation still runs, a crash is not caught
            log.warning("cannot save the probation marker %s: %s", self.marker, e)

    def _discard(self, paths: list[Path], keep: Path) -> None:
        """Delete the staged bundles among ``paths`` (never the tier's own ``--bundle``)."""
        root, keep = self.root.resolve(), keep.resolve()
        for p in paths:
            path = p.resolve()
            if path.parent == root and path != keep and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
