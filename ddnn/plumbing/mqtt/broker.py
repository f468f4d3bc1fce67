"""Where the broker is and how to trust it: the broker URL, TLS files and credentials."""

from __future__ import annotations

import ssl
import urllib.parse
from dataclasses import dataclass, field

from ddnn.errors import ConfigError
from ddnn.plumbing.options import Option


@dataclass(frozen=True)
class BrokerUrl:
    """``mqtt://[user[:password]@]host[:port]`` (``mqtts://`` for TLS, port 8883 by default)."""

    host: str
    port: int = 1883
    tls: bool = False
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> BrokerUrl:
        u = urllib.parse.urlsplit(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ConfigError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://")
        tls = u.scheme in ("mqtts", "ssl")
        try:
            port = u.port or (8883 if tls else 1883)
        except ValueError:
            raise ConfigError(f"broker URL {url!r}: invalid port") from None
        if not u.hostname:
            raise ConfigError(f"broker URL {url!r}: no host")
        user = urllib.parse.unquote(u.username) if u.username else None
        pw = urllib.parse.unquote(u.password) if u.password else None
        return cls(u.hostname, port, tls, user, pw)

    def __str__(self) -> str:  # never log the password
        scheme = "mqtts" if self.tls else "mqtt"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{self.host}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class MqttSecurity:
    """TLS files and credentials; each overrides what the broker URL says.

    TLS needs an ``mqtts://`` URL. The broker's certificate is always verified (chain and host
    name) against ``ca_file``, or the system's CAs without it; there is no insecure mode.
    """

    ca_file: str | None = None  # CA certificate(s) the broker's certificate must chain to
    cert_file: str | None = None  # this client's certificate (PEM), for brokers requiring one
    key_file: str | None = None  # its private key (PEM); default: inside cert_file
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never printed

    def describe(self) -> str:
        """For start-up logs: which files and user, never the password."""
        parts = [f"{k}={v}" for k, v in (("ca", self.ca_file), ("cert", self.cert_file),
                                          ("user", self.username)) if v]
        if self.password:
            parts.append("password=***")
        return " ".join(parts) or "none"

    def credentials(self, url: BrokerUrl) -> tuple[str | None, str | None]:
        """``(username, password)``: these settings over the URL's."""
        username = self.username if self.username is not None else url.username
        password = self.password if self.password is not None else url.password
        if password and not username:
            raise ConfigError("an MQTT password needs a username (--username)")
        return username, password

    def check(self, url: BrokerUrl) -> None:
        """Refuse TLS files without a TLS URL, and a key without its certificate."""
        if self.key_file and not self.cert_file:
            raise ConfigError("--key-file needs --cert-file")
        if (self.ca_file or self.cert_file) and not url.tls:
            raise ConfigError(f"TLS files are set but the broker URL {url} is not TLS: "
                              "use mqtts://host:8883")


class _ClosingSSLSocket(ssl.SSLSocket):
    """Closes itself when the handshake fails: paho leaves the socket open, for the collector."""

    def do_handshake(self, *args, **kwargs):
        try:
            return super().do_handshake(*args, **kwargs)
        except BaseException:
            self.close()
            raise


def tls_context(security: MqttSecurity) -> ssl.SSLContext:
    """A client TLS context verifying the broker against ``ca_file`` (or the system CAs)."""
    try:
        ctx = ssl.create_default_context(cafile=security.ca_file)
        ctx.sslsocket_class = _ClosingSSLSocket
        if security.cert_file:
            ctx.load_cert_chain(security.cert_file, security.key_file)
    except (OSError, ssl.SSLError) as e:  # FileNotFoundError, a PEM that does not parse
        which = ", ".join(f for f in (security.ca_file, security.cert_file, security.key_file)
                          if f)
        raise ConfigError(f"cannot load the MQTT TLS files ({which}): {e}") from None
    return ctx


# The rows of MqttSecurity in the options tables of the device, the gateway, the edge and
# ``ddnn announce`` (an option group: each nests it in its settings' ``security``).
SECURITY_OPTIONS = (
    Option("ca-file", str, "FILE",
           "CA certificate (PEM) the broker's certificate must chain to (needs mqtts://)"),
    Option("cert-file", str, "FILE", "client certificate (PEM) for brokers that require one"),
    Option("key-file", str, "FILE", "private key (PEM) of --cert-file"),
    Option("username", str, "NAME", "MQTT username (overrides the URL's)"),
    Option("password", str, "TEXT", "MQTT password; prefer the environment variable (never "
                                    "logged)", secret=True),
)

