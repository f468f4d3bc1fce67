"""``ddnn data synth|import|inspect`` and ``ddnn train``: the offline side of the command line."""

from __future__ import annotations

import json
import sys
from argparse import SUPPRESS


def register(sub, data_sub, formatter) -> None:
    from ddnn.models import data_cli

    _register_synth(data_sub, formatter)
    data_cli.register(data_sub, formatter)
    _register_train(sub, formatter)


def _register_synth(data_sub, formatter) -> None:
    s = data_sub.add_parser(
        "synth",
        help="generate a multi-camera dataset file",
        description="Generate multi-camera scenes in the dataset layout (MVMC-like): V cameras "
        "around an object of one of C classes; views can be partial or absent.",
        formatter_class=formatter,
    )
    s.add_argument("--out", required=True, help="output .npz file")
    s.add_argument("--samples", type=int, default=2000, help="number of samples (scenes)")
    s.add_argument("--views", type=int, default=6, help="cameras per scene")
    s.add_argument("--classes", type=int, default=3, help="object classes")
    s.add_argument("--size", type=int, default=32, help="image height and width (>= 16)")
    s.add_argument("--seed", type=int, default=0, help="seed of the samples")
    s.add_argument(
        "--world-seed",
        type=int,
        default=0,
        help="seed of the class objects; keep it equal for train and test files",
    )
    s.add_argument(
        "--zoom",
        type=float,
        default=1.0,
        help="partial views: each camera ZOOM times closer, aimed at a random point of the "
        "object, so it sees only part of it (1: the whole object)",
    )
    _register_field_options(s)
    s.set_defaults(func=_synth)


def _register_field_options(s) -> None:
    """Field conditions: a drifted domain, and a non-IID split into one file per site."""
    s.add_argument("--drift", default="", metavar="KINDS",
                   help="a drifted domain, comma-separated: remount (cameras higher and "
                   "closer), lighting (warm, dim light), rotation (cameras a quarter turn "
                   "round), or all")
    s.add_argument("--sites", type=int, default=0, metavar="K",
                   help="write K files OUT-0.npz ... OUT-(K-1).npz, one per site, instead of OUT")
    s.add_argument("--non-iid", type=float, default=1.0, metavar="ALPHA",
                   help="with --sites: Dirichlet concentration of each class over the sites "
                   "(small: each site sees few classes)")


def _register_train(sub, formatter) -> None:
    from ddnn.models.config import DDNNConfig  # light: numpy and the contract only

    d = DDNNConfig()
    t = sub.add_parser(
        "train",
        help="train a DDNN and export a calibrated bundle",
        description="Train all exits jointly, export each segment to ONNX, check torch/ONNX "
        "parity, calibrate the exit thresholds on held-out data and write the bundle with a "
        "report (metrics.json and plots in BUNDLE/report).",
        formatter_class=formatter,
    )
    t.add_argument("--data", required=True, help="training dataset .npz")
    t.add_argument("--out", required=True, help="bundle directory to write (replaced if it exists)")
    t.add_argument(
        "--val",
        default=None,
        help="held-out dataset for calibration (default: split off --val-fraction)",
    )
    t.add_argument("--name", default="ddnn", help="model name (lowercase; used in topics and URLs)")
    t.add_argument("--model-version", default="1", help="model version string")
    _register_architecture(t, d)
    t.add_argument("--epochs", type=int, default=d.epochs, help="training epochs")
    t.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per step")
    t.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
    t.add_argument(
        "--tolerance",
        type=float,
        default=d.tolerance,
        help="calibration budget: accuracy the hierarchy may lose against its best tier on "
        "held-out data; the cheapest operating point within it is chosen",
    )
    t.add_argument(
        "--agreement",
        type=float,
        default=d.agreement,
        help="with --tolerance: the share of held-out frames (less the tolerance) on which the "
        "chosen point must answer as the best tier does (1: every frame; 0: accuracy alone)",
    )
    t.add_argument(
        "--max-bytes",
        type=float,
        default=None,
        help="calibration budget instead: device uplink payload bytes per frame; the most "
        "accurate operating point within it on held-out data is chosen",
    )
    t.add_argument(
        "--no-stacking",
        action="store_true",
        help="every upper exit answers on its own, not stacked on the answer of the tier below "
        "it (stacking weights are fitted on held-out data; docs/training.md)",
    )
    t.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="share of --data held out when --val is not given",
    )
    _register_training_extras(t, d)
    t.add_argument("--seed", type=int, default=d.seed, help="seed of split, init and batches")
    t.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    t.add_argument("--json", action="store_true", help="print the training metrics as JSON")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t.set_defaults(func=_train)


