"""``ddnn device``: run a device agent. Every option also reads ``DDNN_DEVICE_<NAME>``."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("device")

DESCRIPTION = """\
Run one device agent: read frames from a source, run the bundle's device segment for --view
with ONNX Runtime, and talk to the edge aggregator over MQTT (or HTTP POSTs to --edge-url when
no broker is given). With several views the device publishes its scores for every frame and
sends its features when the edge pulls them (--mode pull) or with every frame (--mode push:
no round trip, more bytes). With a one-view bundle the device decides its own exit.

A replay (--data) exits by itself once every frame is delivered and the edge has stopped
pulling for --grace seconds. SIGINT/SIGTERM stop it cleanly (status offline, broker flushed).
Every option can also be set by an environment variable DDNN_DEVICE_<OPTION>, e.g.
DDNN_DEVICE_BROKER=mqtt://broker:1883."""


def _env(name: str, default=None):
    return os.environ.get(f"DDNN_DEVICE_{name.upper().replace('-', '_')}", default)


def register(sub, data_sub, formatter) -> None:
    from ddnn.plumbing.mqtt import HIDE_DEFAULT, add_security_options

    p = sub.add_parser("device", help="run a device agent (device segment, MQTT uplink)",
                       description=DESCRIPTION, formatter_class=formatter)
    a = p.add_argument
    a("--bundle", default=_env("bundle"), required=_env("bundle") is None,
      help="bundle directory (from ddnn train)")
    a("--view", type=int, default=_env("view"), required=_env("view") is None,
      help="which view (camera position) of the bundle this device is: 0..V-1")
    a("--broker", default=_env("broker"),
      help="MQTT broker URL, mqtt://[user:pass@]host:port (mqtts:// for TLS)" + HIDE_DEFAULT)
    add_security_options(p, _env)
    a("--bundle-key", default=_env("bundle_key"),
      help="Ed25519 public key (PEM): refuse a bundle that is unsigned or not signed by it")
    a("--edge-url", default=_env("edge_url"),
      help="HTTP fallback when no --broker: the edge's http://host:port (push mode only)")
    a("--token", default=_env("token"), help="bearer token for the HTTP fallback" + HIDE_DEFAULT)
    a("--device-id", default=_env("device_id"), help="this device's id (default: cam<view>)")
    a("--deployment", default=_env("deployment", "default"),
      help="deployment name: the topic level that separates deployments sharing a broker")
    a("--edge-id", default=_env("edge_id", "edge0"), help="the edge whose pulls to answer")
    a("--topic-prefix", default=_env("topic_prefix", "ddnn"), help="first topic level(s)")
    a("--mode", choices=["pull", "push"], default=_env("mode", "pull"),
      help="pull: features on request (fewer bytes); push: with every frame (fewer round trips)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", default=_env("data"),
                     help="replay this view of a dataset .npz; frames are numbered by index")
    src.add_argument("--images", default=_env("images"),
                     help="folder of PNG/PPM images (JPEG with Pillow), read in name order")
    src.add_argument("--camera", type=int, default=_env("camera"),
                     help="camera index through OpenCV (optional dependency)")
    a("--fps", type=float, default=_env("fps", 10.0),
      help="frames per second to send; 0 = as fast as possible")
    a("--limit", type=int, default=_env("limit"), help="stop after this many frames")
    a("--start", type=int, default=_env("start", 0), help="first frame index of a replay")
    a("--buffer", type=int, default=_env("buffer", 10000),
      help="messages held while the broker is unreachable; the oldest is dropped when full")
    a("--spool", default=_env("spool"),
      help="directory to keep the outbox on disk, so a restart loses nothing")
    a("--keep", type=int, default=_env("keep", 1024),
      help="recent frames whose features are kept for the edge's pulls")
    a("--grace", type=float, default=_env("grace", 2.0),
      help="seconds to keep answering pulls after the last frame of a replay")
    a("--local-threshold", type=float, default=_env("local_threshold"),
      help="one-view bundles: override the local exit threshold (0..1)")
    a("--keepalive", type=int, default=_env("keepalive", 10),
      help="MQTT keepalive seconds; the broker declares the device offline after 1.5x")
    a("--reconnect-max", type=int, default=_env("reconnect_max", 30),
      help="longest wait in seconds between reconnection attempts (exponential backoff)")
    a("--wait-peers", type=float, default=_env("wait_peers", 0),
      help="before replaying, wait up to this many seconds for the edge and --peers online")
    a("--peers", default=_env("peers"),
      help="comma-separated device ids for --wait-peers (default: every view's cam<i>)")
    a("--start-at", type=float, default=_env("start_at"),
      help="Unix time of the first frame, to trigger several replaying devices together")
    a("--threads", type=int, default=_env("threads", 1), help="ONNX Runtime threads")
    p.set_defaults(func=run)


