"""``ddnn data import`` and ``ddnn data inspect``: bring your own multi-view images."""

from __future__ import annotations

import sys


def register(data_sub, formatter) -> None:
    imp = data_sub.add_parser(
        "import",
        help="import a folder of multi-view images into a dataset directory",
        description="One folder per sample with one image per view (cam0.png, cam1.png, ...; a "
        "missing file is an absent view). Labels come from class folders "
        "(ROOT/CLASS/SAMPLE/VIEW.png) or, with --labels, from a CSV 'sample,label' "
        "(ROOT/SAMPLE/VIEW.png). Writes uint8 arrays that training reads memory-mapped, so a "
        "set larger than memory trains.",
        formatter_class=formatter,
    )
    imp.add_argument("root", help="the folder to import")
    imp.add_argument("--out", required=True, help="dataset directory to create")
    imp.add_argument("--labels", default=None, help="CSV with a header 'sample,label'")
    imp.add_argument(
        "--views", default=None,
        help="comma-separated view names (file stems) in order (default: every name found)",
    )
    imp.add_argument("--size", type=int, default=None,
                     help="resize every image to SIZE x SIZE (default: all must match)")
    imp.set_defaults(func=_import)

    ins = data_sub.add_parser(
        "inspect",
        help="counts and a contact sheet of a few samples per class",
        formatter_class=formatter,
    )
    ins.add_argument("path", help="dataset .npz file or directory")
    ins.add_argument("--sheet", default=None, help="contact sheet PNG (default: PATH-sheet.png)")
    ins.add_argument("--per-class", type=int, default=4, help="samples shown per class")
    ins.set_defaults(func=_inspect)


def _import(args) -> int:
    from ddnn.models.importer import import_folder

    views = [v.strip() for v in args.views.split(",") if v.strip()] if args.views else None

    def progress(done: int, total: int) -> None:
        if done == total or done % 500 == 0:
            print(f"  {done}/{total} samples", file=sys.stderr)

    out = import_folder(args.root, args.out, args.labels, views, args.size, progress)
    from ddnn.dataset import load_dataset
    from ddnn.models.contact_sheet import summary

    ds = load_dataset(out, mmap=True)
    print(f"wrote {out}: " + "\n".join(summary(ds)), file=sys.stderr)
    return 0


def _inspect(args) -> int:
    from pathlib import Path

    from ddnn.dataset import load_dataset
    from ddnn.models.contact_sheet import summary, write_sheet

    ds = load_dataset(args.path, mmap=True)
    print(f"{args.path}: " + "\n".join(summary(ds)))
    sheet = args.sheet or f"{Path(args.path).with_suffix('')}-sheet.png"
    print(f"contact sheet: {write_sheet(ds, sheet, args.per_class)}")
    return 0