def _register_architecture(t, d) -> None:
    """Architecture flags; left out, each takes the default (or --paper's value)."""
    from ddnn.models.config import DEVICE_CODECS, EDGE_CODECS

    t.add_argument("--paper", action="store_true",
                   help="the paper's network (the defaults before docs/training.md's changes): "
                   "one binarized ConvP block of 4 filters per device, linear device exit, "
                   "MP-AP, binary edge features; other flags still apply on top")
    t.add_argument("--deep-device", action="store_true",
                   help="a device as deep as a Raspberry Pi-class board affords: double-conv "
                   "stem blocks of 32 and 64 filters, 64 binary features a cell, no escalation "
                   "(about 210 KB a device; docs/training.md, 'A deep device'); other flags "
                   "still apply on top")
    t.add_argument("--scheme", default=SUPPRESS,
                   help=f"aggregation scheme: AP-CC, MP-CC, MP-AP, MP, AP, CC, ... "
                   f"(default: {d.scheme})")
    t.add_argument("--device-filters", type=int, default=SUPPRESS,
                   help=f"filters of the device block whose features travel "
                   f"(default: {d.device_filters})")
    t.add_argument("--device-stem", default=SUPPRESS,
                   help="float ConvP blocks before it, comma-separated filter counts, '' for "
                   f"none (default: {','.join(map(str, d.device_stem))})")
    t.add_argument("--device-convs", type=int, default=SUPPRESS, choices=[1, 2, 3],
                   help="3x3 convolutions in each device stem block before its pool "
                   f"(default: {d.device_convs}; 2 with --deep-device)")
    t.add_argument("--device-codec", default=SUPPRESS, choices=list(DEVICE_CODECS),
                   help=f"how device features travel (default: {d.device_codec})")
    t.add_argument("--float-device", action="store_true",
                   help="float ReLU device features sent as float16 (--device-codec float16)")
    t.add_argument("--binary-weights", action="store_true",
                   help="binarized (+-1) device conv weights, as the paper's eBNN devices")
    t.add_argument("--device-exit-pool", type=int, default=SUPPRESS,
                   help=f"device exit reads its input pooled to K x K (0: whole map; default: "
                   f"{d.device_exit_pool})")
    t.add_argument("--device-scores", default=SUPPRESS, choices=["logits", "logprobs"],
                   help=f"what devices send for the local exit (default: {d.device_scores})")
    t.add_argument("--per-view-devices", action="store_true",
                   help="train one device segment per view (the paper) instead of one shared")
    t.add_argument("--edge-filters", type=int, default=SUPPRESS,
                   help=f"edge conv filters (default: {d.edge_filters})")
    t.add_argument("--edge-codec", default=SUPPRESS, choices=list(EDGE_CODECS),
                   help=f"how edge features travel to the cloud (default: {d.edge_codec})")
    t.add_argument("--early-fusion", action="store_true",
                   help="with a *-CC scheme, one edge block on the concatenated views (the "
                   "paper) instead of one per view pooled over the views")
    t.add_argument("--cloud-filters", default=SUPPRESS,
                   help="filters of each cloud ConvP block, comma-separated (deeper: more; "
                   f"default: {','.join(map(str, d.cloud_filters))})")
    t.add_argument("--escalate", default=SUPPRESS, choices=["view", "stem", "none"],
                   help="the detail the cloud reads besides the edge features for a frame "
                   "still unsure after the edge exit, from every present camera: 'view', its "
                   "image at reduced resolution; 'stem', its stem's activations; 'none': no "
                   f"escalated cloud (default: {d.escalate})")
    t.add_argument("--escalate-pool", type=int, default=SUPPRESS,
                   help=f"the view's reduction, K x K average pooling (default: "
                   f"{d.escalate_pool})")
    t.add_argument("--escalate-bits", type=int, default=SUPPRESS, choices=[8, 4, 2, 1],
                   help=f"bits a detail value travels with (default: {d.escalate_bits})")
    t.add_argument("--escalate-views", type=int, default=SUPPRESS,
                   help="escalate the details of only the K present views whose devices are "
                   f"surest (0: every present view; default: {d.escalate_views})")
    t.add_argument("--escalate-widths", default=SUPPRESS,
                   help="double-conv blocks of the cloud's CNN on the details, comma-separated "
                   f"(default: {','.join(map(str, d.escalate_widths))})")


