"""The edge aggregator's settings: one typed, frozen object from flags or ``DDNN_EDGE_*``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddnn.edge.drift import DRIFT_OPTIONS, DriftPolicy
from ddnn.edge.feedback import OPERATOR_OPTIONS, OperatorAccess
from ddnn.edge.recorder import RECORDING_OPTIONS, ExperienceRecording
from ddnn.errors import ConfigError
from ddnn.exits import check_threshold
from ddnn.names import check_name
from ddnn.plumbing.health import MonitorHttp
from ddnn.plumbing.mqtt import CONNECT_TIMEOUT_OPTION, SECURITY_OPTIONS, BrokerUrl, MqttSecurity
from ddnn.plumbing.options import Option, bind, describe, grouped, id_list, path
from ddnn.plumbing.ota_settings import (
    BUNDLE_KEY_OPTION,
    UPDATE_OPTIONS,
    UpdatePolicy,
    UpdateSource,
)
from ddnn.topics import default_device_ids

ENV_PREFIX = "DDNN_EDGE_"


def gateway_map(value: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``gw0=cam0+cam1,gw1=cam2`` as ``(("gw0", ("cam0", "cam1")), ("gw1", ("cam2",)))``."""
    out = []
    for part in id_list(value):
        gateway, sep, devices = part.partition("=")
        ids = tuple(d.strip() for d in devices.split("+") if d.strip())
        if not sep or not ids:
            raise ConfigError(f"--gateways: {part!r} is not GATEWAY=DEVICE+DEVICE...")
        check_name("gateway id", gateway.strip())
        for d in ids:
            check_name("device id", d)
        out.append((gateway.strip(), ids))
    if len({g for g, _ in out}) != len(out):
        raise ConfigError("--gateways names a gateway twice")
    return tuple(out)


def view_devices(devices: Sequence[str], views: int) -> list[str]:
    """The device of each view: ``devices`` (``--devices``), or ``cam0`` … ``cam{V-1}`` when
    none are given; refused unless it names one distinct id per view of the bundle."""
    ids = list(devices) or default_device_ids(views)
    if len(ids) != views or len(set(ids)) != len(ids):
        raise ConfigError(f"--devices must name {views} distinct ids, one per view")
    return ids


@dataclass(frozen=True, kw_only=True)
class CloudLink:
    """How the edge reaches the cloud (``--cloud*``): for inference, and as the one origin of
    over-the-air bundles."""

    url: str | None = None  # cloud base URL; None: frames past the edge exit are degraded
    token: str | None = None
    ca_file: str | None = None  # CA of the cloud's HTTPS certificate; None: system CAs
    cert_file: str | None = None  # this edge's client certificate for a mutual-TLS cloud
    key_file: str | None = None  # its private key (default: inside cert_file)
    timeout: float = 2.0  # seconds before a cloud call counts as failed
    batch: int = 32  # frames per cloud call at most

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"cloud_timeout must be positive, got {self.timeout}")
        if self.batch < 1:
            raise ConfigError(f"cloud_batch must be at least 1, got {self.batch}")
        if self.token is not None and not self.token.strip():
            raise ConfigError("cloud_token must not be empty")

    def update_source(self) -> UpdateSource:
        """Bundles come from the cloud only, with its token and TLS (none without a cloud)."""
        if self.url is None:
            return UpdateSource()
        return UpdateSource(origin=self.url, token=self.token, ca_file=self.ca_file,
                            cert_file=self.cert_file, key_file=self.key_file)


