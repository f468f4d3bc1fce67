"""Flower's deployment engine, run as real processes: the SuperLink (``flower-superlink``), one
SuperNode per site (``flower-supernode``), the Flower App they run, and the run submitted to
the SuperLink's Control API with Flower's own client (what ``flwr run`` does).

Every address is passed explicitly; Flower's home (``FLWR_HOME``: its configuration, the
installed app) is a directory of ours; telemetry, update checks and runtime dependency
installation are off (a site may have no internet, and the app's dependencies are this
package's). The ``flwr`` command itself is not used: this install's typer (pinned by amqtt)
cannot build its command line, while its functions work. No torch here.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ddnn.errors import ConfigError, DdnnError

log = logging.getLogger("ddnn.federate")
CONNECTION = "ddnn"  # the SuperLink connection's name in Flower's configuration
APP_NAME = "ddnn-federate"
QUIET_FLOWER = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


@dataclass(frozen=True)
class Tls:
    """TLS files: the CA certificate (both sides) and the server's certificate and key."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None


def flower_env(home: Path) -> dict[str, str]:
    """The environment of Flower's processes: our home, no telemetry, and this Python's
    scripts first on PATH (the SuperLink and SuperNode start Flower's helpers by name)."""
    env = {**os.environ, **QUIET_FLOWER, "FLWR_HOME": str(home)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@contextlib.contextmanager
def flower_home(home: Path):
    """Point this process's Flower functions at ``home`` for the duration."""
    saved = {k: os.environ.get(k) for k in [*QUIET_FLOWER, "FLWR_HOME"]}
    os.environ.update({**QUIET_FLOWER, "FLWR_HOME": str(home)})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


class FlowerProcess:
    """A Flower process in its own process group (its helpers go with it), logging to a file."""

    def __init__(self, argv: list[str], home: Path, log_path: Path):
        self.argv, self.home, self.log_path = argv, home, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> FlowerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=flower_env(self.home),
                                         start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise DdnnError(f"{Path(self.argv[0]).name} exited; its log ({self.log_path}) "
                            f"ends with:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group (the process and the helpers it started), then SIGKILL."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # helpers that outlived their parent
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def superlink(home: Path, host: str, port: int, log_path: Path, tls: Tls | None = None,
              supernode_auth: bool = False) -> FlowerProcess:
    """``flower-superlink`` serving the Fleet, Control and runtime APIs on ``host:port``; it
    starts the ServerApp of each run in a subprocess."""
    argv = [_script("flower-superlink"), "--host", host, "--port", str(port),
            "--isolation", "subprocess", "--disable-runtime-dependency-installation"]
    if tls is None:
        if supernode_auth:
            raise ConfigError("SuperNode authentication needs TLS (Flower refuses it without)")
        argv.append("--insecure")
    else:
        if tls.cert is None or tls.key is None:
            raise ConfigError("the SuperLink needs a certificate and its key for TLS")
        argv += ["--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.cert),
                 "--ssl-keyfile", str(tls.key)]
    if supernode_auth:
        argv.append("--enable-supernode-auth")
    return FlowerProcess(argv, home, log_path)


def node_config(data: str | Path | None, experience: str | Path | None) -> str:
    """The SuperNode's ``--node-config``: where the site's data lies (TOML literal strings)."""
    pairs = []
    for key, value in (("data", data), ("experience", experience)):
        if value is None:
            continue
        text = str(Path(value).resolve())
        if "'" in text or "\n" in text:
            raise ConfigError(f"{key} path {text!r} holds a quote or a newline")
        pairs.append(f"{key}='{text}'")
    return " ".join(pairs)


def supernode(home: Path, superlink_address: str, runtime_port: int, log_path: Path,
              data: str | Path | None = None, experience: str | Path | None = None,
              ca: Path | None = None, auth_key: Path | None = None) -> FlowerProcess:
    """``flower-supernode`` for one site: it connects to the SuperLink's Fleet API and runs
    the ClientApp for each message in a subprocess, on its runtime API at 127.0.0.1."""
    argv = [_script("flower-supernode"), "--superlink", superlink_address,
            "--host", "127.0.0.1", "--port", str(runtime_port), "--isolation", "subprocess",
            "--node-config", node_config(data, experience)]
    argv += ["--root-certificates", str(ca)] if ca is not None else ["--insecure"]
    if auth_key is not None:
        argv += ["--auth-supernode-private-key", str(auth_key)]
    return FlowerProcess(argv, home, log_path)


def wait_http(address: str, process: FlowerProcess, timeout: float,
              ca: Path | None = None) -> None:
    """Poll the SuperLink's /health until it answers (or the process dies)."""
    import ssl

    scheme = "https" if ca is not None else "http"
    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    deadline = time.monotonic() + timeout
    while True:
        process.check_alive()
        try:
            with urllib.request.urlopen(f"{scheme}://{address}/health", timeout=2,
                                        context=context) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise DdnnError(f"the SuperLink at {address} did not become ready in {timeout} s")
        time.sleep(0.2)


def write_app(directory: Path) -> Path:
    """The Flower App (what ``flwr run`` packages): a pyproject naming our ServerApp and
    ClientApp and the run config's keys with their defaults."""
    from ddnn.models.federated.settings import app_defaults

    directory.mkdir(parents=True, exist_ok=True)
    config = "\n".join(f"{k} = {_toml(v)}" for k, v in app_defaults().items())
    (directory / "pyproject.toml").write_text(f"""[project]
name = "{APP_NAME}"
version = "1.0.0"
description = "Federated fine-tuning of a ddnn bundle"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "ddnn"

[tool.flwr.app.components]
serverapp = "ddnn.models.federated.server_app:app"
clientapp = "ddnn.models.federated.client_app:app"

[tool.flwr.app.config]
{config}
""", encoding="utf-8")
    return directory


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def write_connection(home: Path, address: str, ca: Path | None) -> None:
    """Flower's configuration in ``home``: one SuperLink connection, the default."""
    home.mkdir(parents=True, exist_ok=True)
    tls = f'root-certificates = "{ca}"' if ca is not None else "insecure = true"
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{address}"\n{tls}\n', encoding="utf-8")


@contextlib.contextmanager
def control_client(home: Path):
    """Flower's Control API client for our connection (what every ``flwr`` command uses)."""
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.utils import init_http_client_from_connection

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    with flower_home(home), contextlib.redirect_stdout(io.StringIO()):  # "Using SuperLink: …"
        client = init_http_client_from_connection(read_superlink_connection(CONNECTION))
    with flower_home(home):
        try:
            yield client
        finally:
            client.close()


def submit(home: Path, app_dir: Path, run_config: dict) -> int:
    """Start a run of the app with ``run_config`` on the SuperLink; returns its run id."""
    import hashlib

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import get_metadata_from_config
    from flwr.common.serde import fab_to_proto, user_config_to_proto
    from flwr.proto.control_pb2 import StartRunRequest
    from flwr.supercore.fab import Fab

    with flower_home(home):
        from flwr.cli.config_utils import load_and_validate

        config, _ = load_and_validate(app_dir / "pyproject.toml")
        fab_bytes = build_fab_from_disk(app_dir)
        get_metadata_from_config(config)
        fab = Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})
        request = StartRunRequest(fab=fab_to_proto(fab),
                                  override_config=user_config_to_proto(run_config))
    with control_client(home) as client:
        response = client.StartRun(request)
    if not response.HasField("run_id"):
        raise DdnnError("the SuperLink did not start the run")
    return int(response.run_id)


def run_status(client, run_id: int) -> tuple[str, str, str]:
    """(status, sub-status, details) of a run: ``finished``, ``completed``|``failed``, ..."""
    from flwr.proto.control_pb2 import ListRunsRequest

    res = client.ListRuns(ListRunsRequest(run_id=run_id))
    run = res.run_dict[run_id]
    return run.status.status, run.status.sub_status, run.status.details


def register_supernode(home: Path, public_key: Path) -> int:
    """Allow the SuperNode holding the private half of ``public_key`` (an OpenSSH ECDSA
    public key) to join; returns the node id Flower gave it."""
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.proto.control_pb2 import RegisterNodeRequest

    key = try_load_public_key(public_key)
    with control_client(home) as client:
        return int(client.RegisterNode(RegisterNodeRequest(public_key=key)).node_id)
