"""Who may post to the edge's HTTP routes, and for which device.

``--http-tokens FILE`` gives every device its own bearer token: one line per device,
``DEVICE_ID TOKEN`` (blank lines and lines starting with ``#`` are skipped). A request's token
names the one device it speaks for, and the edge takes from it only that device's envelopes and
results, as the broker's ACL takes a device's messages only on its own topics. ``--http-token``
is one token for every device: whoever holds it may post as any of them.

Tokens are compared in constant time, against every entry (the time taken does not depend on
which one matched); no error message, log line or ``repr`` shows one.
"""

from __future__ import annotations

import hmac
import logging
import stat
from collections.abc import Iterable
from pathlib import Path

from ddnn.errors import ConfigError
from ddnn.names import RULE, is_name

log = logging.getLogger(__name__)

MIN_TOKEN = 16  # characters a per-device token needs at least (e.g. `openssl rand -hex 16`)
ANY_DEVICE = "*"  # a request that may speak for every device (the shared token, or no token)


def load_http_tokens(path: Path, devices: Iterable[str]) -> dict[str, str]:
    """The ``{device id: token}`` of a ``--http-tokens`` file, for this edge's ``devices``.

    Refuses (:class:`ConfigError`, never showing a token) an unreadable file, a line that is
    not ``DEVICE_ID TOKEN``, a device that is not one of ``devices`` or is listed twice, a token
    shorter than :data:`MIN_TOKEN` characters or given to two devices.
    """
    where = f"--http-tokens {path}"
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    known = list(devices)
    tokens: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:  # (the line itself is never shown: it may hold a token)
            raise ConfigError(f"{where}, line {n}: expected 'DEVICE_ID TOKEN' (two fields)")
        device, token = fields
        if not is_name(device):
            raise ConfigError(f"{where}, line {n}: the first field is not a device id ({RULE})")
        if device not in known:
            raise ConfigError(f"{where}, line {n}: device {device!r} is not one of this edge's "
                              f"devices ({','.join(known)})")
        if device in tokens:
            raise ConfigError(f"{where}, line {n}: device {device!r} is listed twice")
        if len(token) < MIN_TOKEN:
            raise ConfigError(f"{where}, line {n}: the token of {device!r} is shorter than "
                              f"{MIN_TOKEN} characters")
        if token in tokens.values():
            raise ConfigError(f"{where}, line {n}: {device!r} has the token of another device; "
                              "every device needs its own")
        tokens[device] = token
    if not tokens:
        raise ConfigError(f"{where}: no 'DEVICE_ID TOKEN' line")
    if stat.S_IMODE(mode) & 0o077:
        log.warning("%s can be read by other users (mode %o): chmod 600 it", where,
                    stat.S_IMODE(mode))
    return tokens


class HttpCredentials:
    """What a request's ``Authorization`` header may post as.

    ``shared``: the one token of ``--http-token`` (speaks for every device); ``devices``: the
    per-device tokens of ``--http-tokens``. Neither: no token is needed (anyone speaks for
    every device).
    """

    def __init__(self, shared: str | None = None, devices: dict[str, str] | None = None):
        self._shared = f"Bearer {shared}".encode() if shared else None
        self._devices = [(f"Bearer {token}".encode(), device)
                         for device, token in (devices or {}).items()]
        self.required = self._shared is not None or bool(self._devices)
        if shared:
            log.warning("--http-token is one token for every device: whoever holds it may post "
                        "as any device; --http-tokens gives each device its own")

    def __repr__(self) -> str:  # never the tokens
        return (f"HttpCredentials(shared={self._shared is not None}, "
                f"devices={[d for _, d in self._devices]})")

    def identify(self, authorization: bytes) -> str | None:
        """The device id the header speaks for, :data:`ANY_DEVICE`, or None (refused)."""
        if not self.required:
            return ANY_DEVICE
        who = None
        if self._shared is not None and hmac.compare_digest(authorization, self._shared):
            who = ANY_DEVICE
        for expected, device in self._devices:  # every entry, whichever matches
            if hmac.compare_digest(authorization, expected):
                who = device
        return who
