"""``ddnn edge``: run an edge aggregator. Every option also reads ``DDNN_EDGE_<NAME>``."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("edge")

DESCRIPTION = """\
Run the edge aggregator of a deployment: subscribe to its devices over MQTT, assemble each
frame from the views that arrive by --deadline-ms (a missing or dead device never blocks a
frame), take the local exit on the aggregated scores, else pull the present views' features
and run the edge segment, else call the cloud (Open Inference Protocol v2, binary tensors).
One JSON result per frame is published on {prefix}/{deployment}/results. Without a reachable
cloud the edge answers with its own exit, flagged "degraded", and recovers when the cloud
returns. --http-port serves /metrics (Prometheus), /healthz, /v1/results and the devices'
HTTP fallback (/v1/ingest). SIGINT/SIGTERM stop it cleanly.
Every option can also be set by an environment variable DDNN_EDGE_<OPTION>."""


def _env(name: str, default=None):
    return os.environ.get(f"DDNN_EDGE_{name.upper().replace('-', '_')}", default)



def register(sub, data_sub, formatter) -> None:
    from ddnn.plumbing.mqtt import HIDE_DEFAULT, add_security_options

    p = sub.add_parser("edge", help="run an edge aggregator (local + edge exits, cloud client)",
                       description=DESCRIPTION, formatter_class=formatter)
    a = p.add_argument
    a("--bundle", default=_env("bundle"), required=_env("bundle") is None,
      help="bundle directory (from ddnn train)")
    a("--broker", default=_env("broker"),
      help="MQTT broker URL mqtt://[user:pass@]host:port (mqtts:// for TLS); without it only "
           "HTTP ingest is served" + HIDE_DEFAULT)
    add_security_options(p, _env)
    a("--bundle-key", default=_env("bundle_key"),
      help="Ed25519 public key (PEM): refuse a bundle that is unsigned or not signed by it")
    a("--cloud", default=_env("cloud"),
      help="cloud service base URL, http://host:port; without it frames past the edge exit "
           "are answered by the edge, degraded")
    a("--cloud-token", default=_env("cloud_token"),
      help="bearer token for the cloud" + HIDE_DEFAULT)
    a("--cloud-ca-file", default=_env("cloud_ca_file"),
      help="CA certificate (PEM) the cloud's HTTPS certificate must chain to (default: the "
           "system's CAs)")
    a("--cloud-timeout", type=float, default=_env("cloud_timeout", 2.0),
      help="seconds to wait for a cloud answer before answering degraded")
    a("--cloud-batch", type=int, default=_env("cloud_batch", 32),
      help="frames per cloud call at most (frames waiting together are batched)")
    a("--deployment", default=_env("deployment", "default"), help="deployment name (topic level)")
    a("--edge-id", default=_env("edge_id", "edge0"), help="this edge's id (its requests topic)")
    a("--topic-prefix", default=_env("topic_prefix", "ddnn"), help="first topic level(s)")
    a("--devices", default=_env("devices"),
      help="comma-separated device ids in view order (default: cam0,cam1,...)")
    a("--deadline-ms", type=float, default=_env("deadline_ms", 200),
      help="how long a frame waits for the other views' scores after its first one")
    a("--feature-deadline-ms", type=float, default=_env("feature_deadline_ms", 500),
      help="how long a frame waits for pulled features")
    a("--suspect-after", type=int, default=_env("suspect_after", 3),
      help="deadlines a silent device may miss in a row before frames stop waiting for it")
    a("--local-threshold", type=float, default=_env("local_threshold"),
      help="override the bundle's local exit threshold (0..1)")
    a("--edge-threshold", type=float, default=_env("edge_threshold"),
      help="override the bundle's edge exit threshold (0..1)")
    a("--http-host", default=_env("http_host", "127.0.0.1"), help="address of the HTTP server")
    a("--http-port", type=int, default=_env("http_port"),
      help="port of the HTTP server (/metrics, /healthz, /v1/ingest); unset: no HTTP server")
    a("--http-token", default=_env("http_token"),
      help="bearer token required by POST routes" + HIDE_DEFAULT)
    a("--results-out", default=_env("results_out"),
      help="also append every result to this JSON-lines file")
    a("--results-url", default=_env("results_url"),
      help="also POST every result as JSON to this http(s) URL (an application's web hook); "
      "results wait in a bounded queue while it is unreachable")
    a("--results-token", default=_env("results_token"),
      help="bearer token sent to --results-url" + HIDE_DEFAULT)
    a("--expect-frames", type=int, default=_env("expect_frames"),
      help="exit after answering this many frames (replays, tests, demos)")
    a("--keepalive", type=int, default=_env("keepalive", 10), help="MQTT keepalive seconds")
    a("--reconnect-max", type=int, default=_env("reconnect_max", 30),
      help="longest wait in seconds between reconnection attempts (exponential backoff)")
    a("--threads", type=int, default=_env("threads", 1), help="ONNX Runtime threads")
    p.set_defaults(func=run)


def run(args) -> int:
    import threading
    from pathlib import Path

    from ddnn.bundle import load_bundle
    from ddnn.edge.aggregator import EdgeAggregator, EdgeConfig
    from ddnn.edge.cloud_client import CloudClient
    from ddnn.edge.service import EdgeService
    from ddnn.errors import ConfigError
    from ddnn.plumbing.mqtt import MqttOptions, security_from
    from ddnn.runtime import BundleRuntime
    from ddnn.topics import Topics, check_part, default_device_ids

    bundle = load_bundle(args.bundle, public_key=args.bundle_key)
    m = bundle.manifest
    devices = args.devices.split(",") if args.devices else default_device_ids(m.views)
    for d in devices:
        check_part("device id", d)
    if len(devices) != m.views or len(set(devices)) != len(devices):
        raise ConfigError(f"--devices must name {m.views} distinct ids, one per view")
    if not args.broker and args.http_port is None:
        raise ConfigError("give --broker, or --http-port for devices posting over HTTP")
    cfg = EdgeConfig(
        devices=devices, deployment=check_part("deployment", args.deployment),
        edge_id=check_part("edge id", args.edge_id), deadline=args.deadline_ms / 1000,
        feature_deadline=args.feature_deadline_ms / 1000, suspect_after=args.suspect_after,
        local_threshold=None if args.local_threshold is None else float(args.local_threshold),
        edge_threshold=None if args.edge_threshold is None else float(args.edge_threshold),
        cloud_batch=args.cloud_batch,
        results_path=Path(args.results_out) if args.results_out else None,
        results_url=args.results_url, results_token=args.results_token,
        expect_frames=args.expect_frames)
    cloud = (CloudClient(args.cloud, f"{m.name}-cloud", token=args.cloud_token,
                         timeout=args.cloud_timeout, ca_file=args.cloud_ca_file)
             if args.cloud else None)
    runtime = BundleRuntime(bundle, threads=args.threads)
    agg = EdgeAggregator(runtime, cfg, Topics(cfg.deployment, args.topic_prefix), cloud=cloud)
    options = MqttOptions(keepalive=args.keepalive, reconnect_max=args.reconnect_max,
                          security=security_from(args))
    service = EdgeService(agg, args.broker, options, args.http_host, args.http_port,
                          args.http_token)
    log.info("edge config: bundle=%s deployment=%s edge=%s devices=%s broker=%s cloud=%s "
             "deadline=%.0fms feature_deadline=%.0fms suspect_after=%d thresholds=%s "
             "http=%s:%s results_out=%s results_url=%s expect_frames=%s keepalive=%d "
             "reconnect_max=%d",
             bundle.ref, cfg.deployment, cfg.edge_id, ",".join(devices),
             service.mqtt.url if service.mqtt else None, args.cloud, args.deadline_ms,
             args.feature_deadline_ms, args.suspect_after, dict(agg.policy.thresholds),
             args.http_host, args.http_port, args.results_out, args.results_url, args.expect_frames,
             args.keepalive, args.reconnect_max)
    log.info("edge security: mqtt %s, cloud token %s, cloud CA %s, http token %s, bundle key %s",
             options.security.describe() if args.broker else None,
             "***" if args.cloud_token else "none", args.cloud_ca_file or "system",
             "***" if args.http_token else "none", args.bundle_key or "none")
    updater = None
    if service.mqtt is not None:  # over-the-air bundle updates on the deployment's bundle topic
        from ddnn.plumbing.ota import BundleUpdater

        def _result(ok: bool) -> None:
            agg.metrics.bundle_updates.inc(result="applied" if ok else "refused")
            if not ok:  # messages of a refused version are another model again
                agg.announced = None

        def _announced(ann) -> None:
            agg.announced = (ann.name, ann.version)

        updater = BundleUpdater(
            bundle, lambda new: agg.swap(BundleRuntime(new, threads=args.threads)),
            cloud=args.cloud, token=args.cloud_token, public_key=args.bundle_key,
            on_result=_result, tag=cfg.edge_id, on_announce=_announced)
        service.on_bundle = updater.on_message
    stop = threading.Event()
    if service.mqtt is not None:  # credentials or certificates refused: stop, exit non-zero
        service.mqtt.on_refused = lambda error: stop.set()

    def _stop(signum, frame):
        log.info("signal %d: stopping", signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
    service.start()
    if cloud is not None and not cloud.ready():
        log.warning("cloud %s is not ready yet; frames past the edge exit are degraded until "
                    "it is", args.cloud)
    try:
        while not stop.is_set() and not agg.done.is_set():
            stop.wait(0.1)
    finally:
        service.stop()
        if updater is not None:
            updater.stop()
    if service.mqtt is not None and service.mqtt.refused is not None:
        raise service.mqtt.refused
    return 0
