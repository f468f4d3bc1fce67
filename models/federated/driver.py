"""Running a federation: start the SuperLink (and, on one machine, a SuperNode per site),
submit the run, follow its progress, collect the new bundle and sign it. No torch here: the
training happens in Flower's ServerApp and ClientApp processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ddnn.errors import ConfigError, DdnnError
from ddnn.models.federated import deployment as flower
from ddnn.models.federated.settings import FederationSettings

log = logging.getLogger("ddnn.federate")
PROGRESS, RESULT = "progress.jsonl", "result.json"  # the ServerApp's files (server_app.py)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Site:
    """One site of a one-machine federation: its labelled data and/or its experience."""

    data: str | None = None
    experience: str | None = None


class ProgressReader:
    """Hands each new line of the ServerApp's progress file to ``on_round``."""

    def __init__(self, path: Path, on_round: Callable[[dict], None]):
        self.path, self.on_round, self.offset = path, on_round, 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            while (line := f.readline()).endswith("\n"):
                self.offset = f.tell()
                self.on_round(json.loads(line))


def follow(home: Path, run_id: int, work: Path, watched: list[flower.FlowerProcess],
           on_round: Callable[[dict], None], timeout: float, check_every: float = 60.0,
           first_check: float = 5.0) -> dict:
    """Wait for the run to finish, reporting rounds; returns the ServerApp's result.

    The rounds come from the ServerApp's progress file; the run's status from ``flwr ls``
    at once when the ServerApp has written its result (its error too), and otherwise after
    ``first_check`` seconds, a pause that doubles up to ``check_every``: a run that fails
    before writing anything (a ServerApp that does not start) is seen early, while a long run
    is not charged a Flower process (about 2 CPU s) every few seconds."""
    reader = ProgressReader(work / PROGRESS, on_round)
    deadline = time.monotonic() + timeout
    next_check, pause = time.monotonic(), first_check
    while True:
        reader.poll()
        for p in watched:
            p.check_alive()
        if (work / RESULT).exists() or time.monotonic() >= next_check:
            status, sub, details = flower.run_status(home, run_id)
            if status == "finished":
                reader.poll()
                break
            next_check = time.monotonic() + pause
            pause = min(2 * pause, check_every)
        if time.monotonic() > deadline:
            raise DdnnError(f"the federation did not finish within {timeout:.0f} s")
        time.sleep(0.5)
    result = json.loads((work / RESULT).read_text()) if (work / RESULT).exists() else {}
    if sub != "completed" or "error" in result:
        reason = result.get("error") or details or f"run {sub}"
        raise DdnnError(f"the federation failed: {reason}")
    return result


def _sign(result: dict, key: str | None) -> dict:
    if key is None:
        return result
    from ddnn.bundle import load_bundle
    from ddnn.signing import sign_bundle

    sign_bundle(load_bundle(result["bundle"]).path, key)
    return {**result, "signed": True}


def _absolute(s: FederationSettings, work: Path) -> FederationSettings:
    bundle = Path(s.bundle)
    if not (bundle / "manifest.json").is_file():
        raise ConfigError(f"{bundle}: not a bundle directory")
    return replace(s, bundle=str(bundle.resolve()), out=str(Path(s.out).resolve()),
                   work=str(work.resolve()))


def run_on_one_machine(s: FederationSettings, sites: list[Site], key: str | None = None,
                       on_round: Callable[[dict], None] = lambda e: None,
                       timeout: float = 3600.0, logs: Path | None = None) -> dict:
    """The server and one client per site as real processes on free loopback ports."""
    if not sites:
        raise ConfigError("a federation needs at least one --site")
    with tempfile.TemporaryDirectory(prefix="ddnn-federate-") as tmp:
        root = Path(tmp)
        logs = logs or root / "logs"
        s = _absolute(replace(s, wait_sites=max(s.wait_sites, len(sites))), root / "work")
        port = free_port()
        address = f"127.0.0.1:{port}"
        home = root / "superlink"
        with contextlib.ExitStack() as stack:
            link = stack.enter_context(flower.superlink(home, "127.0.0.1", port,
                                                        logs / "superlink.log"))
            flower.wait_http(address, link, timeout=60)
            nodes = [stack.enter_context(flower.supernode(
                root / f"site-{i}", address, free_port(), logs / f"site-{i}.log",
                data=site.data, experience=site.experience)) for i, site in enumerate(sites)]
            flower.write_connection(home, address, None)
            run_id = flower.submit(home, flower.write_app(root / "app"), s.run_config())
            result = follow(home, run_id, Path(s.work), [link, *nodes], on_round, timeout)
    return _sign(result, key)


