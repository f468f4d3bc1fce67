"""Flower's deployment engine, run as real processes: the SuperLink (``flower-superlink``), one
SuperNode per site (``flower-supernode``), the Flower App they run, and Flower's own command
line (``flwr run``, ``flwr ls``, ``flwr supernode register``) against the SuperLink, as a Flower
user would drive it.

Every address is passed explicitly; Flower's home (``FLWR_HOME``: its configuration with our
one SuperLink connection, the installed app) is a directory of ours; telemetry, update checks
and runtime dependency installation are off (a site may have no internet, and the app's
dependencies are this package's). No torch here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
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


def app_pyproject() -> str:
    """The Flower App's pyproject: our ServerApp and ClientApp (imported from the installed
    package on the SuperLink and SuperNodes) and the run config's keys with their defaults.
    ``deploy/flower-app/pyproject.toml`` is this text, for Flower users' ``flwr run``."""
    from ddnn.models.federated.settings import app_defaults

    config = "\n".join(f"{k} = {_toml(v)}" for k, v in app_defaults().items())
    return f"""# The Flower App of `ddnn federate` (models/federated/deployment.py writes it).
# Run it on your own SuperLink: `flwr run deploy/flower-app CONNECTION --run-config ...`, where the
# SuperLink's and the SuperNodes' environments have ddnn installed (docs/federated.md).
[project]
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
"""


def write_app(directory: Path) -> Path:
    """The Flower App (what ``flwr run`` packages) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(app_pyproject(), encoding="utf-8")
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


def flwr(home: Path, *args: str, timeout: float = 300.0) -> dict:
    """One ``flwr`` command with ``--format json`` in Flower's ``home``; its JSON answer. Its
    failure (an error Flower reports, or no JSON at all) is a :class:`DdnnError`."""
    argv = [_script("flwr"), *args, "--format", "json"]
    try:
        done = subprocess.run(argv, env=flower_env(home), cwd=home, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DdnnError(f"`flwr {args[0]}` did not answer within {timeout:.0f} s") from None
    except OSError as e:  # no `flwr` beside this Python nor on PATH
        raise DdnnError(f"cannot run Flower's `flwr` ({e}): pip install 'ddnn[federate]'"
                        ) from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        tail = re.sub(r"\x1b\[[0-9;]*m", "", done.stderr or done.stdout).strip()[-2000:]
        raise DdnnError(f"`flwr {args[0]}` failed (status {done.returncode}): {tail}")
    if not answer.get("success"):
        # Flower's message starts with the "Using SuperLink: ..." banner; the reason follows.
        lines = str(answer.get("error-message", "")).strip().splitlines()
        raise DdnnError(f"`flwr {args[0]}`: {lines[-1].strip() if lines else 'failed'}")
    return answer


def write_run_config(path: Path, run_config: dict) -> Path:
    """The run config as the TOML file ``flwr run --run-config`` takes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in run_config.items()),
                    encoding="utf-8")
    return path


def submit(home: Path, app_dir: Path, run_config: dict) -> int:
    """``flwr run``: start a run of the app with ``run_config`` on our SuperLink; its run id."""
    config = write_run_config(home / "run-config.toml", run_config)
    answer = flwr(home, "run", str(app_dir.resolve()), CONNECTION, "--run-config", str(config))
    return int(answer["run-id"])


def run_status(home: Path, run_id: int) -> tuple[str, str, str]:
    """``flwr ls --run-id``: (status, sub-status, details) of a run, e.g. ``finished``,
    ``completed`` or ``failed``, Flower's reason."""
    answer = flwr(home, "ls", CONNECTION, "--run-id", str(run_id))
    run = next((r for r in answer.get("runs", []) if str(r.get("run-id")) == str(run_id)), None)
    if run is None:
        raise DdnnError(f"the SuperLink does not know run {run_id}")
    status, _, sub = str(run.get("status", "")).partition(":")
    return status, sub, str(run.get("status-details", ""))


def register_supernode(home: Path, public_key: Path) -> int:
    """``flwr supernode register``: allow the SuperNode holding the private half of
    ``public_key`` (an OpenSSH ECDSA public key) to join; the node id Flower gave it."""
    answer = flwr(home, "supernode", "register", str(Path(public_key).resolve()), CONNECTION)
    return int(answer["node-id"])
