"""The device agent's settings: one typed, frozen object from flags or ``DDNN_DEVICE_*``.

Grouped by concern: what the device runs (bundle, view), where its frames come from
(:class:`FrameSource`), how it reaches the edge (MQTT, or :class:`HttpUplink`), what it holds
while the uplink is away (:class:`OutboxPolicy`), how a replay starts and ends
(:class:`ReplayTiming`), over-the-air updates and its own monitoring. Every group's rows keep
their flat names as flags, variables and attributes (:func:`ddnn.plumbing.options.bind`), and
``ddnn device --help`` lists them under the same headings.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from ddnn.errors import ConfigError
from ddnn.names import check_name
from ddnn.plumbing.health import MonitorHttp
from ddnn.plumbing.mqtt import CONNECT_TIMEOUT_OPTION, SECURITY_OPTIONS, BrokerUrl, MqttSecurity
from ddnn.plumbing.options import (
    Option,
    bind,
    boolean,
    describe,
    grouped,
    id_list,
    path,
    section,
)
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


def _at_least(group: object, bounds: dict[str, float]) -> None:
    for name, low in bounds.items():
        if getattr(group, name) < low:
            raise ConfigError(f"{name} must be at least {low}, got {getattr(group, name)}")


@dataclass(frozen=True, kw_only=True)
class FrameSource:
    """Where the frames come from (exactly one of data, images, camera: checked by
    :class:`DeviceSettings`, whose default has none) and at what pace."""

    data: Path | None = None  # a dataset .npz replayed by index
    images: Path | None = None  # a folder of images, in name order
    camera: int | None = None  # an OpenCV camera index
    follow: bool = False  # --images: keep watching the folder for new images, in name order
    after_send: str = "keep"  # --images: keep, delete or archive:DIR each image once sent
    camera_retries: int = 10  # failed camera reopenings in a row before giving up; 0: never
    camera_retry_max: float = 30.0  # longest wait between camera reopenings, seconds
    fps: float = 10.0  # frames per second to replay at; 0: as fast as the device can
    limit: int | None = None  # stop after this many frames
    start: int = 0  # first frame index of a replay

    def __post_init__(self) -> None:
        if self.after_send != "keep" and self.images is None:
            raise ConfigError("--after-send applies to --images only")
        if self.follow and self.images is None:
            raise ConfigError("--follow applies to --images only")
        after_send_mode(self.after_send)
        _at_least(self, {"camera_retries": 0, "camera_retry_max": 0.1, "fps": 0, "start": 0})
        for name in ("limit", "camera"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")

    @property
    def given(self) -> list[str]:
        """The source flags given (one, in valid settings)."""
        return [f"--{n}" for n in ("data", "images", "camera") if getattr(self, n) is not None]


@dataclass(frozen=True, kw_only=True)
class HttpUplink:
    """The edge's HTTP ingest: the uplink without a broker, or its failover while the broker
    is unreachable. Its options without an ``edge_url`` would be ignored, so they are refused."""

    edge_url: str | None = None  # http(s)://host:port of the edge's ingest
    token: str | None = None  # bearer token for the HTTP path
    edge_ca_file: Path | None = None  # CA that signed the edge's HTTPS certificate
    failover_after: float = 30.0  # seconds without the broker before the HTTP path takes over

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise ConfigError("the bearer token must not be empty")
        _at_least(self, {"failover_after": 0.1})
        if self.edge_url is None:
            unused = [f for f, v in (("--token", self.token), ("--edge-ca-file",
                                                                 self.edge_ca_file)) if v]
            if unused:
                raise ConfigError(f"{' and '.join(unused)}: used on the HTTP path only, "
                                  "which needs --edge-url")
            return
        u = urllib.parse.urlsplit(self.edge_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"--edge-url {self.edge_url!r} must be http(s)://host[:port]")
        if self.edge_ca_file is not None:
            if u.scheme != "https":
                raise ConfigError("--edge-ca-file needs an https:// --edge-url")
            if not Path(self.edge_ca_file).is_file():
                raise ConfigError(f"edge CA file {self.edge_ca_file}: no such file")


@dataclass(frozen=True, kw_only=True)
class OutboxPolicy:
    """What the device holds while the uplink is away, and how it keeps it on disk."""

    buffer: int = 10_000  # messages held while the uplink is away; the oldest dropped when full
    buffer_mb: float = 64.0  # the outbox's bound in MiB (memory and spool)
    spool: Path | None = None  # the on-disk outbox; None: the default place (spool_run.py)
    no_spool: bool = False  # keep the outbox in memory only
    spool_sync_every: int = 64  # fsync the spool after this many messages ...
    spool_sync_ms: float = 200.0  # ... or when the oldest unsynced one is this old

    def __post_init__(self) -> None:
        if self.no_spool and self.spool is not None:
            raise ConfigError("--spool and --no-spool exclude each other")
        _at_least(self, {"buffer": 1, "buffer_mb": 0.01, "spool_sync_every": 1,
                         "spool_sync_ms": 0})


@dataclass(frozen=True, kw_only=True)
class ReplayTiming:
    """How a replay starts (together with its peers), how far behind its schedule it may fall,
    and how long it lingers at its end."""

    wait_peers: float = 30.0  # seconds to wait for the edge and the peers; 0: do not
    peers: tuple[str, ...] = ()  # devices to wait for; empty: every view's default id
    start_at: float | None = None  # Unix time of the first frame: cameras triggered together
    grace: float = 2.0  # seconds to keep answering pulls after the last frame
    drain_timeout: float = 60.0  # longest wait to deliver the outbox after the last frame
    # How late (ms) a frame may start before it is skipped (said so to the edge): a device
    # slower than its --fps stays this close to the present instead of falling behind without
    # bound; at least one frame period; 0: never skip (a replay that must deliver every frame).
    # Half the edge's default latency budget (--max-wait-ms 1000): its views are still fused.
    max_lag_ms: float = 500.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", tuple(check_name("peer device id", p)
                                                for p in self.peers))
        _at_least(self, {"wait_peers": 0, "grace": 0, "max_lag_ms": 0})
        if self.start_at is not None and self.start_at < 0:
            raise ConfigError(f"start_at must not be negative, got {self.start_at}")
        if self.drain_timeout <= 0:
            raise ConfigError(f"drain_timeout must be above 0, got {self.drain_timeout}")


@dataclass(frozen=True, kw_only=True)
class DeviceSettings:
    """Everything ``ddnn device`` can be told; every field is a flag and an environment variable.

    What depends on the bundle (the view's range, the default peers, push mode on the HTTP
    fallback) is checked and filled in by :meth:`DeviceService.from_settings
    <ddnn.device.service.DeviceService.from_settings>`. Option groups (``source``,
    ``http_uplink``, ``outbox``, ``replay``, ``security``, ``updates``, ``update_source``,
    ``http``) keep their flat names as flags and variables, and in code too
    (:func:`ddnn.plumbing.options.bind`: ``DeviceSettings(fps=5).fps``).
    """

    # what the device runs
    bundle: Path  # the bundle directory (from ddnn train)
    view: int  # which of the bundle's device segments (camera positions) this device runs
    bundle_key: Path | None = None  # Ed25519 public key: run only bundles signed by it
    threads: int = 1  # ONNX Runtime intra-op threads
    local_threshold: float | None = None  # one-view bundles: override the local exit threshold
    source: FrameSource = FrameSource()
    # the MQTT uplink, and who the device is on it
    broker: str | None = None  # MQTT broker URL; without it, HTTP POSTs to edge_url
    security: MqttSecurity = MqttSecurity()  # MQTT TLS and credentials
    keepalive: int = 10  # MQTT keepalive seconds; the broker declares us offline after 1.5x
    reconnect_max: int = 30  # cap of the reconnection backoff, seconds
    connect_timeout: float = 10.0  # seconds for TCP, TLS and the CONNACK, each
    device_id: str | None = None  # the id in topics and messages; None: cam0, cam1, ... by view
    deployment: str = "default"  # deployments sharing a broker are kept apart by topic
    edge_id: str = "edge0"  # whose feature pulls to answer
    topic_prefix: str = "ddnn"
    mode: str = "pull"  # "pull": features on request; "push": features with every score
    keep: int = 1024  # frames whose features are kept for pulls (covers a broker outage)
    http_uplink: HttpUplink = HttpUplink()
    outbox: OutboxPolicy = OutboxPolicy()
    replay: ReplayTiming = ReplayTiming()
    updates: UpdatePolicy = UpdatePolicy(probation=60.0)  # which over-the-air versions apply
    update_source: UpdateSource = UpdateSource()  # where over-the-air bundles come from
    # its own monitoring
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
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        sources = self.source.given
        if len(sources) != 1:
            raise ConfigError("give exactly one frame source: --data, --images or --camera"
                              + (f" (got {', '.join(sources)})" if sources else ""))
        if not self.broker and not self.http_uplink.edge_url:
            raise ConfigError("give --broker (MQTT) or --edge-url (HTTP fallback)")
        if self.broker:
            BrokerUrl.parse(self.broker)  # a bad URL fails here, not in the transport
        if not Path(self.bundle).is_dir():
            raise ConfigError(f"bundle {self.bundle}: no such directory")
        if self.bundle_key is not None and not Path(self.bundle_key).is_file():
            raise ConfigError(f"bundle key {self.bundle_key}: no such file")
        src = self.update_source
        if (src.token or src.ca_file or src.cert_file) and src.origin is None:
            raise ConfigError("--ota-token, --ota-ca-file and --ota-cert-file need --ota-origin "
                              "(a token and a certificate go to that origin only)")
        self._check_numbers()

    def _check_numbers(self) -> None:
        _at_least(self, {"keep": 1, "threads": 1, "reconnect_max": 1, "keepalive": 0,
                         "health_grace": 0, "stall_after": 0, "connect_timeout": 0.1})
        if self.keepalive > 65535:  # a 16-bit field of MQTT's CONNECT
            raise ConfigError(f"keepalive must be at most 65535 seconds, got {self.keepalive}")
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
    *section("What the device runs", (
        Option("bundle", path, "DIR", "bundle directory (from ddnn train)"),
        Option("view", int, "I",
               "which view (camera position) of the bundle this device is: 0..V-1"),
        BUNDLE_KEY_OPTION,
        Option("threads", int, "N", "ONNX Runtime threads"),
        Option("local-threshold", float, "T",
               "one-view bundles: override the local exit threshold (0..1)"),
    )),
    *section("Frame source (exactly one of --data, --images, --camera)", grouped("source", (
        Option("data", path, "NPZ",
               "replay this view of a dataset .npz; frames are numbered by index",
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
               "longest wait in seconds between camera reopenings (exponential backoff from "
               "0.5 s)"),
        Option("fps", float, "F", "frames per second to send; 0 = as fast as possible"),
        Option("limit", int, "N", "stop after this many frames"),
        Option("start", int, "N", "first frame index of a replay"),
    ))),
    *section("MQTT uplink", (
        Option("broker", str, "URL",
               "MQTT broker URL, mqtt://[user:pass@]host:port (mqtts:// for TLS); a password "
               "in it is never logged"),
        *grouped("security", SECURITY_OPTIONS),
        Option("keepalive", int, "S",
               "MQTT keepalive seconds; the broker declares the device offline after 1.5x"),
        Option("reconnect-max", int, "S",
               "longest wait in seconds between reconnection attempts (exponential backoff)"),
        CONNECT_TIMEOUT_OPTION,
        Option("device-id", str, "ID",
               "this device's id in topics and messages (unset: cam0, cam1, ... by view)"),
        Option("deployment", str, "NAME",
               "deployment name: the topic level that separates deployments sharing a broker"),
        Option("edge-id", str, "ID", "the edge whose pulls to answer"),
        Option("topic-prefix", str, "PREFIX", "first topic level(s)"),
        Option("mode", str, "MODE", "pull: features on request (fewer bytes); push: with every "
                                    "frame (fewer round trips)", choices=MODES),
        Option("keep", int, "N", "recent frames whose features are kept for the edge's pulls"),
    )),
    *section("HTTP uplink (without a broker, or its failover)", grouped("http_uplink", (
        Option("edge-url", str, "URL",
               "the edge's HTTP ingest, http(s)://host:port (push mode only): the uplink "
               "without --broker; with it, the failover while the broker is unreachable"),
        Option("token", str, "TOKEN", "bearer token for the HTTP path (needs --edge-url)",
               secret=True),
        Option("edge-ca-file", path, "FILE",
               "CA certificate that signed the edge's HTTPS certificate (an https:// "
               "--edge-url; unset: the system's CAs)"),
        Option("failover-after", float, "SECONDS",
               "with --broker and --edge-url: seconds the broker may be unreachable before "
               "frames go over HTTP(S); back to MQTT once it returns"),
    ))),
    *section("Outbox and spool (while the uplink is away)", grouped("outbox", (
        Option("buffer", int, "N",
               "messages held while the broker is unreachable; the oldest is dropped when full"),
        Option("buffer-mb", float, "MB",
               "... and MiB of them at most, in memory and in the spool (the oldest is "
               "dropped)"),
        Option("spool", path, "DIR",
               "the outbox on disk: a message stays there until the broker acknowledged it, so "
               "a crash or restart of this run loses nothing (at least once); unset: "
               "$STATE_DIRECTORY, else $XDG_STATE_HOME/ddnn, else ~/.local/state/ddnn, then "
               "spool/DEPLOYMENT/DEVICE_ID"),
        Option("no-spool", boolean, "BOOL",
               "keep the outbox in memory only: a crash or restart loses what waits in it"),
        Option("spool-sync-every", int, "N",
               "fsync the spool after this many new messages (1: every message)"),
        Option("spool-sync-ms", float, "MS",
               "... or once the oldest unsynced message is this many milliseconds old: what a "
               "power cut may lose"),
    ))),
    *section("Replay start and end", grouped("replay", (
        Option("wait-peers", float, "S",
               "replays: wait up to this many seconds for the edge and --peers to be online, "
               "then start together with them (at the moment the last came online, plus a "
               "second); 0: start at once"),
        Option("peers", id_list, "IDS",
               "comma-separated device ids for --wait-peers (unset: every view's default id)"),
        Option("start-at", float, "T",
               "Unix time of the first frame, to trigger several replaying devices together"),
        Option("grace", float, "S",
               "seconds to keep answering pulls after the last frame of a replay"),
        Option("drain-timeout", float, "S",
               "longest wait in seconds to deliver what is queued after the last frame"),
        Option("max-lag-ms", float, "MS",
               "replays at --fps: a frame due longer ago than this (at least one frame period) "
               "is skipped and the edge told so, so a device slower than its frame rate stays "
               "current instead of falling behind; 0: never skip"),
    ))),
    *section("Over-the-air updates", (
        *grouped("updates", UPDATE_OPTIONS),
        *grouped("update_source", SOURCE_OPTIONS),
    )),
    *section("Monitoring", (
        *grouped("http", (
            Option("http-host", str, "ADDR", "address of the device's HTTP server", key="host"),
            Option("http-port", int, "PORT",
                   "port of the device's HTTP server (/metrics, /healthz, /livez); unset: none",
                   key="port"))),
        Option("health-grace", float, "S",
               "seconds the broker may be unreachable before /healthz answers 503"),
        Option("stall-after", float, "S",
               "seconds without a frame from the source (while it should produce) before "
               "/healthz answers 503"),
    )),
)
bind(DeviceSettings, OPTIONS)