def _architecture(args) -> dict:
    """The DDNNConfig fields the architecture flags ask for (None: not given)."""
    def ints(text):
        return None if text is None else tuple(int(f) for f in text.split(",") if f.strip())

    given = vars(args)
    arch = {
        "scheme": given.get("scheme"),
        "device_filters": given.get("device_filters"),
        "device_stem": ints(given.get("device_stem")),
        "device_convs": given.get("device_convs"),
        "device_codec": "float16" if args.float_device else given.get("device_codec"),
        "device_binary": True if args.binary_weights else None,
        "device_exit_pool": given.get("device_exit_pool"),
        "device_scores": given.get("device_scores"),
        "share_device_weights": False if args.per_view_devices else None,
        "edge_filters": given.get("edge_filters"),
        "edge_codec": given.get("edge_codec"),
        "edge_per_view": False if args.early_fusion else None,
        "cloud_filters": ints(given.get("cloud_filters")),
        "escalate": given.get("escalate"),
        "escalate_pool": given.get("escalate_pool"),
        "escalate_bits": given.get("escalate_bits"),
        "escalate_views": given.get("escalate_views"),
        "escalate_widths": ints(given.get("escalate_widths")),
    }
    return {k: v for k, v in arch.items() if v is not None}


def _register_training_extras(t, d) -> None:
    t.add_argument("--baseline", action="store_true",
                   help="train the raw-offload reference instead (a float CNN on the full "
                   "images of every present view): OUT becomes a bundle of kind 'raw'")
    t.add_argument("--test", default=None, help="with --baseline: also report accuracy on this")
    t.add_argument("--distill", type=float, default=d.distill,
                   help="weight of online distillation from the cloud exit (0: off)")
    t.add_argument("--teacher", default=None, metavar="BUNDLE",
                   help="a raw-offload bundle (--baseline) whose answers every exit also "
                   "learns from (knowledge distillation)")
    t.add_argument("--teacher-weight", type=float, default=d.teacher_weight,
                   help="weight of the teacher's distillation loss")
    t.add_argument("--distill-device", action="store_true",
                   help="distillation teaches the device exits too (the paper preset does)")
    t.add_argument("--lowres-epochs", type=int, default=d.lowres_epochs,
                   help="incremental low-to-high resolution training: the first N epochs see "
                   "the views at half resolution (0: off)")
    t.add_argument("--no-augment", action="store_true",
                   help="no shift, brightness or view-dropout augmentation")
    t.add_argument("--schedule", default=d.schedule, choices=["cosine", "onecycle", "constant"],
                   help="learning-rate schedule")
    t.add_argument("--patience", type=int, default=d.patience,
                   help="stop after this many epochs without improvement (0: never early)")
    t.add_argument("--stop-fraction", type=float, default=d.stop_fraction,
                   help="share of --data held out to pick the epoch (never used to calibrate)")
    t.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                   help="torch device (auto: CUDA when present)")
    t.add_argument("--no-amp", action="store_true", help="no mixed precision on CUDA")
    t.add_argument("--cpu-amp", action="store_true",
                   help="bf16 autocast on the CPU (fast on CPUs with bf16 instructions)")
    t.add_argument("--comm-hook", default=d.comm_hook, choices=["none", "fp16", "powersgd"],
                   help="gradient compression between torchrun processes")
    t.add_argument("--checkpoint", default=None,
                   help="checkpoint file written every epoch (by rank 0)")
    t.add_argument("--resume", action="store_true", help="continue from --checkpoint if present")


def _synth(args) -> int:
    from ddnn.models.synth import (
        SceneConfig,
        apply_drift,
        drifted_config,
        save_dataset,
        synthesize,
    )

    cfg = SceneConfig(
        views=args.views, classes=args.classes, size=args.size, world_seed=args.world_seed,
        zoom=args.zoom,
    )
    drifts = _drifts(args.drift)
    cfg = drifted_config(cfg, drifts)
    data = apply_drift(synthesize(args.samples, cfg, seed=args.seed), drifts)
    if args.sites:
        return _write_sites(args, data)
    save_dataset(args.out, data)
    present = (data["y"] >= 0).sum(1).mean()
    print(
        f"wrote {args.out}: {args.samples} samples, {args.views} views of {args.size}x"
        f"{args.size}, {args.classes} classes, {present:.2f} views present per sample",
        file=sys.stderr,
    )
    return 0


def _drifts(text: str) -> tuple[str, ...]:
    from ddnn.errors import ConfigError
    from ddnn.models.synth import DRIFTS

    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    kinds = DRIFTS if kinds == ("all",) else kinds
    if set(kinds) - set(DRIFTS):
        raise ConfigError(f"--drift takes {', '.join(DRIFTS)} or all, got {text!r}")
    return kinds


