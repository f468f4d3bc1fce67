"""``ddnn bundle keygen|sign|verify``: signing bundles so devices, edges and the cloud can refuse
one that was not made by the deployment's owner. See :mod:`ddnn.signing` and docs/security.md.
"""

from __future__ import annotations

import logging

log = logging.getLogger("ddnn.bundle")


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser("bundle", help="sign bundles and check their signatures",
                       description="Sign a bundle's manifest with an Ed25519 key, so that tiers "
                       "started with --bundle-key refuse unsigned or tampered bundles.",
                       formatter_class=formatter)
    actions = p.add_subparsers(dest="bundle_command", metavar="ACTION")
    p.set_defaults(func=lambda _args: _usage(p))

    k = actions.add_parser("keygen", help="make a new Ed25519 signing key pair",
                           formatter_class=formatter)
    k.add_argument("--out", required=True,
                   help="directory for bundle-signing.key (private, mode 0600) and "
                        "bundle-signing.pub (give this one to --bundle-key)")
    k.set_defaults(func=_keygen)

    s = actions.add_parser("sign", help="sign a bundle (writes manifest.sig beside manifest.json)",
                           formatter_class=formatter)
    s.add_argument("--bundle", required=True, help="bundle directory")
    s.add_argument("--key", required=True, help="private key (PEM) from `ddnn bundle keygen`")
    s.set_defaults(func=_sign)

    v = actions.add_parser("verify", help="check a bundle's signature and checksums",
                           formatter_class=formatter)
    v.add_argument("--bundle", required=True, help="bundle directory")
    v.add_argument("--key", required=True, help="public key (PEM)")
    v.set_defaults(func=_verify)


def _usage(parser) -> int:
    import sys

    parser.print_help(sys.stderr)
    return 2


def _keygen(args) -> int:
    from ddnn.signing import generate_keypair

    priv, pub = generate_keypair(args.out)
    print(f"private key: {priv} (keep it off devices)\npublic key:  {pub}")
    return 0


def _sign(args) -> int:
    from ddnn.bundle import load_bundle
    from ddnn.signing import sign_bundle

    bundle = load_bundle(args.bundle)  # sign only a bundle whose checksums hold
    sig = sign_bundle(bundle.path, args.key)
    print(f"signed {bundle.ref}: {sig}")
    return 0


def _verify(args) -> int:
    from ddnn.bundle import load_bundle

    bundle = load_bundle(args.bundle, public_key=args.key)
    print(f"{bundle.ref}: signature and checksums OK")
    return 0
