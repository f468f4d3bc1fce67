"""``ddnn federate``: federated fine-tuning of a bundle on Flower (docs/federated.md).

``ddnn federate --bundle B --site PATH ... --out OUT`` runs everything on one machine;
``ddnn federate server`` and ``ddnn federate client`` are the deployed halves.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddnn.models.federated.settings import (
    PLAIN_FEDAVG,
    SCHEDULES,
    VARIATES,
    FederationSettings,
)
from ddnn.models.federated.strategy import AGGREGATES

D = FederationSettings(bundle="", out="", work="")


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser(
        "federate", help="fine-tune a bundle on the sites' own data (Flower)",
        description="Federated fine-tuning: each site trains the bundle's network on its own "
        "data and only weights travel; the result is the bundle's next version, calibrated on "
        "the sites' held-out data. With --bundle/--site/--out everything runs on this machine "
        "as real Flower processes; `server` and `client` are the deployed halves.",
        formatter_class=formatter)
    _federation_options(p)
    p.add_argument("--site", action="append", default=[], metavar="PATH",
                   help="a site's dataset file or directory, or the experience directory an "
                   "edge recorded (ddnn edge --experience; repeat: one client per site)")
    p.add_argument("--site-experience", action="append", default=[], metavar="DIR",
                   help="a site that learns from recorded experience only (repeatable)")
    p.set_defaults(func=_one_machine)
    actions = p.add_subparsers(dest="federate_command", metavar="ROLE")

    s = actions.add_parser("server", help="the SuperLink and ServerApp (next to the cloud)",
                           formatter_class=formatter)
    _federation_options(s)
    s.add_argument("--host", default="0.0.0.0", help="address the SuperLink listens on")
    s.add_argument("--port", type=int, default=9093, help="the SuperLink's port (Fleet, "
                   "Control and runtime APIs, HTTP)")
    s.add_argument("--home", default="runs/federate-server",
                   help="Flower's home, logs and the run's progress")
    s.add_argument("--ssl-ca-certfile", help="CA certificate (TLS; with the next two)")
    s.add_argument("--ssl-certfile", help="the SuperLink's certificate")
    s.add_argument("--ssl-keyfile", help="the SuperLink's private key")
    s.add_argument("--insecure", action="store_true", help="no TLS (a trusted network only)")
    s.add_argument("--authorized-key", action="append", default=[], metavar="PUB",
                   help="a SuperNode's OpenSSH ECDSA public key; given, only SuperNodes "
                   "holding one of these keys may join (needs TLS; repeatable)")
    s.add_argument("--sites", type=int, default=2, help="sites to wait for before round 1")
    s.set_defaults(func=_server)

    c = actions.add_parser("client", help="a site's SuperNode and ClientApp (on an edge host, "
                           "with the training extra; never on a board)", formatter_class=formatter)
    c.add_argument("--superlink", required=True, help="the server's HOST:PORT")
    c.add_argument("--data", help="the site's labelled dataset file or directory")
    c.add_argument("--experience", help="the edge's recorded experience directory")
    c.add_argument("--root-certificates", help="CA certificate to check the server's (TLS)")
    c.add_argument("--insecure", action="store_true", help="no TLS (a trusted network only)")
    c.add_argument("--auth-key", help="this SuperNode's private key (PEM), when the server "
                   "authenticates SuperNodes")
    c.add_argument("--home", default="runs/federate-client", help="Flower's home and logs")
    c.set_defaults(func=_client)


def _federation_options(p) -> None:
    p.add_argument("--bundle", help="the bundle to start from")
    p.add_argument("--out", help="where the new bundle goes (replaced if it exists)")
    p.add_argument("--strategy", default=D.strategy, choices=["fedavg", "dma"],
                   help="fedavg: average every round; dma: dynamic model averaging (sites "
                   "send only past a divergence threshold)")
    p.add_argument("--aggregate", default=D.aggregate, choices=list(AGGREGATES),
                   help="how the good replies combine: mean (weighted by capped example "
                   "counts), or coordinate-wise trimmed-mean or median (robust to a hostile site)")
    schedules = ", ".join(f"{s} {r} x {e:g}" + (" with SCAFFOLD" if scaffold else "")
                          for s, (r, e, scaffold) in SCHEDULES.items())
    schedules += " (fedavg --no-scaffold: {} x {:g})".format(*PLAIN_FEDAVG)
    p.add_argument("--rounds", type=int, default=0,
                   help=f"federated rounds (0: the strategy's own: {schedules})")
    p.add_argument("--epochs", type=float, default=0.0,
                   help="local epochs per round (0: the strategy's own)")
    p.add_argument("--lr", type=float, default=D.lr, help="learning rate of round 1 (cosine "
                   "decay over the rounds)")
    p.add_argument("--batch-size", type=int, default=D.batch_size, help="samples per step")
    p.add_argument("--proximal", type=float, default=D.proximal, metavar="MU",
                   help="FedProx: add MU/2 ||w - w_start||^2 to each site's loss, holding a "
                   "site with a skewed class mix near the round's shared model (0: none)")
    p.add_argument("--balance", type=float, default=D.balance, metavar="TAU",
                   help="logit adjustment for label skew (balanced softmax): each site adds "
                   "TAU * log(its class prior) to every exit's logits in its loss, so a site "
                   "holding few classes does not push the others down (default %(default)s; 0: the "
                   "plain loss; at most 4)")
    p.add_argument("--server-momentum", type=float, default=D.momentum, metavar="BETA",
                   help="fedavg: the server's step keeps BETA of its last one (FedAvgM; 0: "
                   "plain FedAvg)")
    p.add_argument("--scaffold", action=argparse.BooleanOptionalAction, default=None,
                   help="fedavg: SCAFFOLD's control variates correct each site's local steps by "
                   "the sites' mean gradient less its own, so several local epochs a round do "
                   "not drift toward the site's own classes (with the variates sent, each "
                   "round carries them too: about twice the bytes a round); default: on for "
                   "fedavg, which dma does not take")
    p.add_argument("--scaffold-variates", default=D.variates, choices=list(VARIATES),
                   help="fedavg with SCAFFOLD: sent (each site's mean gradient goes up and "
                   "the sites' combined one down, beside the models) or derived (option II: "
                   "each side derives them from the models it holds, so a round carries the "
                   "models alone; default %(default)s)")
    p.add_argument("--holdout", type=float, default=D.holdout,
                   help="share of each site's data held out to evaluate and calibrate (a "
                   "site with experience only holds out that share of a uniform sample of its "
                   "stream, labelled by the cloud's answers)")
    p.add_argument("--dma-threshold", type=float, default=D.threshold,
                   help="dma: relative squared divergence ||w-r||^2/||r||^2 that makes a "
                   "site send its model")
    p.add_argument("--dma-check-steps", type=int, default=D.check_steps,
                   help="dma: local steps between two divergence checks")
    p.add_argument("--min-sites", type=int, default=D.min_sites,
                   help="good replies a round needs to change the model")
    p.add_argument("--join-timeout", type=float, default=D.join_timeout,
                   help="seconds to wait for the sites before round 1")
    p.add_argument("--round-timeout", type=float, default=D.round_timeout,
                   help="seconds a round waits for the sites (a silent site is left out)")
    p.add_argument("--tolerance", type=float, default=D.tolerance,
                   help="calibrate the new version to lose at most this accuracy against its "
                   "best tier (default: the budget the starting bundle was calibrated by, a "
                   "tolerance or a byte budget)")
    p.add_argument("--agreement", type=float, default=D.agreement,
                   help="with --tolerance: the share of held-out frames (less the tolerance) "
                   "the chosen point must answer as the best tier does (0: accuracy alone; "
                   "default: the starting bundle's)")
    p.add_argument("--max-bytes", type=float, default=D.max_bytes,
                   help="calibrate the new version to the most accurate point within this "
                   "device uplink payload per frame (bytes) instead of a tolerance")
    p.add_argument("--threads", type=int, default=D.threads, help="torch threads per site")
    p.add_argument("--seed", type=int, default=D.seed, help="seeds splits and batches")
    p.add_argument("--model-version", default="", help="the new bundle's version (default: "
                   "the next after the starting bundle's)")
    p.add_argument("--key", help="sign the new bundle with this private key (as `ddnn bundle "
                   "sign` does)")
    p.add_argument("--json", action="store_true", help="print one JSON line at the end")


def _settings(args, work: str, wait_sites: int = 1) -> FederationSettings:
    from ddnn.errors import ConfigError

    if not args.bundle or not args.out:
        raise ConfigError("--bundle and --out are required")
    return FederationSettings(
        bundle=args.bundle, out=args.out, work=work, strategy=args.strategy,
        aggregate=args.aggregate,
        rounds=args.rounds, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
        proximal=args.proximal, balance=args.balance, momentum=args.server_momentum,
        scaffold=-1 if args.scaffold is None else int(args.scaffold),
        variates=args.scaffold_variates,
        holdout=args.holdout, seed=args.seed,
        threshold=args.dma_threshold, check_steps=args.dma_check_steps,
        min_sites=args.min_sites, wait_sites=wait_sites,
        join_timeout=args.join_timeout, round_timeout=args.round_timeout,
        tolerance=args.tolerance, agreement=args.agreement, max_bytes=args.max_bytes,
        threads=args.threads, version=args.model_version)


def _progress(args, rounds: int):
    def show(e: dict) -> None:
        if args.json:
            return
        acc = e.get("holdout_accuracy")
        acc_text = f"held-out accuracy {acc:.3f}" if acc is not None else "no held-out data"
        refused = f", refused {sorted(e['refused'])}" if e.get("refused") else ""
        print(f"round {e['round']}/{rounds}: {acc_text} (model it started from), "
              f"{e['replied']}/{e['sites']} sites, {e['sent_models']} sent a model, "
              f"sync {e['sync']}{refused}, {e['communicated_bytes'] / 1e6:.2f} MB so far, "
              f"{e['seconds']:.1f} s", file=sys.stderr, flush=True)
    return show


def _report(args, result: dict) -> int:
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "traceback"}))
        return 0
    ev = result.get("evaluation", {})
    acc = ev.get("accuracy", {})
    # Held-out experience is labelled by the cloud: there accuracy is agreement with it.
    taught = (f" ({ev['teacher_labelled']} labelled by the cloud's answers: agreement with it)"
              if ev.get("teacher_labelled") else "")
    print(f"bundle {result['bundle']} version {result['version']} written "
          f"({'signed' if result.get('signed') else 'unsigned'}); {result['rounds']} rounds, "
          f"{result['communicated_bytes'] / 1e6:.2f} MB exchanged; held-out accuracy "
          f"on {ev.get('samples', 0)} samples{taught}: "
          + ", ".join(f"{k} {v:.3f}" for k, v in acc.items())
          + (f"; answers at escalation level {result['escalation_level']}"
             if "escalation_level" in result else ""), file=sys.stderr)
    return 0


def _one_machine(args) -> int:
    from ddnn.errors import ConfigError
    from ddnn.models.federated.driver import (
        Site,
        run_on_one_machine,
        stopped_by_sigterm,
    )

    sites = [site_of(p) for p in args.site] + [Site(experience=p)
                                               for p in args.site_experience]
    if not sites:
        raise ConfigError("give at least one --site (or use `ddnn federate server|client`)")
    for site in sites:
        path = site.data or site.experience
        if not Path(path).exists():
            raise ConfigError(f"{path}: no such file or directory")
    s = _settings(args, work="")
    with stopped_by_sigterm():
        result = run_on_one_machine(s, sites, args.key, _progress(args, s.rounds))
    return _report(args, result)


def site_of(path: str):
    """``--site PATH``: a directory of recorded experience (``ddnn edge --experience``) is
    learnt from as such; anything else is a labelled dataset."""
    from ddnn.experience import chunks
    from ddnn.models.federated.driver import Site

    if Path(path).is_dir() and chunks(path):
        return Site(experience=path)
    return Site(data=path)


def _server(args) -> int:
    from ddnn.errors import ConfigError
    from ddnn.models.federated.deployment import Tls
    from ddnn.models.federated.driver import serve, stopped_by_sigterm

    tls = None
    if args.ssl_certfile or args.ssl_keyfile or args.ssl_ca_certfile:
        if not (args.ssl_certfile and args.ssl_keyfile and args.ssl_ca_certfile):
            raise ConfigError("TLS needs --ssl-ca-certfile, --ssl-certfile and --ssl-keyfile")
        tls = Tls(Path(args.ssl_ca_certfile), Path(args.ssl_certfile), Path(args.ssl_keyfile))
    elif not args.insecure:
        raise ConfigError("give the TLS files (--ssl-*) or --insecure")
    s = _settings(args, work="", wait_sites=args.sites)
    with stopped_by_sigterm():
        result = serve(s, args.host, args.port, Path(args.home), tls,
                       [Path(k) for k in args.authorized_key], args.key, _progress(args, s.rounds))
    return _report(args, result)


def _client(args) -> int:
    from ddnn.errors import ConfigError
    from ddnn.models.federated.driver import client, stopped_by_sigterm

    if not args.root_certificates and not args.insecure:
        raise ConfigError("give --root-certificates (TLS) or --insecure")
    ca = Path(args.root_certificates) if args.root_certificates else None
    try:
        with stopped_by_sigterm():
            return client(args.superlink, Path(args.home), args.data, args.experience, ca,
                          Path(args.auth_key) if args.auth_key else None)
    except KeyboardInterrupt:
        return 0
