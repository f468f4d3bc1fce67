"""The version a tier last knew good survives a restart (``good-{tag}.json``).

Over the air, a tier runs versions other than its ``--bundle``: one it accepted (applied and out
of probation) or one it rolled back to. Both are bundle directories in the updater's staging
directory (``.ddnn-ota`` beside ``--bundle``). :class:`~ddnn.plumbing.probation.UpdateGuard`
records each new good version here; :func:`resume` reads it when the tier starts, so a restart
runs the version the tier had, not ``--bundle`` again.

Which wins at start: a ``--bundle`` whose version is **newer** (the project's one version order)
than the saved one, or of another model, is the operator redeploying: it wins and the record is
dropped. Otherwise the saved version runs, verified again (with ``--bundle-key`` where given);
one that is gone or fails verification is logged and ``--bundle`` runs. Standard library only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddnn.bundle import Bundle, load_bundle
from ddnn.errors import DdnnError
from ddnn.plumbing.probation import good_record, read_json
from ddnn.versions import is_newer

log = logging.getLogger(__name__)


STAGING = ".ddnn-ota"


def staging_root(bundle: Bundle) -> Path:
    """Where a tier's over-the-air bundles and their records live: beside ``--bundle``, and for
    a bundle that came over the air (resumed at start), the directory it was staged in."""
    parent = bundle.path.parent
    return parent if parent.name == STAGING else parent / STAGING


def resume(bundle: Bundle, *, tag: str = "", public_key: str | Path | None = None,
           root: Path | None = None) -> Bundle:
    """The bundle a tier started with ``bundle`` (its ``--bundle``) runs: the good version saved
    by a previous process where it is not older (see the module's docstring), else ``bundle``."""
    root = root or staging_root(bundle)
    path = good_record(root, tag)
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("version"), str) \
            or not isinstance(data.get("path"), str):
        return bundle
    name, _, version = data["version"].partition(":")
    m = bundle.manifest
    if name != m.name or not is_newer(version, m.version):
        if data["version"] != bundle.ref:
            log.info("starting with --bundle %s, not %s that ran before (%s)", bundle.ref,
                     data["version"], "another model" if name != m.name else "not newer")
        path.unlink(missing_ok=True)
        return bundle
    saved = Path(data["path"])
    if saved.resolve().parent != root.resolve():  # only the updater's own staged bundles
        log.warning("ignoring %s: it names %s, outside %s", path, saved, root)
        return bundle
    try:
        resumed = load_bundle(saved, public_key=public_key)
    except DdnnError as e:
        log.warning("cannot resume %s, which ran before (%s); starting with --bundle %s",
                    data["version"], e, bundle.ref)
        return bundle
    if resumed.ref != data["version"]:
        log.warning("ignoring %s: %s holds %s", path, saved, resumed.ref)
        return bundle
    log.info("resuming %s, the version this tier ran before its restart (over the air; "
             "--bundle %s is older)", resumed.ref, bundle.ref)
    return resumed
