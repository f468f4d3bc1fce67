"""``ddnn evaluate`` and ``ddnn data info``: commands needing only the contract and ORT."""

from __future__ import annotations

import json


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser(
        "evaluate",
        help="run a bundle over a labelled dataset with ONNX Runtime",
        description="Run every exit of a bundle over a dataset file with ONNX Runtime and report "
        "per-exit accuracy, exit fractions, uplink bytes per frame and the operating curve "
        "(--json); a raw-offload reference bundle reports its accuracy.",
        formatter_class=formatter,
    )
    p.add_argument("--bundle", required=True, help="bundle directory (from ddnn train)")
    p.add_argument("--data", required=True, help="dataset .npz file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--local-threshold",
        type=float,
        default=None,
        help="override the bundle's local exit threshold (0..1)",
    )
    p.add_argument(
        "--edge-threshold",
        type=float,
        default=None,
        help="override the bundle's edge exit threshold (0..1)",
    )
    p.add_argument(
        "--max-bytes",
        type=float,
        default=None,
        help="re-pick thresholds and escalation level for this uplink budget (payload bytes per "
        "frame) from the operating curve the bundle's calibration stored on held-out data",
    )
    p.add_argument(
        "--escalation-level",
        type=int,
        default=None,
        choices=[0, 1],
        help="override the bundle's escalation level (0: the cloud reads the edge features "
        "alone; 1: also every present view at reduced resolution)",
    )
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads per session")
    p.set_defaults(func=_evaluate)

    info = data_sub.add_parser("info", help="summarize a dataset file", formatter_class=formatter)
    info.add_argument("path", help="dataset .npz file or directory (ddnn data import)")
    info.set_defaults(func=_info)


def _evaluate(args) -> int:
    from ddnn.tools.evaluate import evaluate, format_table

    result = evaluate(
        args.bundle, args.data, args.local_threshold, args.edge_threshold, threads=args.threads,
        max_bytes=args.max_bytes, level=args.escalation_level,
    )
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def _info(args) -> int:
    import numpy as np

    from ddnn.dataset import load_dataset

    ds = load_dataset(args.path, mmap=True)  # counts only: a directory's images stay on disk
    present = ds.present
    counts = np.bincount(ds.label[ds.label >= 0], minlength=len(ds.classes))
    unseen = int((ds.label < 0).sum())
    print(f"{args.path}: {ds.num_samples} samples, {ds.num_views} views of {ds.image_shape}"
          + (f", {unseen} seen by no view (label -1)" if unseen else ""))
    print("classes: " + ", ".join(f"{c} ({n})" for c, n in zip(ds.classes, counts, strict=True)))
    print(
        f"present views per sample: mean {present.sum(1).mean():.2f}, "
        f"min {present.sum(1).min()}; per view: " + " ".join(f"{p:.2f}" for p in present.mean(0))
    )
    return 0
