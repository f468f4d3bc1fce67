"""The model repository: every bundle version found in a directory, kept in step with the disk.

Each bundle directory's manifest gives its model name and version; a hierarchy bundle serves
``{name}-cloud``, ``{name}-cloud-packed`` (where its edge codec packs), ``{name}-full`` and
``{name}-escalated`` (where it can escalate) at that version, a raw-offload reference bundle
``{name}-raw``, and the latest version is each model's default. :meth:`ModelRepository.poll`
compares the directory with what is loaded — by each bundle's file names, sizes and modification
times — and loads, reloads or unloads accordingly.
A bundle that fails to load (bad checksum, a graph ONNX Runtime refuses, a name clash) is logged
and listed with its reason, and whatever was serving before keeps serving. Loading happens in a
worker thread; the swap of the served set happens on the event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddnn.bundle import MANIFEST, load_bundle, read_manifest
from ddnn.cloud.models import MODEL_KINDS, ServedModel
from ddnn.errors import BundleError, DdnnError
from ddnn.oip import ModelNotFoundError
from ddnn.raw_runtime import RawRuntime
from ddnn.runtime import BundleRuntime
from ddnn.signing import SIGNATURE
from ddnn.versions import version_key

log = logging.getLogger(__name__)

Signature = tuple[tuple[str, int, int], ...]
# What identifies one file as it was verified: device, inode, size, modification time.
Identity = tuple[int, int, int, int]


# The project's one version order (ddnn/versions.py): "1.10" after "1.9".
latest_key = version_key


def identity(st: os.stat_result) -> Identity | None:
    """A regular file's identity; None for anything else (a symlink, a directory, a FIFO)."""
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _identities(path: Path, names) -> dict[str, Identity | None]:
    out = {}
    for name in names:
        try:
            out[name] = identity(os.lstat(path / name))
        except OSError:
            out[name] = None
    return out


def signature(path: Path) -> Signature:
    """What identifies a bundle directory's content cheaply: its files' names, sizes, mtimes."""
    out = []
    try:
        for f in sorted(path.iterdir()):
            if f.name in (MANIFEST, SIGNATURE) or f.suffix == ".onnx":
                st = f.stat()
                out.append((f.name, st.st_size, st.st_mtime_ns))
    except OSError:  # the directory vanished mid-scan: it is seen as empty this time
        return ()
    return tuple(out)


@dataclass
class LoadedBundle:
    """A bundle version that is serving, with its models."""

    path: Path
    signature: Signature
    runtime: BundleRuntime | RawRuntime
    models: list[ServedModel] = field(default_factory=list)
    # Each segment file of the verified manifest that may be handed out (over-the-air
    # downloads): a regular file, not a symlink, as it was when its checksum was verified.
    files: dict[str, Identity] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str]:
        # A hierarchy and its raw-offload reference share a name and version: the kind tells
        # them apart (their models' names differ).
        m = self.runtime.manifest
        return m.name, m.version, m.kind


@dataclass(frozen=True)
class Failure:
    """A bundle directory that could not be loaded, and why."""

    path: Path
    signature: Signature
    reason: str
    models: tuple[tuple[str, str], ...] = ()  # (model, version) it would have served, if known


