"""``ddnn data synth|import|inspect`` and ``ddnn train``: the offline side of the command line."""

from __future__ import annotations

import json
import sys
import textwrap


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
                   "round), noise (worn, high-gain sensors: stronger pixel noise), or all "
                   "(remount, lighting and rotation)")
    s.add_argument("--sites", type=int, default=0, metavar="K",
                   help="write K files OUT-0.npz ... OUT-(K-1).npz, one per site, instead of OUT")
    s.add_argument("--non-iid", type=float, default=1.0, metavar="ALPHA",
                   help="with --sites: Dirichlet concentration of each class over the sites "
                   "(small: each site sees few classes)")


def _register_train(sub, formatter) -> None:
    from ddnn.models import train_options
    from ddnn.models.presets import DEFAULT_PRESET, PRESETS

    presets = "\n".join(textwrap.fill(p.summary, 78, initial_indent=f"  {p.name:<7}",
                                       subsequent_indent=" " * 9) for p in PRESETS.values())
    t = sub.add_parser(
        "train",
        help="train a DDNN and export a calibrated bundle",
        description=textwrap.fill(
            "Train all exits jointly, export each segment to ONNX, check torch/ONNX parity, "
            "calibrate the exit thresholds on held-out data and write the bundle with a report "
            "(metrics.json, config.toml and plots in BUNDLE/report).", 80)
        + f"\n\nPresets (--preset; default {DEFAULT_PRESET}):\n{presets}\n\n"
        + textwrap.fill(
            "A configuration resolves as: defaults < preset < --config FILE.toml < flags; "
            "--print-config prints it as a config file (docs/training.md, 'Presets and "
            "config files'). The common options come first, the rest by concern.", 80),
        formatter_class=formatter,
    )
    t.add_argument("--data", help="training dataset .npz")
    t.add_argument("--out", help="bundle directory to write (replaced if it exists)")
    train_options.add_common(t)
    t.add_argument(
        "--val",
        default=None,
        help="held-out dataset for calibration (default: split off --val-fraction)",
    )
    t.add_argument("--baseline", action="store_true",
                   help="train the raw-offload reference instead (a float CNN on the full "
                   "images of every present view): OUT becomes a bundle of kind 'raw'")
    t.add_argument("--test", default=None, help="with --baseline: also report accuracy on this")
    t.add_argument("--name", default="ddnn", help="model name (lowercase; used in topics and URLs)")
    t.add_argument("--model-version", default="1", help="model version string")
    t.add_argument("--json", action="store_true", help="print the training metrics as JSON")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train_options.add_groups(t)
    t.set_defaults(func=_train)


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
    from ddnn.models.synth import DRIFT_KINDS, DRIFTS

    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    kinds = DRIFTS if kinds == ("all",) else kinds
    if set(kinds) - set(DRIFT_KINDS):
        raise ConfigError(f"--drift takes {', '.join(DRIFT_KINDS)} or all, got {text!r}")
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
    """The DDNNConfig of ``ddnn train``'s arguments (ddnn.models.train_options.resolve)."""
    from ddnn.errors import ConfigError
    from ddnn.models.train_options import resolve

    if args.teacher and args.baseline:
        raise ConfigError("--teacher teaches a hierarchy; the reference (--baseline) learns "
                          "from the labels alone")
    cfg = resolve(args)
    if args.teacher and cfg.training.teacher_weight == 0:
        raise ConfigError("--teacher with --teacher-weight 0 would run the teacher for nothing")
    return cfg


def _print_config(args, cfg) -> int:
    from ddnn.models.config_file import to_toml
    from ddnn.models.train_options import preset_name

    source = f"preset {preset_name(args)}" + (f", {args.config}" if args.config else "")
    print(to_toml(cfg, f"ddnn train configuration ({source}, flags); "
                       "ddnn train --config FILE.toml reads it back"), end="")
    return 0


def _train(args) -> int:
    from ddnn.errors import ConfigError
    from ddnn.models.build import build_bundle

    cfg = _config(args)
    if args.print_config:
        return _print_config(args, cfg)
    if not (args.data and args.out):
        raise ConfigError("ddnn train needs --data and --out (or --print-config)")
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
