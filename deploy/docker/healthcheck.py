#!/usr/bin/env python3
"""HEALTHCHECK of the ddnn images (standard library only): exit 0 when the service answers.

    healthcheck.py cloud   GET /v2/health/ready on DDNN_CLOUD_PORT (default 8000); HTTPS
                           when DDNN_CLOUD_SSL_CERTFILE is set. Under mutual TLS
                           (DDNN_CLOUD_SSL_CA_CERTS) the probe presents
                           DDNN_HEALTHCHECK_CERT_FILE and DDNN_HEALTHCHECK_KEY_FILE (a client
                           certificate of the deployment's CA).
    healthcheck.py edge    GET /livez on DDNN_EDGE_HTTP_PORT (liveness: a broker outage must
                           not restart the edge); a container without that variable (a
                           device agent: no HTTP server, its liveness is its retained MQTT
                           status) has nothing to probe: healthy while it runs.

The probe goes to the container's own loopback, so the server's certificate (issued for its
public name) is not checked against a host name; the service's own clients always check it.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT = 4.0


def _host(bound: str | None) -> str:
    return "127.0.0.1" if bound in (None, "", "0.0.0.0", "::") else bound


def target(role: str, env: dict[str, str]) -> tuple[str, ssl.SSLContext | None] | None:
    """The URL to probe and its TLS context, or None when there is nothing to probe."""
    if role == "cloud":
        port = env.get("DDNN_CLOUD_PORT", "8000")
        host = _host(env.get("DDNN_CLOUD_HOST"))
        if not env.get("DDNN_CLOUD_SSL_CERTFILE"):
            return f"http://{host}:{port}/v2/health/ready", None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if env.get("DDNN_HEALTHCHECK_CERT_FILE"):
            ctx.load_cert_chain(env["DDNN_HEALTHCHECK_CERT_FILE"],
                                env.get("DDNN_HEALTHCHECK_KEY_FILE") or None)
        return f"https://{host}:{port}/v2/health/ready", ctx
    if role == "edge":
        port = env.get("DDNN_EDGE_HTTP_PORT")
        if not port:
            return None
        return f"http://{_host(env.get('DDNN_EDGE_HTTP_HOST'))}:{port}/livez", None
    raise SystemExit(f"usage: healthcheck.py cloud|edge (got {role!r})")


def main(argv: list[str]) -> int:
    probe = target(argv[1] if len(argv) > 1 else "", dict(os.environ))
    if probe is None:
        return 0
    url, ctx = probe
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT, context=ctx) as r:
            status = r.status
    except urllib.error.HTTPError as e:  # 503: not ready yet
        status = e.code
    except OSError as e:  # refused, timed out, TLS refused (URLError is an OSError)
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url}: status {status}", file=sys.stderr)
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
