"""The device agent's settings: one typed, frozen object from flags or ``DDNN_DEVICE_*``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddnn.errors import ConfigError
from ddnn.names import check_name
from ddnn.plumbing.health import MonitorHttp
from ddnn.plumbing.mqtt import SECURITY_OPTIONS, BrokerUrl, MqttSecurity
from ddnn.plumbing.options import Option, bind, boolean, describe, grouped, id_list, path
from ddnn.plumbing.ota_settings import (
    BUNDLE_KEY_OPTION,
    SOURCE_OPTIONS,
    UPDATE_OPTIONS,
    UpdatePolicy,
    UpdateSource,
)

ENV_PREFIX = "DDNN_DEVICE_"
MODES = ("pull", "push")


def after_send_mode(value: str) -> tuple[str, Path | None]:
    """``keep``/``delete`` or ``archive:DIR`` as (mode, archive folder)."""
    if value in ("keep", "delete"):
        return value, None
    if value.startswith("archive:") and value[len("archive:"):].strip():
        return "archive", Path(value[len("archive:"):])
    raise ConfigError(f"--after-send must be keep, delete or archive:DIR, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class DeviceSettings:
    """Everything ``ddnn device`` can be told; every field is a flag and an environment variable.

    What depends on the bundle (the view's range, the default peers, push mode on the HTTP
    fallback) is checked and filled in by :meth:`DeviceService.from_settings
    <ddnn.device.service.DeviceService.from_settings>`. Option groups (``security``,
    ``updates``, ``update_source``, ``http``) keep their flat names as flags and variables, and
    in code too (:func:`ddnn.plumbing.options.bind`: ``DeviceSettings(ota_origin=...)``).
    """

    bundle: Path  # the bundle directory (from ddnn train)
    view: int  # which of the bundle's device segments (camera positions) this device runs
    broker: str | None = None  # MQTT broker URL; without it, HTTP POSTs to edge_url
    security: MqttSecurity = MqttSecurity()  # MQTT TLS and credentials
    bundle_key: Path | None = None  # Ed25519 public key: run only bundles signed by it
    updates: UpdatePolicy = UpdatePolicy(probation=60.0)  # which over-the-air versions apply
    update_source: UpdateSource = UpdateSource()  # where over-the-air bundles come from
    edge_url: str | None = None  # the HTTP fallback: the edge's http://host:port
    token: str | None = None  # bearer token for the HTTP fallback
    device_id: str | None = None  # the id in topics and messages; None: cam0, cam1, ... by view
    deployment: str = "default"  # deployments sharing a broker are kept apart by topic
    edge_id: str = "edge0"  # whose feature pulls to answer
    topic_prefix: str = "ddnn"
    mode: str = "pull"  # "pull": features on request; "push": features with every score
    data: Path | None = None  # frame sources: exactly one of data, images, camera
    images: Path | None = None
    camera: int | None = None
    follow: bool = False  # --images: keep watching the folder for new images, in name order
    after_send: str = "keep"  # --images: keep, delete or archive:DIR each image once sent
    camera_retries: int = 10  # failed camera reopenings in a row before giving up; 0: never
    camera_retry_max: float = 30.0  # longest wait between camera reopenings, seconds
    fps: float = 10.0  # frames per second to replay at; 0: as fast as the device can
    limit: int | None = None  # stop after this many frames
    start: int = 0  # first frame index of a replay
    buffer: int = 10_000  # messages held while the uplink is away; the oldest dropped when full
    spool: Path | None = None  # keep the outbox on disk too, so a restart loses nothing
    spool_sync_every: int = 64  # fsync the spool after this many messages ...
    spool_sync_ms: float = 200.0  # ... or when the oldest unsynced one is this old
    keep: int = 1024  # frames whose features are kept for pulls (covers a broker outage)
    grace: float = 2.0  # seconds to keep answering pulls after the last frame
    drain_timeout: float = 60.0  # longest wait to deliver the outbox after the last frame
    local_threshold: float | None = None  # one-view bundles: override the local exit threshold
    keepalive: int = 10  # MQTT keepalive seconds; the broker declares us offline after 1.5x
    reconnect_max: int = 30  # cap of the reconnection backoff, seconds
    wait_peers: float = 30.0  # replays: seconds to wait for the edge and the peers; 0: do not
    peers: tuple[str, ...] = ()  # devices to wait for; empty: every view's default id
    start_at: float | None = None  # Unix time of the first frame: cameras triggered together
    threads: int = 1  # ONNX Runtime intra-op threads
    http: MonitorHttp = MonitorHttp()  # the device's own HTTP server (/metrics, /healthz)
    health_grace: float = 60.0  # seconds the broker may be unreachable before /healthz fails
    stall_after: float = 60.0  # seconds without a frame from the source before /healthz fails

    def __post_init__(self) -> None:
        if self.view < 0:
            raise ConfigError(f"view must not be negative, got {self.view}")
        if self.device_id is None:
            object.__setattr__(self, "device_id", f"cam{self.view}")
        check_name("device id", self.device_id)
        check_name("deployment", self.deployment)
        check_name("edge id", self.edge_id)
        for part in self.topic_prefix.split("/"):
            check_name("topic prefix", part)
        object.__setattr__(self, "peers", tuple(check_name("peer device id", p)
                                                for p in self.peers))
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        sources = [f"--{n}" for n in ("data", "images", "camera") if getattr(self, n) is not None]
        if len(sources) != 1:
            raise ConfigError("give exactly one frame source: --data, --images or --camera"
                              + (f" (got {', '.join(sources)})" if sources else ""))
        if not self.broker and not self.edge_url:
            raise ConfigError("give --broker (MQTT) or --edge-url (HTTP fallback)")
        if self.broker:
            BrokerUrl.parse(self.broker)  # a bad URL fails here, not in the transport
        if not Path(self.bundle).is_dir():
            raise ConfigError(f"bundle {self.bundle}: no such directory")
        if self.bundle_key is not None and not Path(self.bundle_key).is_file():
            raise ConfigError(f"bundle key {self.bundle_key}: no such file")
        if self.token is not None and not self.token.strip():
            raise ConfigError("the bearer token must not be empty")
        if self.after_send != "keep" and self.images is None:
            raise ConfigError("--after-send applies to --images only")
        if self.follow and self.images is None:
            raise ConfigError("--follow applies to --images only")
        after_send_mode(self.after_send)
        src = self.update_source
        if (src.token or src.ca_file) and src.origin is None:
            raise ConfigError("--ota-token and --ota-ca-file need --ota-origin (a token is "
                              "sent to that origin only)")
        self._check_numbers()

    def _check_numbers(self) -> None:
        at_least = {"buffer": 1, "keep": 1, "threads": 1, "reconnect_max": 1, "start": 0,
                    "keepalive": 0, "fps": 0, "grace": 0, "wait_peers": 0,
                    "spool_sync_every": 1, "spool_sync_ms": 0, "camera_retries": 0,
                    "camera_retry_max": 0.1, "health_grace": 0, "stall_after": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ConfigError(f"{name} must be at least {low}, got {getattr(self, name)}")
        for name in ("limit", "camera", "start_at"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.keepalive > 65535:  # a 16-bit field of MQTT's CONNECT
            raise ConfigError(f"keepalive must be at most 65535 seconds, got {self.keepalive}")
        if self.drain_timeout <= 0:
            raise ConfigError(f"drain_timeout must be above 0, got {self.drain_timeout}")
        if self.local_threshold is not None and not 0 <= self.local_threshold <= 1:
            raise ConfigError(f"local_threshold must be in 0..1, got {self.local_threshold}")

    def describe(self) -> dict:
        """The resolved settings for the start-up log: secrets masked, the broker's password
        left out of its URL."""
        out = describe(self, OPTIONS)
        if self.broker:
            out["broker"] = str(BrokerUrl.parse(self.broker))
        return out


# The options table: one row per field above (its default is the field's default).
OPTIONS = (
    Option("bundle", path, "DIR", "bundle directory (from ddnn train)"),
    Option("view", int, "I", "which view (camera position) of the bundle this device is: 0..V-1"),
    Option("broker", str, "URL", "MQTT broker URL, mqtt://[user:pass@]host:port (mqtts:// for "
                                 "TLS); a password in it is never logged"),
    *grouped("security", SECURITY_OPTIONS),
    BUNDLE_KEY_OPTION,
    *grouped("updates", UPDATE_OPTIONS),
    *grouped("update_source", SOURCE_OPTIONS),
    Option("edge-url", str, "URL",
           "HTTP fallback when no --broker: the edge's http://host:port (push mode only)"),
    Option("token", str, "TOKEN", "bearer token for the HTTP fallback", secret=True),
    Option("device-id", str, "ID",
           "this device's id in topics and messages (unset: cam0, cam1, ... by view)"),
    Option("deployment", str, "NAME",
           "deployment name: the topic level that separates deployments sharing a broker"),
    Option("edge-id", str, "ID", "the edge whose pulls to answer"),
    Option("topic-prefix", str, "PREFIX", "first topic level(s)"),
    Option("mode", str, "MODE", "pull: features on request (fewer bytes); push: with every "
                                "frame (fewer round trips)", choices=MODES),
    Option("data", path, "NPZ", "replay this view of a dataset .npz; frames are numbered by index",
           group="source"),
    Option("images", path, "DIR", "folder of PNG/PPM/JPEG images, read in name order",
           group="source"),
    Option("camera", int, "INDEX", "camera index through OpenCV (optional dependency)",
           group="source"),
    Option("follow", boolean, "BOOL",
           "with --images: keep watching the folder (a capture tool fills it) and send new "
           "images in name order as they appear, instead of stopping at the end"),
    Option("after-send", str, "WHAT",
           "with --images: what to do with an image once its messages are queued: keep, "
           "delete, or archive:DIR (moved there)"),
    Option("camera-retries", int, "N",
           "failed camera reopenings in a row before the agent gives up and exits with an "
           "error (for systemd to restart it); 0: retry forever"),
    Option("camera-retry-max", float, "S",
           "longest wait in seconds between camera reopenings (exponential backoff from 0.5 s)"),
    Option("fps", float, "F", "frames per second to send; 0 = as fast as possible"),
    Option("limit", int, "N", "stop after this many frames"),
    Option("start", int, "N", "first frame index of a replay"),
    Option("buffer", int, "N",
           "messages held while the broker is unreachable; the oldest is dropped when full"),
    Option("spool", path, "DIR",
           "directory to keep the outbox on disk until the broker acknowledged each message, "
           "so a crash or restart loses nothing (delivery at least once)"),
    Option("spool-sync-every", int, "N",
           "fsync the spool after this many new messages (1: every message)"),
    Option("spool-sync-ms", float, "MS",
           "... or once the oldest unsynced message is this many milliseconds old: what a "
           "power cut may lose"),
    Option("keep", int, "N", "recent frames whose features are kept for the edge's pulls"),
    Option("grace", float, "S", "seconds to keep answering pulls after the last frame of a replay"),
    Option("drain-timeout", float, "S",
           "longest wait in seconds to deliver what is queued after the last frame"),
    Option("local-threshold", float, "T",
           "one-view bundles: override the local exit threshold (0..1)"),
    Option("keepalive", int, "S",
           "MQTT keepalive seconds; the broker declares the device offline after 1.5x"),
    Option("reconnect-max", int, "S",
           "longest wait in seconds between reconnection attempts (exponential backoff)"),
    Option("wait-peers", float, "S",
           "replays: wait up to this many seconds for the edge and --peers to be online, then "
           "start together with them (at the moment the last came online, plus a second); "
           "0: start at once"),
    Option("peers", id_list, "IDS",
           "comma-separated device ids for --wait-peers (unset: every view's default id)"),
    Option("start-at", float, "T",
           "Unix time of the first frame, to trigger several replaying devices together"),
    Option("threads", int, "N", "ONNX Runtime threads"),
    *grouped("http", (
        Option("http-host", str, "ADDR", "address of the device's HTTP server", key="host"),
        Option("http-port", int, "PORT",
               "port of the device's HTTP server (/metrics, /healthz, /livez); unset: none",
               key="port"))),
    Option("health-grace", float, "S",
           "seconds the broker may be unreachable before /healthz answers 503"),
    Option("stall-after", float, "S",
           "seconds without a frame from the source (while it should produce) before /healthz "
           "answers 503"),
)
bind(DeviceSettings, OPTIONS)
