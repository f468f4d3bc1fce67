"""Who may call what on the cloud: the bearer token's role and the client certificate's role.

Routes fall in three kinds:

* the health checks (``/v2/health/live``, ``/v2/health/ready``): open, for orchestrators'
  probes (under mutual TLS a client still needs a certificate of the CA to reach HTTP at all);
* bundle downloads (``GET /v1/bundles/...``, over-the-air updates): an edge or a device;
* everything else — inference, model metadata, the repository, ``/metrics``, the OpenAPI page:
  an edge.

A request's roles come from its bearer token (``--token``: the edges' token, role ``edge``;
``--download-token``: the devices' read-only token, role ``device``) and, under mutual TLS, from
its client certificate: the ``OU`` of its subject, which ``deploy/make-certs.sh`` sets to the
identity's role (``edge``, ``device``, ``operator``). Each that is configured must allow the
route: a missing or unknown token is ``401``; a token or certificate whose role may not call
the route is ``403`` (a device's certificate with the edge's token cannot infer: the token may
have leaked, the certificate says who holds it). Every refusal is counted and logged (one line
per reason per 10 s).
"""

from __future__ import annotations

import hmac
import logging

from ddnn.cloud.settings import CloudSettings
from ddnn.oip import JSON_TYPE, error_body
from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger("ddnn.cloud.app")  # where operators already look for refusals

EDGE, DEVICE = "edge", "device"
# Health checks stay open with a token set: orchestrators probe them without credentials.
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
DOWNLOADS = "/v1/bundles/"


def roles_allowed(scope) -> frozenset[str] | None:
    """The roles that may call the route of ``scope``; None: anyone (a health check)."""
    path = scope["path"]
    if path in OPEN_PATHS:
        return None
    if scope.get("method") == "GET" and path.startswith(DOWNLOADS):
        return frozenset({EDGE, DEVICE})
    return frozenset({EDGE})


def certificate_role(scope) -> str | None:
    """The role (``OU``) in the subject of the client certificate, from the ASGI TLS
    extension's ``client_cert_name`` (RFC 4514); None without one, or without an ``OU``."""
    name = ((scope.get("extensions") or {}).get("tls") or {}).get("client_cert_name")
    if not name:
        return None
    units = [value for key, value in rdns(name) if key.upper() == "OU"]
    return units[0] if len(units) == 1 else None  # two OUs: no one role


def rdns(name: str) -> list[tuple[str, str]]:
    """``[(type, value)]`` of an RFC 4514 name as :func:`ddnn.cloud.protocol.rfc4514` writes it
    (a backslash escapes the next character)."""
    out, part, escaped = [], [], False
    for ch in name + ",":
        if escaped:
            part.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in ",+":
            key, _, value = "".join(part).partition("=")
            out.append((key.strip(), value))
            part = []
        else:
            part.append(ch)
    return out


def _reply(status: int, message: str):
    headers = [(b"content-type", JSON_TYPE.encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="ddnn"'))
    body = error_body(message)
    headers.append((b"content-length", str(len(body)).encode()))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body})


class Access:
    """ASGI middleware enforcing the module's rules; ``on_refuse(status)`` counts a refusal."""

    def __init__(self, app, settings: CloudSettings, on_refuse):
        self.app = app
        self.tokens = {}  # "Bearer TOKEN" -> role
        if settings.token:
            self.tokens[f"Bearer {settings.token}".encode()] = EDGE
        if settings.download_token:
            self.tokens[f"Bearer {settings.download_token}".encode()] = DEVICE
        self.check_certificates = bool(settings.ssl_ca_certs and settings.ssl_client_roles)
        self.on_refuse = on_refuse
        self._warned = LogThrottle(period=10.0)

    def _token_role(self, given: bytes) -> str | None:
        role = None
        for expected, r in self.tokens.items():  # every one compared: no timing oracle
            if hmac.compare_digest(given, expected):
                role = r
        return role

    def refusal(self, scope) -> tuple[int, str] | None:
        """``(status, why)`` when the request may not call its route, else None."""
        allowed = roles_allowed(scope)
        if allowed is None:
            return None
        if self.tokens:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            role = self._token_role(given)
            if role is None:
                return 401, "missing bearer token" if not given else "invalid bearer token"
            if role not in allowed:
                return 403, f"the {role}s' token may not call this route"
        if self.check_certificates and ((scope.get("extensions") or {}).get("tls") or {}).get(
                "client_cert_name") is not None:
            role = certificate_role(scope)
            if role not in allowed:
                return 403, (f"a client certificate of role {role!r} may not call this route "
                             f"(needs OU={' or OU='.join(sorted(allowed))})")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (refused := self.refusal(scope)) is None:
            return await self.app(scope, receive, send)
        status, why = refused
        self.on_refuse(status)
        if n := self._warned(why):
            client = (scope.get("client") or ("?",))[0]
            log.warning("refused %s %s from %s: %s%s", scope.get("method", "?"),
                        scope["path"][:100], client, why,
                        f" ({n} like it since the last line)" if n > 1 else "")
        for message in _reply(status, why):
            await send(message)