def serve(s: FederationSettings, host: str, port: int, home: Path, tls: flower.Tls | None,
          authorized_keys: list[Path], key: str | None = None,
          on_round: Callable[[dict], None] = lambda e: None,
          timeout: float = 24 * 3600.0) -> dict:
    """``ddnn federate server``: the SuperLink and one run, for SuperNodes elsewhere."""
    home.mkdir(parents=True, exist_ok=True)
    s = _absolute(s, home / "work")
    work = Path(s.work)
    for stale in (work / PROGRESS, work / RESULT):
        stale.unlink(missing_ok=True)
    connect = f"127.0.0.1:{port}" if host in ("0.0.0.0", "::", "") else f"{host}:{port}"
    auth = bool(authorized_keys)
    with flower.superlink(home / "superlink", host, port, home / "superlink.log", tls,
                          supernode_auth=auth) as link:
        flower.wait_http(connect, link, timeout=60, ca=tls.ca if tls else None)
        flower.write_connection(home / "superlink", connect, tls.ca if tls else None)
        for public in authorized_keys:
            node = flower.register_supernode(home / "superlink", public)
            log.info("SuperNode key %s registered as node %s", public, node)
        run_id = flower.submit(home / "superlink", flower.write_app(home / "app"),
                               s.run_config())
        log.info("federation run %s started; waiting for %d site(s) at %s:%d", run_id,
                 s.wait_sites, host, port)
        # Hours may pass waiting for the sites: Flower's status once a minute is enough (the
        # ServerApp's result, or its error, is seen at once).
        result = follow(home / "superlink", run_id, work, [link], on_round, timeout)
    return _sign(result, key)


@contextlib.contextmanager
def stopped_by_sigterm():
    """SIGTERM (systemd, a supervisor) unwinds like Ctrl-C, so the Flower processes we started
    are stopped on the way out instead of being left behind."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def client(superlink_address: str, home: Path, data: str | None, experience: str | None,
           ca: Path | None, auth_key: Path | None, runtime_port: int = 0,
           retry: tuple[float, float] = (5.0, 60.0)) -> int:
    """``ddnn federate client``: this site's SuperNode, in the foreground until stopped.

    A SuperNode gives up when the SuperLink refuses it (a key not registered yet, a server
    restarting); the site starts it again after a pause that doubles up to ``retry[1]``.
    """
    if data is None and experience is None:
        raise ConfigError("a site needs --data, --experience or both")
    for path in filter(None, (data, experience)):
        if not Path(path).exists():
            raise ConfigError(f"{path}: no such file or directory")
    pause = retry[0]
    while True:
        node = flower.supernode(home, superlink_address, runtime_port or free_port(),
                                home / "supernode.log", data, experience, ca, auth_key)
        log.info("site connecting to %s (log: %s)", superlink_address, node.log_path)
        with node:
            while node.alive():
                time.sleep(1.0)
        code = node.proc.returncode if node.proc else 0
        lines = node.log_path.read_text(errors="replace").strip().splitlines()
        reason = next((ln for ln in reversed(lines) if "code:" in ln or "ERROR" in ln), "")
        log.warning("the SuperNode exited (status %s%s); starting it again in %.0f s", code,
                    f": {reason.strip()}" if reason else "", pause)
        time.sleep(pause)
        pause = min(pause * 2, retry[1])
