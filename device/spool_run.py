"""Which run a device's spool belongs to, and where the spool is by default.

The spool keeps what a device measured until the broker acknowledged it, so that a restart of
the same run sends it (on by default, ``--no-spool`` turns it off). It must never send what
another run left there: messages of another bundle version (the edge would take them for the
version they name, or refuse them), of another device or deployment (two devices given one
``--spool``), of another frame source, or frames that a replay is about to send again (a replay
numbers frames by their position, so a replay started again produces them afresh). So the
spool records its run in ``owner.json``; at start, what another run left is dropped (logged,
with the count), and a replay drops the recovered frames it will send itself. A camera or a
followed folder numbers frames by capture time, so its restarts never repeat a frame id, and
everything recovered is sent. A spool from before runs were recorded is taken over as is.

One process at a time: the spool is locked (``flock`` on ``.lock``) while a device uses it.

Default place, per deployment and device id: ``$STATE_DIRECTORY`` (systemd's
``StateDirectory=``), else ``$XDG_STATE_HOME/ddnn``, else ``~/.local/state/ddnn``, then
``spool/{deployment}/{device id}``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddnn.device.message import OutMessage
from ddnn.errors import ConfigError

log = logging.getLogger(__name__)

OWNER = "owner.json"
LOCK = ".lock"


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where a device keeps its state: systemd's ``$STATE_DIRECTORY`` (the first, when it
    lists several), else ``$XDG_STATE_HOME/ddnn``, else ``~/.local/state/ddnn``."""
    env = os.environ if environ is None else environ
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME") or Path.home())
                                             / ".local" / "state")
    return Path(base) / "ddnn"


def default_spool_dir(deployment: str, device: str,
                      environ: Mapping[str, str] | None = None) -> Path:
    """The spool of ``device`` of ``deployment`` when ``--spool`` does not name one."""
    return state_dir(environ) / "spool" / deployment / device


@dataclass(frozen=True)
class SpoolRun:
    """Who writes a spool. ``replayed``: the frame ids a replay numbers by position (it sends
    them afresh); None for sources that number frames by capture time."""

    deployment: str
    device: str
    model: str  # the bundle's name:version
    source: str  # data:/abs/file.npz, images:/abs/dir, camera:0
    replayed: range | None = field(default=None, compare=False)

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "replayed"}


class SpoolLock:
    """An exclusive lock on a spool directory for the life of one process."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise ConfigError(f"spool {directory} is in use by another process (pid {holder}); "
                              "give each device its own --spool") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # (closing releases the flock)
            self._fd = None


def adopt(directory: Path, recovered: list[tuple[int, OutMessage]], run: SpoolRun
          ) -> tuple[list[tuple[int, OutMessage]], list[tuple[int, OutMessage]]]:
    """Which of the messages recovered from the spool in ``directory`` ``run`` sends again, and
    which it drops (logged; the spool marks them done): ``(keep, stale)``. Records ``run`` as
    the spool's owner."""
    owner = directory / OWNER
    previous = _read(owner)
    keep, stale = recovered, []
    if recovered and previous is not None and previous != run.record():
        keep, stale = [], recovered
        log.warning("spool %s: dropping %d messages another run left (%s); this run is %s",
                    directory, len(stale), _describe(previous), _describe(run.record()))
    elif run.replayed is not None:
        again = run.replayed
        stale = [(seq, m) for seq, m in recovered if m.frame in again]
        keep = [(seq, m) for seq, m in recovered if m.frame not in again]
        if stale:
            log.info("spool %s: %d recovered messages are of frames this replay sends again; "
                     "dropped", directory, len(stale))
    _write(owner, run.record())
    return keep, stale


def _describe(record: dict) -> str:
    return ", ".join(f"{k} {record.get(k)}" for k in ("model", "source", "deployment", "device"))


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: another run's as far as anyone can tell
    return data if isinstance(data, dict) else {}


def _write(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # (not fsynced: a record lost in a power cut: the spool is taken over)