def run(args) -> int:
    import threading

    from ddnn.bundle import load_bundle
    from ddnn.device.agent import DeviceAgent, DeviceConfig
    from ddnn.device.buffer import Outbox
    from ddnn.device.service import DeviceService
    from ddnn.device.sources import Camera, ImageFolder, NpzReplay
    from ddnn.device.transport import HttpTransport, MqttTransport
    from ddnn.errors import ConfigError
    from ddnn.plumbing.mqtt import MqttOptions, security_from
    from ddnn.runtime import BundleRuntime
    from ddnn.topics import Topics, check_part, default_device_ids

    bundle = load_bundle(args.bundle, public_key=args.bundle_key)
    m = bundle.manifest
    view = int(args.view)
    if not 0 <= view < m.views:
        raise ConfigError(f"--view {view} is outside the bundle's views 0..{m.views - 1}")
    device_id = check_part("device id", args.device_id or f"cam{view}")
    limit = int(args.limit) if args.limit is not None else None
    if args.data:
        source = NpzReplay(args.data, view, m.num_classes, limit, args.start)
    elif args.images:
        source = ImageFolder(args.images, m.input_shape, limit)
    elif args.camera is not None:
        source = Camera(int(args.camera), m.input_shape, limit, float(args.fps))
    else:
        raise ConfigError("give a frame source: --data, --images or --camera")
    if not args.broker and not args.edge_url:
        raise ConfigError("give --broker (MQTT) or --edge-url (HTTP fallback)")
    mode = args.mode
    if not args.broker and mode == "pull" and m.views > 1:
        log.info("HTTP fallback has no pull channel: using push mode")
        mode = "push"
    peers = args.peers.split(",") if args.peers else default_device_ids(m.views)
    cfg = DeviceConfig(view=view, device_id=device_id, deployment=args.deployment,
                       edge_id=args.edge_id, mode=mode, fps=args.fps, keep=args.keep,
                       grace=args.grace, local_threshold=_float(args.local_threshold),
                       peers=peers, wait_peers=args.wait_peers,
                       start_at=None if args.start_at is None else float(args.start_at))
    topics = Topics(args.deployment, args.topic_prefix)
    runtime = BundleRuntime(bundle, threads=args.threads)
    runtime.runner(f"device-{view}")
    outbox = Outbox(args.buffer, args.spool)
    agent = DeviceAgent(runtime, cfg, outbox)
    if args.broker:
        options = MqttOptions(keepalive=args.keepalive, reconnect_max=args.reconnect_max,
                              security=security_from(args))
        transport = MqttTransport(args.broker, topics, device_id, args.edge_id, options,
                                  {"device": device_id, "view": view, "model": bundle.ref,
                                   "mode": mode},
                                  agent.handle_request)
    else:
        transport = HttpTransport(args.edge_url, args.token)
    log.info("device config: bundle=%s view=%d id=%s deployment=%s edge=%s transport=%s "
             "mode=%s source=%s fps=%s limit=%s buffer=%d spool=%s keep=%d grace=%.1f "
             "keepalive=%d reconnect_max=%d threads=%d", bundle.ref, view, device_id,
             args.deployment, args.edge_id, (args.broker and str(transport.client.url))
             or args.edge_url, mode, args.data or args.images or f"camera:{args.camera}",
             args.fps, limit, args.buffer, args.spool, args.keep, args.grace, args.keepalive,
             args.reconnect_max, args.threads)
    log.info("device security: mqtt %s, bundle key %s",
             args.broker and options.security.describe(), args.bundle_key or "none")
    service = DeviceService(agent, outbox, transport)
    updater = None
    if args.broker:  # over-the-air bundle updates announced on the deployment's bundle topic
        from ddnn.plumbing.ota import BundleUpdater

        def _apply(new):
            agent.swap(BundleRuntime(new, threads=args.threads))
            transport.update_status(model=new.ref)

        updater = BundleUpdater(bundle, _apply, public_key=args.bundle_key, tag=device_id)
        transport.on_bundle = updater.on_message
    client = getattr(transport, "client", None)
    if client is not None:  # credentials or certificates refused: stop instead of buffering
        client.on_refused = lambda error: service.stop_event.set()

    def _stop(signum, frame):
        log.info("signal %d: stopping", signum)
        service.stop_event.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
    service.start()
    try:
        service.run(source)
    finally:
        service.stop()
        if updater is not None:
            updater.stop()
    if client is not None and client.refused is not None:
        raise client.refused
    return 0


def _float(v):
    return None if v is None else float(v)