class ModelRepository:
    """The served models, by name and version, loaded from ``root``.

    ``single=True`` makes ``root`` itself the only bundle (``ddnn cloud --bundle DIR``).
    ``on_load``/``on_unload`` let the app attach and detach a batcher per model.
    """

    def __init__(self, root: Path, *, single: bool = False, ort_threads: int | None = None,
                 on_load: Callable[[ServedModel], None] | None = None,
                 on_unload: Callable[[ServedModel], None] | None = None,
                 on_failure: Callable[[Failure], None] | None = None,
                 public_key: Path | None = None):
        self.root = Path(root)
        self.public_key = public_key  # with it, only bundles signed by this key are served
        self.single = single
        self.ort_threads = ort_threads
        self._on_load = on_load or (lambda m: None)
        self._on_unload = on_unload or (lambda m: None)
        self._on_failure = on_failure or (lambda f: None)
        self._bundles: dict[Path, LoadedBundle] = {}
        self._failures: dict[Path, Failure] = {}
        self._models: dict[str, dict[str, ServedModel]] = {}
        self._lock = asyncio.Lock()

    # --- lookups ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self._models)

    def names(self) -> list[str]:
        return sorted(self._models)

    def versions(self, name: str) -> list[str]:
        return sorted(self._models.get(name, {}), key=latest_key)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """The model ``name`` at ``version`` (default: the latest); 404 when not served."""
        versions = self._models.get(name)
        if not versions:
            known = ", ".join(self.names()) or "none"
            raise ModelNotFoundError(f"unknown model {name!r}; served models: {known}")
        if version is None or version == "":
            return versions[max(versions, key=latest_key)]
        if version not in versions:
            raise ModelNotFoundError(f"model {name!r} has no version {version!r}; served "
                                     f"versions: {', '.join(self.versions(name))}")
        return versions[version]

    def served_bundle(self, name: str, version: str) -> LoadedBundle | None:
        """The verified, loaded hierarchy bundle ``name`` at ``version``, if it is serving."""
        for entry in self._bundles.values():
            if entry.key == (name, version, "ddnn"):
                return entry
        return None

    def failures(self) -> list[Failure]:
        return list(self._failures.values())

    def index(self) -> list[dict]:
        """The repository index of the protocol's repository extension, failures included."""
        out = [{"name": m.name, "version": m.version, "state": "READY", "reason": ""}
               for versions in self._models.values() for m in versions.values()]
        for f in self._failures.values():
            for name, version in f.models or ((f.path.name, ""),):
                out.append({"name": name, "version": version, "state": "UNAVAILABLE",
                            "reason": f.reason, "path": str(f.path)})
        return sorted(out, key=lambda e: (e["name"], e["version"]))

    # --- keeping in step with the disk ----------------------------------------------------------

    def _candidates(self) -> dict[Path, Signature]:
        if self.single:
            dirs = [self.root]
        else:
            try:
                # Dot-directories are an exporter's staging or trash: never half a bundle.
                dirs = sorted(p for p in self.root.iterdir()
                              if p.is_dir() and not p.name.startswith(".")
                              and (p / MANIFEST).is_file())
            except OSError as e:
                log.warning("cannot scan repository %s: %s", self.root, e)
                return {p: b.signature for p, b in self._bundles.items()}  # keep serving
        return {p: signature(p) for p in dirs}

    def _load(self, path: Path) -> tuple[BundleRuntime | RawRuntime, dict[str, Identity]]:
        try:
            before = _identities(path, [f.name for f in path.iterdir()])
        except OSError as e:
            raise BundleError(f"{path}: cannot list the bundle directory ({e})") from None
        bundle = load_bundle(path, public_key=self.public_key, kind=None)
        names = {seg.file for seg in bundle.manifest.segments().values()}
        after = _identities(path, names)
        if any(before.get(n) != after[n] for n in names):
            raise BundleError(f"{path}: files changed while the bundle was verified; it is "
                              "loaded again when they settle")
        runtime: BundleRuntime | RawRuntime = (
            RawRuntime(bundle, threads=self.ort_threads) if bundle.manifest.kind == "raw"
            else BundleRuntime(bundle, threads=self.ort_threads))
        runtime.load_all()  # every session now, so a bad graph fails here and not on a request
        # Segment files that are symlinks or not regular files are served, never handed out.
        return runtime, {n: i for n, i in after.items() if i is not None}

    async def poll(self) -> bool:
        """Bring the served set in line with the directory; True when anything changed."""
        async with self._lock:
            found = self._candidates()
            changed = False
            for path in [p for p in self._bundles if p not in found]:
                self._unload(self._bundles.pop(path), "its directory is gone")
                changed = True
            for path in [p for p in self._failures if p not in found]:
                del self._failures[path]
            for path, sig in found.items():
                current = self._bundles.get(path)
                failed = self._failures.get(path)
                if (current and current.signature == sig) or (failed and failed.signature == sig):
                    continue  # unchanged since it was last loaded or last failed
                changed = await self._try_load(path, sig) or changed
            return changed

    async def _try_load(self, path: Path, sig: Signature) -> bool:
        try:
            runtime, files = await asyncio.to_thread(self._load, path)
        except DdnnError as e:
            return self._fail(path, sig, str(e))
        except Exception as e:  # an unexpected loader bug must not stop the repository
            log.exception("unexpected error loading bundle %s", path)
            return self._fail(path, sig, f"{type(e).__name__}: {e}")
        entry = LoadedBundle(path, sig, runtime, files=files)
        clash = next((b for p, b in self._bundles.items()
                      if p != path and b.key == entry.key), None)
        if clash is not None:
            what = " (a raw-offload reference)" if entry.key[2] == "raw" else ""
            return self._fail(path, sig, f"{entry.key[0]} version {entry.key[1]}{what} is "
                                         f"already served from {clash.path}")
        old = self._bundles.pop(path, None)
        if old is not None:
            self._unload(old, "its files changed")
        entry.models = [kind(runtime) for kind in MODEL_KINDS if kind.serves(runtime.manifest)]
        for model in entry.models:
            self._models.setdefault(model.name, {})[model.version] = model
            self._on_load(model)
        self._bundles[path] = entry
        self._failures.pop(path, None)
        log.info("serving %s from %s (models %s)", runtime.bundle.ref, path,
                 ", ".join(m.name for m in entry.models))
        return True

    def _fail(self, path: Path, sig: Signature, reason: str) -> bool:
        try:
            m = read_manifest(path, kind=None)
            models = tuple((f"{m.name}-{kind.kind}", m.version) for kind in MODEL_KINDS
                           if kind.serves(m))
        except DdnnError:
            models = ()
        failure = Failure(path, sig, reason, models)
        self._failures[path] = failure
        serving = self._bundles.get(path)
        still = f"; still serving {serving.runtime.bundle.ref}" if serving else ""
        log.error("cannot load bundle %s: %s%s", path, reason, still)
        self._on_failure(failure)
        return True

    def _unload(self, entry: LoadedBundle, why: str) -> None:
        for model in entry.models:
            versions = self._models.get(model.name, {})
            if versions.get(model.version) is model:
                del versions[model.version]
                if not versions:
                    del self._models[model.name]
            self._on_unload(model)
        log.info("stopped serving %s from %s: %s", entry.runtime.bundle.ref, entry.path, why)
