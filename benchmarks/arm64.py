"""An emulated aarch64 board on this machine: a Debian arm64 userland run through qemu-user.

The device agent is for Raspberry Pi-class boards (aarch64 Linux). :class:`Userland` makes an
arm64 Debian userland once with ``debootstrap --arch=arm64`` from Debian's packages (cached under
``DDNN_ARM64_CACHE``, default ``/var/cache/ddnn-arm64``), runs its programs through
``qemu-user-static`` (binfmt_misc), installs a ddnn wheel with the device extra into a fresh
virtual environment there, and runs commands inside it. ``make test-arm64`` (tests/support/arm64.py)
runs the device's tests and a live replay in it; ``ddnn bench --only device_footprint`` measures
the agent's memory in it when it has been built.

Every command runs in a private mount namespace (``unshare --mount``) chrooted into the userland,
with /proc, /dev and a fresh /tmp mounted and the host folders it needs bound at the same paths;
the network, loopback included, is the host's, so a device inside talks to a broker outside.
/sys is left unmounted on purpose: under qemu, ONNX Runtime's CPU detection crashes on the host's
/sys (without it, it only warns that it cannot parse the CPU lists). Needs root.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

# Debian 12: what Raspberry Pi OS (64-bit) is built on, with the same Python (3.11).
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# minbase plus Python and venv: the least a board needs to run `pip install ddnn[device]`.
PACKAGES = ("python3", "python3-venv")
CACHE = Path("/var/cache/ddnn-arm64")
VENV = "/opt/ddnn/venv"  # inside the userland
WHEELS = "/var/cache/ddnn-wheels"  # inside: every wheel pip fetched, so a reinstall is offline
HOST_CA = "/etc/ssl/certs/ddnn-host-ca.crt"  # inside: the host's CA bundle, for pip
# Host tool → the Debian package that brings it.
HOST_TOOLS = {"debootstrap": "debootstrap", "qemu-aarch64-static": "qemu-user-static",
              "update-binfmts": "binfmt-support", "unshare": "util-linux"}
BINFMT = Path("/proc/sys/fs/binfmt_misc")
PASS_ENV = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


class UserlandError(RuntimeError):
    """A step of building or using the userland failed (not: this machine cannot run one)."""


def _run(argv: Sequence[str], log: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """Run ``argv``; its output goes to ``log`` (appended) when given, else is captured."""
    if log is None:
        return subprocess.run(argv, capture_output=True, text=True, **kw)
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(argv)}\n")
        f.flush()
        return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, text=True, **kw)


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


class Userland:
    """The arm64 userland under ``cache``: built once, then used by :meth:`command`."""

    def __init__(self, cache: Path | str | None = None):
        self.cache = Path(cache or os.environ.get("DDNN_ARM64_CACHE") or CACHE)
        self.root = self.cache / "root"
        self.log = self.cache / "build.log"
        self.stamp = self.root / ".ddnn-userland"

    @property
    def spec(self) -> str:
        """What the cached userland was built from: a different spec rebuilds it."""
        return json.dumps({"suite": SUITE, "mirror": MIRROR, "variant": "minbase",
                           "packages": list(PACKAGES)})

    # --- the host ---------------------------------------------------------------------------

    def host_problem(self, install: bool = True) -> str | None:
        """Why this machine cannot run the userland, or None when it can.

        With ``install``, missing tools are installed with apt-get and binfmt_misc is mounted
        and the qemu-aarch64 handler enabled, as far as this machine allows.
        """
        if os.geteuid() != 0:
            return "needs root (debootstrap, chroot and mounts)"
        missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if not shutil.which(tool)})
        if missing and install:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            ok = shutil.which("apt-get") and _run(["apt-get", "update", "-qq"], env=env
                                                  ).returncode == 0
            ok = ok and _run(["apt-get", "install", "-y", "-qq", *missing], env=env
                             ).returncode == 0
            missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if not shutil.which(tool)})
        if missing:
            return f"{', '.join(missing)} not installed and apt-get could not install them"
        if platform.machine() == "aarch64":
            return None  # the board's own architecture: nothing to emulate
        if not (BINFMT / "status").exists() and install:
            _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
        if not (BINFMT / "status").exists():
            return "binfmt_misc is not mounted and cannot be (a container without the privilege?)"
        if install and not self._binfmt_enabled():
            _run(["update-binfmts", "--enable", "qemu-aarch64"])
        if not self._binfmt_enabled():
            return "the kernel does not run aarch64 programs: update-binfmts --enable " \
                   "qemu-aarch64 did not register qemu"
        return None

    @staticmethod
    def _binfmt() -> dict[str, str]:
        entry = BINFMT / "qemu-aarch64"
        if not entry.exists():
            return {}
        lines = entry.read_text().splitlines()
        fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
        return {"state": lines[0] if lines else "", **fields}

    def _binfmt_enabled(self) -> bool:
        return self._binfmt().get("state") == "enabled"

    # --- building ---------------------------------------------------------------------------

    @property
    def built(self) -> bool:
        return self.stamp.exists() and self.stamp.read_text() == self.spec

    @property
    def installed(self) -> bool:
        """Whether a ddnn with the device extra is installed in the userland's venv."""
        return self.built and (self.root / VENV.lstrip("/") / "bin/ddnn").exists()

    def build(self) -> bool:
        """Make the userland unless the cache holds one of the same spec; True when made now."""
        if self.built:
            return False
        self.cache.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        new = self.cache / "root.new"
        for old in (new, self.root):
            self._remove(old)
        argv = ["debootstrap", "--arch=arm64", "--variant=minbase",
                f"--include={','.join(PACKAGES)}", SUITE, str(new), MIRROR]
        # Each line with the seconds since the start: where a cold build spends its time.
        start = time.monotonic()
        with open(self.log, "a") as log, subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            log.write(f"$ {shlex.join(argv)}\n")
            for line in proc.stdout:
                log.write(f"{time.monotonic() - start:6.1f}s {line}")
        if proc.returncode != 0:
            raise UserlandError(f"debootstrap failed (log: {self.log}):\n{_tail(self.log)}")
        new.rename(self.root)
        self.stamp.write_text(self.spec)  # last: a half-made userland is never taken as built
        return True

    def _remove(self, tree: Path) -> None:
        # Mounts live in each command's own namespace; one left here would be the host's.
        mounts = Path("/proc/self/mounts").read_text().split()
        if any(m.startswith(str(tree) + "/") or m == str(tree) for m in mounts):
            raise UserlandError(f"{tree} has something mounted in it; unmount it first")
        shutil.rmtree(tree, ignore_errors=True)

    def _host_files(self) -> None:
        """Name resolution and the CA bundle of the host (pip inside fetches through them)."""
        shutil.copyfile("/etc/resolv.conf", self.root / "etc/resolv.conf")
        ca = Path("/etc/ssl/certs/ca-certificates.crt")
        if ca.exists():
            shutil.copyfile(ca, self.root / HOST_CA.lstrip("/"))
        fields = self._binfmt()
        interpreter = fields.get("interpreter")
        # Without binfmt's F flag the kernel looks for qemu inside the chroot.
        if interpreter and "F" not in fields.get("flags", ""):
            target = self.root / interpreter.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(interpreter, target)

    def install(self, wheel: Path, requirements: Iterable[str] = ()) -> None:
        """A fresh venv at :data:`VENV` with ``wheel[device]`` and ``requirements``.

        pip installs from the userland's wheelhouse without the network when it has every
        wheel; otherwise it downloads what is missing there first (PyPI's aarch64 wheels).
        """
        self._host_files()
        dist = self.root / "opt/ddnn/dist"
        shutil.rmtree(dist, ignore_errors=True)
        dist.mkdir(parents=True)
        shutil.copy2(wheel, dist / wheel.name)
        shutil.rmtree(self.root / VENV.lstrip("/"), ignore_errors=True)
        # --without-pip: ensurepip would install and byte-compile pip under emulation (~30 s);
        # Debian's pip wheel runs pip itself instead, as a bootstrap.
        self.check(["python3", "-m", "venv", "--without-pip", VENV])
        pip_wheel = sorted((self.root / "usr/share/python-wheels").glob("pip-*.whl"))[-1]
        pip = [f"{VENV}/bin/python", f"/usr/share/python-wheels/{pip_wheel.name}/pip", "-q",
               "--disable-pip-version-check"]
        wanted = [f"/opt/ddnn/dist/{wheel.name}[device]", *requirements]
        offline = [*pip, "install", "--no-compile", "--no-index", "--find-links", WHEELS, *wanted]
        if self.call(offline).returncode != 0:
            self.check([*pip, "download", "--dest", WHEELS, *wanted])
            for own in (self.root / WHEELS.lstrip("/")).glob("ddnn-*.whl"):
                own.unlink()  # the wheel under test comes from dist/, never from here
            self.check(offline)

    # --- running ----------------------------------------------------------------------------

    def command(self, argv: Sequence[str], binds: Iterable[Path | str] = (),
                env: Mapping[str, str] | None = None, cwd: str | None = None) -> list[str]:
        """The host command that runs ``argv`` inside the userland (its pid is ``argv``'s).

        ``binds``: host folders to mount at the same paths inside (read-write). The environment
        inside is a clean one plus ``env`` and the host's proxy variables.
        """
        r = str(self.root)
        q = shlex.quote
        lines = ["set -e", f"mount -t proc proc {q(r + '/proc')}",
                 f"mount --rbind /dev {q(r + '/dev')}", f"mount -t tmpfs tmpfs {q(r + '/tmp')}"]
        for b in binds:
            host = str(Path(b).resolve())
            lines += [f"mkdir -p {q(r + host)}", f"mount --bind {q(host)} {q(r + host)}"]
        variables = {"PATH": f"{VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                     "LANG": "C.UTF-8", "PIP_CERT": HOST_CA,
                     **{k: os.environ[k] for k in PASS_ENV if k in os.environ}, **(env or {})}
        chdir = ["-C", cwd] if cwd else []
        lines.append(f"exec chroot {q(r)} /usr/bin/env -i {shlex.join(chdir)} "
                     f"{' '.join(q(f'{k}={v}') for k, v in variables.items())} \"$@\"")
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines),
                "userland", *argv]

    def call(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside; output appended to the build log."""
        binds, env, cwd = kw.pop("binds", ()), kw.pop("env", None), kw.pop("cwd", None)
        return _run(self.command(argv, binds, env, cwd), self.log, **kw)

    def check(self, argv: Sequence[str], **kw) -> None:
        if self.call(argv, **kw).returncode != 0:
            raise UserlandError(f"in the arm64 userland, {shlex.join(argv)} failed (log: "
                                f"{self.log}):\n{_tail(self.log)}")
