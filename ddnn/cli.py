"""The ``ddnn`` command line (also ``python -m ddnn``).

Each subcommand lives with the tier that implements it and is found here by module name, so
``ddnn device`` never imports torch and ``ddnn train`` never imports FastAPI. A command module
exposes ``register(subparsers)``, which adds its parser and sets ``func`` to a function taking
the parsed arguments and returning an exit code. Modules import their heavy dependencies inside
that function, keeping ``ddnn --help`` fast on a board.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ddnn import __version__
from ddnn.errors import DdnnError

# Order is the order of the help text. A module missing from this install (a tier whose extra
# is not installed) is left out of the help rather than breaking the others.
COMMAND_MODULES = (
    "ddnn.models.cli",  # data synth, train
    "ddnn.tools.commands",  # data info, evaluate
    "ddnn.tools.bundle_cli",  # bundle keygen, sign, verify
    "ddnn.device.cli",
    "ddnn.device.gateway.cli",
    "ddnn.edge.cli",
    "ddnn.cloud.cli",
    "ddnn.tools.demo",
    "ddnn.tools.announce",  # announce (over-the-air bundle updates)
    "ddnn.models.federated.cli",  # federate (Flower)
    "ddnn.benchmarks.cli",
)


# Third-party packages a command may import only when it runs, and the extra that brings each.
EXTRA_OF = {
    "onnxruntime": "device", "paho": "device", "fastapi": "cloud", "uvicorn": "cloud",
    "prometheus_client": "device", "urllib3": "device", "PIL": "device",
    "torch": "train", "onnx": "train", "onnxscript": "train",
    "tqdm": "train", "matplotlib": "train", "cryptography": "sign",
    "flwr": "federate",
}

COMMAND_EXTRAS = {"device": "device", "gateway": "device", "edge": "edge", "cloud": "cloud",
                  "train": "train", "demo": "device,edge,cloud,train",
                  "federate": "train,federate"}


def missing_package_message(e: ModuleNotFoundError, command: str | None = None) -> str | None:
    """A one-line fix for a missing optional package, or None when it is not one of ours."""
    top = (e.name or "").split(".")[0]
    if top not in EXTRA_OF:
        return None
    # The command's own extras bring everything it needs (onnxruntime is in three of them);
    # signing is an option of every tier, so it has its own.
    extra = EXTRA_OF[top]
    if top != "cryptography":
        extra = COMMAND_EXTRAS.get(command or "", extra)
    fix = f"pip install 'ddnn[{extra}]'"
    if top == "torch":  # an unpinned torch would pull the multi-GB CUDA build
        fix = f"pip install torch==2.13.0, then {fix}"
    return f"this command needs the package {top!r}, which is not installed: {fix}"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddnn",
        description="Distributed deep neural network inference over devices, edge and cloud.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"ddnn {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("DDNN_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (env DDNN_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    data = sub.add_parser("data", help="make or inspect dataset files", formatter_class=_Formatter)
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION")
    data.set_defaults(func=lambda _args: _usage(data))
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # A tier left out of this install (the module or a package above it) hides its
            # command; any other error is a bug.
            if not e.name or not (name == e.name or name.startswith(e.name + ".")):
                raise
            continue
        module.register(sub, data_sub, _Formatter)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        return _usage(parser)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except DdnnError as e:
        print(f"ddnn: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    except ModuleNotFoundError as e:
        message = missing_package_message(e, getattr(args, "command", None))
        if message is None:  # one of our own modules: a broken install or a bug, not user error
            raise
        print(f"ddnn: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ddnn: interrupted", file=sys.stderr)
        return 130