@dataclass(frozen=True, kw_only=True)
class FrameWaits:
    """How long a frame waits for its views (``--deadline-ms``, ``--max-wait-ms``,
    ``--feature-deadline-ms``), and which devices it waits for (``--suspect-after``,
    ``--max-fps``: :mod:`ddnn.edge.roster`)."""

    deadline_ms: float = 200.0  # a frame waits at least this long for its views' scores
    max_wait_ms: float = 1000.0  # and at most this long, for devices that usually lag
    feature_deadline_ms: float = 500.0  # and this long for pulled features
    suspect_after: int = 3  # missed deadlines in a row before a silent device is not waited for
    max_fps: float = 240.0  # a device alone advancing frames faster than this runs ahead

    def __post_init__(self) -> None:
        for name in ("deadline_ms", "feature_deadline_ms", "max_wait_ms", "max_fps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.suspect_after < 1:
            raise ConfigError(f"suspect_after must be at least 1, got {self.suspect_after}")

    @property
    def deadline(self) -> float:
        """Seconds a frame waits for its views' scores."""
        return self.deadline_ms / 1000

    @property
    def max_wait(self) -> float:
        """Seconds a frame may wait at most for a device that usually lags (>= deadline)."""
        return max(self.max_wait_ms, self.deadline_ms) / 1000

    @property
    def feature_deadline(self) -> float:
        """Seconds a frame waits for pulled features."""
        return self.feature_deadline_ms / 1000


@dataclass(frozen=True, kw_only=True)
class ExitOverrides:
    """Overrides of the bundle's exit thresholds (``--local-threshold``, ``--edge-threshold``;
    None: the bundle's)."""

    local_threshold: float | None = None
    edge_threshold: float | None = None

    def __post_init__(self) -> None:
        for tier in ("local", "edge"):
            if getattr(self, f"{tier}_threshold") is not None:
                check_threshold(tier, getattr(self, f"{tier}_threshold"))


@dataclass(frozen=True, kw_only=True)
class LatencyObjective:
    """A latency objective the edge plans its operating point for (``--latency-slo``,
    ``--latency-percentile``: :mod:`ddnn.edge.planner`); None: the thresholds stay put."""

    latency_slo_ms: float | None = None  # capture to answer, at the percentile below
    latency_percentile: float = 99.0

    def __post_init__(self) -> None:
        if self.latency_slo_ms is not None and not 0 < self.latency_slo_ms < math.inf:
            raise ConfigError(f"latency_slo_ms must be a positive number of milliseconds, got "
                              f"{self.latency_slo_ms}")
        if not 50 <= self.latency_percentile < 100:
            raise ConfigError(f"latency_percentile must be in [50, 100), got "
                              f"{self.latency_percentile}")

    @property
    def slo(self) -> float | None:
        """The objective in seconds (None: none)."""
        return None if self.latency_slo_ms is None else self.latency_slo_ms / 1000

    @property
    def quantile(self) -> float:
        """The percentile as a quantile (0..1)."""
        return self.latency_percentile / 100


@dataclass(frozen=True, kw_only=True)
class HttpAccess:
    """Who may post to the HTTP server, and over what (``--http-token*``, ``--http-cert-file``,
    ``--http-key-file``, ``--http-max-connections``)."""

    http_token: str | None = None  # one bearer token of the POST routes, for every device
    http_tokens: Path | None = None  # file of per-device tokens (edge.credentials)
    http_max_connections: int = 64  # open HTTP connections at most (one thread each)
    http_cert_file: Path | None = None  # with http_key_file: HTTPS only
    http_key_file: Path | None = None

    def __post_init__(self) -> None:
        if self.http_max_connections < 1:
            raise ConfigError("http_max_connections must be at least 1, got "
                              f"{self.http_max_connections}")
        if self.http_token is not None and self.http_tokens is not None:
            raise ConfigError("give --http-token or --http-tokens, not both: the shared token "
                              "would speak for every device the per-device tokens separate")
        if self.http_token is not None and not self.http_token.strip():
            raise ConfigError("http_token must not be empty")
        pair = (self.http_cert_file, self.http_key_file)
        if any(pair) and not all(pair):
            raise ConfigError("give --http-cert-file and --http-key-file together")

    @property
    def tls(self) -> tuple[Path, Path] | None:
        """The server's certificate and key (None: plain HTTP)."""
        if self.http_cert_file is None or self.http_key_file is None:
            return None
        return self.http_cert_file, self.http_key_file


@dataclass(frozen=True, kw_only=True)
class ResultOutputs:
    """Where every result also goes: a JSON-lines file (``--results-out``), an application's
    URL (``--results-url``, ``--results-token``: :mod:`ddnn.edge.callback`)."""

    results_out: Path | None = None
    results_url: str | None = None
    results_token: str | None = None

    def __post_init__(self) -> None:
        if self.results_token is not None and not self.results_token.strip():
            raise ConfigError("results_token must not be empty")


@dataclass(frozen=True, kw_only=True)
class BrokerLink:
    """How the edge keeps its MQTT connection (``--keepalive``, ``--reconnect-max``,
    ``--connect-timeout``)."""

    keepalive: int = 10  # MQTT keepalive seconds
    reconnect_max: int = 30  # cap of the reconnection backoff, seconds
    connect_timeout: float = 10.0  # seconds for TCP, TLS and the CONNACK, each

    def __post_init__(self) -> None:
        if not self.connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be positive, got {self.connect_timeout}")
        for name in ("keepalive", "reconnect_max"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class HealthPolicy:
    """When ``GET /healthz`` answers 503 (``--health-grace``, ``--stall-after``)."""

    health_grace: float = 30.0  # broker unreachable (or devices never seen) this long: 503
    stall_after: float = 30.0  # frames pending and none answered this long: 503

    def __post_init__(self) -> None:
        for name in ("health_grace", "stall_after"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class EdgeSettings:
    """Everything ``ddnn edge`` can be told; every field is a flag and an environment variable.

    Checks that need the bundle (one device id per view) are made when the service is built.
    Option groups (``security``, ``updates``, ``cloud_link``, ``waits``, ``thresholds``,
    ``latency``, ``drift``, ``recording``, ``operator``, ``http``, ``http_access``, ``results``,
    ``broker_link``, ``health``) keep their flat names as flags and variables, and in code too
    (:func:`ddnn.plumbing.options.bind`: ``EdgeSettings(cloud_timeout=5).cloud_timeout``).
    """

    bundle: Path  # the bundle directory (from ddnn train); required
    broker: str | None = None  # MQTT broker URL; None: devices post over HTTP only
    security: MqttSecurity = MqttSecurity()  # MQTT TLS and credentials
    bundle_key: Path | None = None  # Ed25519 public key (PEM): refuse bundles it did not sign
    updates: UpdatePolicy = UpdatePolicy(probation=60.0)  # which over-the-air versions apply
    cloud_link: CloudLink = CloudLink()  # the cloud, and the origin of over-the-air bundles
    deployment: str = "default"
    edge_id: str = "edge0"
    topic_prefix: str = "ddnn"
    devices: tuple[str, ...] = ()  # device ids in view order; empty: cam0 .. cam{V-1}
    gateways: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (gateway, the devices it speaks for)
    waits: FrameWaits = FrameWaits()  # how long frames wait, and for which devices
    thresholds: ExitOverrides = ExitOverrides()  # overrides of the bundle's exit thresholds
    latency: LatencyObjective = LatencyObjective()  # the operating point planned for latency
    drift: DriftPolicy = DriftPolicy()  # the exits checked against the cloud (edge.drift)
    recording: ExperienceRecording = ExperienceRecording()  # experience for ddnn federate
    operator: OperatorAccess = OperatorAccess()  # who may label frames (POST /v1/feedback)
    http: MonitorHttp = MonitorHttp()  # the HTTP server (/metrics, /healthz, /v1/ingest)
    http_access: HttpAccess = HttpAccess()  # who may post to it, and over what
    results: ResultOutputs = ResultOutputs()  # where every result also goes
    state_dir: Path | None = None  # what the edge keeps across restarts (its answer numbers)
    expect_frames: int | None = None  # stop after this many results (replays, tests, demos)
    broker_link: BrokerLink = BrokerLink()  # how the MQTT connection is kept
    threads: int = 1  # ONNX Runtime threads
    health: HealthPolicy = HealthPolicy()  # when /healthz answers 503

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.broker and self.http.port is None:
            raise ConfigError("give --broker, or --http-port for devices posting over HTTP")
        if self.broker:
            BrokerUrl.parse(self.broker)
        check_name("deployment", self.deployment)
        check_name("edge id", self.edge_id)
        for part in self.topic_prefix.split("/"):
            check_name("topic prefix", part)
        for d in self.devices:
            check_name("device id", d)
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"--devices names a device twice: {','.join(self.devices)}")
        behind = [d for _, ds in self.gateways for d in ds]
        if len(set(behind)) != len(behind):
            raise ConfigError("--gateways puts a device behind two gateways")
        if self.threads < 1:
            raise ConfigError(f"threads must be at least 1, got {self.threads}")
        access = self.http_access
        if access.http_tokens is not None and self.http.port is None:
            raise ConfigError("--http-tokens needs --http-port (the tokens guard its POST routes)")
        if access.tls is not None and self.http.port is None:
            raise ConfigError("--http-cert-file and --http-key-file need --http-port (they "
                              "secure its server)")
        for f in access.tls or ():
            if not Path(f).is_file():
                raise ConfigError(f"HTTP server certificate or key {f}: no such file")
        if self.expect_frames is not None and self.expect_frames < 1:
            raise ConfigError(f"expect_frames must be at least 1, got {self.expect_frames}")
        if (self.recording.directory is not None and self.cloud_link.url is None
                and not self.operator.enabled):
            raise ConfigError("--experience needs --cloud (the cloud's answers are the labels) "
                              "or --operator-token (operators' labels, POST /v1/feedback)")
        if self.operator.enabled and (self.recording.directory is None or self.http.port is None):
            raise ConfigError("--operator-token needs --experience (where labelled frames are "
                              "recorded) and --http-port (POST /v1/feedback)")
        if self.drift.monitoring and self.cloud_link.url is None:
            raise ConfigError("--audit-rate needs --cloud: the cloud's answers check the exits")

    @property
    def deadline(self) -> float:
        """Seconds a frame waits for its views' scores."""
        return self.waits.deadline

    @property
    def max_wait(self) -> float:
        """Seconds a frame may wait at most for a device that usually lags (>= deadline)."""
        return self.waits.max_wait

    @property
    def feature_deadline(self) -> float:
        """Seconds a frame waits for pulled features."""
        return self.waits.feature_deadline

    def describe(self) -> dict:
        """The resolved settings for the start-up log, secrets masked (the broker URL's too)."""
        out = describe(self, OPTIONS)
        if self.broker:
            out["broker"] = str(BrokerUrl.parse(self.broker))  # never prints a password
        return out


# The options table: one row per field above (its default is the field's default).
OPTIONS = (
    Option("bundle", path, "DIR", "bundle directory (from ddnn train)"),
    Option("broker", str, "URL", "MQTT broker URL mqtt://[user:pass@]host:port (mqtts:// for "
                                 "TLS); without it only HTTP ingest is served"),
    *grouped("security", SECURITY_OPTIONS),
    BUNDLE_KEY_OPTION,
    *grouped("updates", UPDATE_OPTIONS),
    *grouped("cloud_link", (
        Option("cloud", str, "URL", "cloud service base URL, http://host:port; without it "
                                    "frames past the edge exit are answered by the edge, "
                                    "degraded", key="url"),
        Option("cloud-token", str, "TOKEN", "bearer token for the cloud", secret=True,
               key="token"),
        Option("cloud-ca-file", str, "FILE", "CA certificate (PEM) the cloud's HTTPS "
                                             "certificate must chain to (default: the system's "
                                             "CAs)", key="ca_file"),
        Option("cloud-cert-file", str, "FILE",
               "client certificate (PEM) this edge presents to a cloud that requires one "
               "(mutual TLS: ddnn cloud --ssl-ca-certs)", key="cert_file"),
        Option("cloud-key-file", str, "FILE", "private key (PEM) of --cloud-cert-file",
               key="key_file"),
        Option("cloud-timeout", float, "SECONDS",
               "seconds to wait for a cloud answer before answering degraded", key="timeout"),
        Option("cloud-batch", int, "N",
               "frames per cloud call at most (frames waiting together are batched)",
               key="batch"))),
    Option("deployment", str, "NAME", "deployment name (topic level)"),
    Option("edge-id", str, "ID", "this edge's id (its requests topic)"),
    Option("topic-prefix", str, "PREFIX", "first topic level(s)"),
    Option("devices", id_list, "IDS",
           "comma-separated device ids in view order (unset: cam0,cam1,...)"),
    Option("gateways", gateway_map, "GW=DEV+DEV,...",
           "gateways (ddnn gateway) and the devices each may speak for, e.g. "
           "gw0=cam0+cam1+cam2,gw1=cam3; unset: none"),
    *grouped("waits", (
        Option("deadline-ms", float, "MS",
               "how long a frame waits at least for the other views' scores after its first one "
               "(a frame whose views all arrived goes on at once)"),
        Option("max-wait-ms", float, "MS",
               "latency budget: how long a frame may wait at most for a device that usually lags "
               "(the edge learns each device's lag behind the first view and waits that long, "
               "within this budget; equal to --deadline-ms: a fixed deadline)"),
        Option("feature-deadline-ms", float, "MS", "how long a frame waits for pulled features"),
        Option("suspect-after", int, "N",
               "deadlines a silent device may miss in a row before frames stop waiting for it"),
        Option("max-fps", float, "FPS",
               "frames per second (of capture time) no honest device exceeds: a device that no "
               "other device's views accompany and whose frame ids advance faster runs ahead, and "
               "opens no frame alone (docs/security.md)"))),
    *grouped("thresholds", (
        Option("local-threshold", float, "T", "override the bundle's local exit threshold (0..1)"),
        Option("edge-threshold", float, "T", "override the bundle's edge exit threshold (0..1)"))),
    *grouped("latency", (
        Option("latency-slo", float, "MS",
               "latency objective, capture to answer in milliseconds at --latency-percentile: "
               "the edge measures what its paths cost now and runs the most accurate point of "
               "the bundle's operating curve predicted to meet it (never below the local "
               "exit's accuracy), with the pull deadlines it leaves (docs/latency.md); unset: "
               "the thresholds stay put", key="latency_slo_ms"),
        Option("latency-percentile", float, "P",
               "the percentile of latency --latency-slo bounds (50 to 99.9...)"))),
    *grouped("drift", DRIFT_OPTIONS),
    *grouped("recording", RECORDING_OPTIONS),
    *grouped("operator", OPERATOR_OPTIONS),
    *grouped("http", (
        Option("http-host", str, "ADDR", "address of the HTTP server", key="host"),
        Option("http-port", int, "PORT",
               "port of the HTTP server (/metrics, /healthz, /v1/ingest); unset: no HTTP "
               "server", key="port"))),
    *grouped("http_access", (
        Option("http-token", str, "TOKEN",
               "one bearer token for POST /v1/ingest and /v1/results, shared by every device: "
               "whoever holds it may post as any device (use --http-tokens to separate them)",
               secret=True),
        Option("http-tokens", path, "FILE",
               "per-device bearer tokens, one 'DEVICE_ID TOKEN' line per device (16+ characters, "
               "mode 0600): a device's token posts only that device's envelopes and results "
               "(else 403); excludes --http-token"),
        Option("http-max-connections", int, "N",
               "open HTTP connections at most; past it the longest-idle one is closed, or the new "
               "one refused with 503 when all are busy"),
        Option("http-cert-file", path, "FILE",
               "the HTTP server's certificate (PEM, chain first): with --http-key-file, every "
               "route is HTTPS only"),
        Option("http-key-file", path, "FILE", "the private key of --http-cert-file"))),
    *grouped("results", (
        Option("results-out", path, "FILE", "also append every result to this JSON-lines file"),
        Option("results-url", str, "URL",
               "also POST every result as JSON to this http(s) URL (an application's web hook); "
               "results wait in a bounded queue while it is unreachable"),
        Option("results-token", str, "TOKEN", "bearer token sent to --results-url", secret=True))),
    Option("state-dir", path, "DIR",
           "a writable directory for what the edge keeps across restarts: the answer numbers "
           "(seq) are reserved there, so they keep increasing after a crash or a restart; "
           "unset: they start from the clock (microseconds), which holds unless it steps back"),
    Option("expect-frames", int, "N",
           "exit after answering this many frames (replays, tests, demos)"),
    *grouped("broker_link", (
        Option("keepalive", int, "SECONDS", "MQTT keepalive seconds"),
        Option("reconnect-max", int, "SECONDS",
               "longest wait in seconds between reconnection attempts (exponential backoff)"),
        CONNECT_TIMEOUT_OPTION)),
    Option("threads", int, "N", "ONNX Runtime threads"),
    *grouped("health", (
        Option("health-grace", float, "SECONDS",
               "GET /healthz answers 503 once the broker has been unreachable this long, or every "
               "device offline (never seen counts as offline after this long from the start)"),
        Option("stall-after", float, "SECONDS",
               "GET /healthz answers 503 when frames are pending and none was answered this long "
               "(the worker is stalled)"))),
)
bind(EdgeSettings, OPTIONS)
