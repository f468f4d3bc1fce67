"""``ddnn announce``: publish a bundle version for over-the-air updates (retained)."""

from __future__ import annotations

import logging

from ddnn.bundle import check_name
from ddnn.plumbing.ota import Announcement, bundle_url

log = logging.getLogger(__name__)


def announce(broker: str, deployment: str, ann: Announcement, prefix: str = "ddnn",
             timeout: float = 10.0) -> None:
    """Publish ``ann`` retained on the deployment's bundle topic and wait for the broker."""
    from ddnn.plumbing.mqtt import MqttClient, MqttError, MqttOptions
    from ddnn.topics import Topics

    topic = Topics(deployment, prefix).bundle
    client = MqttClient(broker, f"ddnn-announce-{deployment}", MqttOptions()).start()
    try:
        if not client.wait_connected(timeout):
            raise MqttError(f"broker {broker} not reachable in {timeout:.0f} s")
        info = client.publish(topic, ann.to_bytes(), 1, retain=True)
        info.wait_for_publish(timeout)
    finally:
        client.stop()
    log.info("announced %s:%s on %s", ann.name, ann.version, topic)


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser(
        "announce", help="announce a bundle version to a deployment (over-the-air update)",
        description="Publish a bundle version on the deployment's retained bundle topic. "
        "Devices and edges fetch it over HTTP (from --url, or --cloud's /v1/bundles/NAME/"
        "VERSION, or their own cloud), verify it and swap it in; a bad one is refused and the "
        "running version keeps serving. The cloud must serve that version (--repository).",
        formatter_class=formatter)
    p.add_argument("--broker", required=True, help="MQTT broker URL")
    p.add_argument("--deployment", default="default", help="deployment name (topic level)")
    p.add_argument("--topic-prefix", default="ddnn", help="first topic level(s)")
    p.add_argument("--name", required=True, help="model name of the bundle")
    p.add_argument("--version", dest="bundle_version", required=True, help="bundle version")
    p.add_argument("--cloud", default=None,
                   help="cloud base URL: the files are fetched from its /v1/bundles/NAME/VERSION")
    p.add_argument("--url", default=None, help="fetch the bundle from this base URL instead")
    p.set_defaults(func=_announce)


def _announce(args) -> int:
    url = args.url or (bundle_url(args.cloud, args.name, args.bundle_version)
                       if args.cloud else None)
    ann = Announcement(check_name("model name", args.name),
                       check_name("model version", args.bundle_version), url)
    announce(args.broker, args.deployment, ann, args.topic_prefix)
    print(f"announced {ann.name}:{ann.version} to deployment {args.deployment}")
    return 0
