"""The MQTT plumbing's errors, and the refusals no retry can fix."""

from __future__ import annotations

import ssl

from ddnn.errors import DdnnError


class MqttError(DdnnError):
    """The broker cannot be used (bad URL, connection refused for good, timeout)."""


class BrokerRefusedError(MqttError):
    """A refusal that retrying cannot fix: bad credentials, not authorized, or a certificate that
    one side would not accept. The client stops reconnecting and reports it once."""

    exit_code = 78  # EX_CONFIG: systemd units can skip restarting (RestartPreventExitStatus=78)


# CONNACK reason codes (MQTT 5 numbering; paho maps 3.1.1's 4 and 5 onto them) that no retry fixes.
REFUSED_FOR_GOOD = {134: "bad user name or password", 135: "not authorized",
                    133: "client identifier not valid", 138: "banned"}
UNSUPPORTED_PROTOCOL = 132  # CONNACK reason code (paho maps 3.1.1's 1 onto it)


def ssl_reason(error: BaseException | str) -> str:
    """``certificate expired`` from ``[SSL: SSLV3_ALERT_CERTIFICATE_EXPIRED] sslv3 alert ...``."""
    if isinstance(error, ssl.SSLError) and error.reason:
        return error.reason.lower().replace("_", " ")
    text = str(error)
    if "]" in text:
        text = text.split("]", 1)[1].split("(_ssl.c", 1)[0]
    return text.strip(" :") or str(error)