def _write_sites(args, data) -> int:
    from pathlib import Path

    import numpy as np

    from ddnn.errors import ConfigError
    from ddnn.models.synth import save_dataset, split_sites

    if args.sites < 1 or args.non_iid <= 0:
        raise ConfigError("--sites must be >= 1 and --non-iid > 0")
    out = Path(args.out)
    for i, part in enumerate(split_sites(data, args.sites, args.non_iid, args.seed)):
        path = out.with_name(f"{out.stem}-{i}{out.suffix or '.npz'}")
        save_dataset(path, part)
        counts = np.bincount(part["label"], minlength=args.classes).tolist()
        print(f"wrote {path}: {len(part['label'])} samples, per class {counts}", file=sys.stderr)
    return 0


def _baseline(args, cfg) -> int:
    from ddnn.models.baseline import build_baseline

    metrics = build_baseline(args.data, args.out, cfg, args.val, args.test,
                             progress=not args.no_progress, name=args.name,
                             version=args.model_version)
    if metrics is None:
        return 0
    if args.json:
        print(json.dumps(metrics))
    else:
        test = f", test {metrics['test_accuracy']:.3f}" if "test_accuracy" in metrics else ""
        print(f"raw-offload reference bundle written to {args.out}: held-out accuracy "
              f"{metrics['val_accuracy']:.3f}{test} ({metrics['seconds']:.0f} s)", file=sys.stderr)
    return 0


def _config(args):
    """The DDNNConfig of ``ddnn train``'s arguments."""
    from ddnn.errors import ConfigError
    from ddnn.models.config import DDNNConfig

    if args.teacher and args.baseline:
        raise ConfigError("--teacher teaches a hierarchy; the reference (--baseline) learns "
                          "from the labels alone")
    if args.teacher and args.teacher_weight == 0:
        raise ConfigError("--teacher with --teacher-weight 0 would run the teacher for nothing")
    arch = _architecture(args)
    if args.distill_device:
        arch["distill_device"] = True
    if args.paper and args.deep_device:
        raise ConfigError("--paper and --deep-device are two different networks: choose one")
    preset = (DDNNConfig.paper if args.paper
              else DDNNConfig.deep_device if args.deep_device else DDNNConfig)
    return preset(
        **arch,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        tolerance=args.tolerance,
        agreement=args.agreement,
        max_bytes=args.max_bytes,
        stack_exits=not args.no_stacking,
        val_fraction=args.val_fraction,
        seed=args.seed,
        threads=args.threads,
        distill=args.distill,
        teacher_weight=args.teacher_weight,
        lowres_epochs=args.lowres_epochs,
        augment=not args.no_augment,
        schedule=args.schedule,
        patience=args.patience,
        stop_fraction=args.stop_fraction,
        device=args.device,
        amp=not args.no_amp,
        cpu_amp=args.cpu_amp,
        comm_hook=args.comm_hook,
    )


def _train(args) -> int:
    from ddnn.models.build import build_bundle

    cfg = _config(args)
    if args.baseline:
        return _baseline(args, cfg)
    log = (lambda *a, **k: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    metrics = build_bundle(
        args.data,
        args.out,
        cfg,
        val_data=args.val,
        name=args.name,
        version=args.model_version,
        progress=not args.no_progress,
        log=log,
        checkpoint=args.checkpoint,
        resume=args.resume,
        teacher=args.teacher,
    )
    if metrics is None:  # a torchrun process other than rank 0: rank 0 reports
        return 0
    if args.json:
        print(json.dumps({k: v for k, v in metrics.items() if k != "history"}))
        return 0
    v, cal = metrics["validation"], metrics["calibration"]
    print(f"bundle written to {args.out} (report in {args.out}/report)", file=sys.stderr)
    print(
        f"held-out accuracy: device {v['accuracy']['device']:.3f}, local "
        f"{v['accuracy']['local']:.3f}, edge {v['accuracy']['edge']:.3f}, cloud "
        f"{v['accuracy']['cloud']:.3f}, overall {v['accuracy']['overall']:.3f}",
        file=sys.stderr,
    )
    print(
        f"thresholds: local {cal['thresholds']['local']:.3f}, edge "
        f"{cal['thresholds']['edge']:.3f}; exits: local {v['exit_fraction']['local']:.2f}, "
        f"edge {v['exit_fraction']['edge']:.2f}, cloud {v['exit_fraction']['cloud']:.2f}",
        file=sys.stderr,
    )
    from ddnn.stacking import summary_line

    if stacked := summary_line(v):
        print(stacked, file=sys.stderr)
    b = v["bytes_per_frame"]
    level = f"escalation level {cal['escalation_level']}, " if "escalation" in v else ""
    print(f"{level}uplink bytes per frame {b['ddnn']:.0f} against {b['raw_offload']:.0f} for raw "
          f"offload (held-out)", file=sys.stderr)
    return 0
