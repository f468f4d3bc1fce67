"""Coverage-guided fuzzing of the envelope decoder with atheris (libFuzzer for Python).

Not part of the test suite (the property-based twin is ``tests/unit/test_envelope_fuzz.py``):

    pip install atheris
    python -m ddnn.benchmarks.fuzz_envelope --runs 200000   # bounded run, seeded corpus
    python -m ddnn.benchmarks.fuzz_envelope --runs 0 -- -max_len=4096  # forever, libFuzzer flags

The property: ``ddnn.envelope.decode`` (and ``Envelope.tensor`` on what it accepts) raises
:class:`ddnn.envelope.DecodeError` or returns a message that re-encodes to the same bytes;
anything else is a crash that libFuzzer reports with the input that caused it. The corpus starts
from one valid message of every type and codec, written to ``--corpus`` (default
``runs/fuzz_envelope``), which libFuzzer then grows with every input that reaches new code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def seed_corpus(directory: Path) -> Path:
    """One valid message of every type and codec, as libFuzzer's starting inputs."""
    import numpy as np

    from ddnn import envelope as env
    from ddnn.codec import CODECS
    from ddnn.envelope import MessageType

    directory.mkdir(parents=True, exist_ok=True)
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 4, 2, 2)
    for kind in MessageType:
        for codec in CODECS if kind != MessageType.ABSENT else [None]:
            msg = env.pack(kind, model="tiny", version="1", deployment="default", device="cam0",
                           frame=7, tensor=None if codec is None else x, codec=codec,
                           timestamp=1.7e9)
            (directory / f"seed-{kind.name.lower()}-{codec}").write_bytes(env.encode(msg))
    return directory


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m ddnn.benchmarks.fuzz_envelope",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100_000, help="inputs to try; 0 = until a crash")
    p.add_argument("--corpus", default="runs/fuzz_envelope", help="corpus directory (grows)")
    args = p.parse_args(argv)
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: pip install atheris", file=sys.stderr)
        return 2
    if "ddnn.envelope" in sys.modules:
        print("ddnn.envelope was imported before instrumentation", file=sys.stderr)
        return 2
    # Instrument first: a module imported before this block gives libFuzzer no coverage.
    with atheris.instrument_imports(include=["ddnn"]):
        from ddnn import envelope as env
        from ddnn.envelope import DecodeError
    import numpy as np

    flat = {"binary": lambda n: (n * 8,), "int8": lambda n: (max(n - 4, 0),),
            "float16": lambda n: (n // 2,), "float32": lambda n: (n // 4,),
            "bits2": lambda n: (n * 4,), "bits4": lambda n: (n * 2,)}

    corpus = seed_corpus(Path(args.corpus))

    def one_input(data: bytes) -> None:
        try:
            e = env.decode(data, now=1.7e9)
        except DecodeError:
            return
        if env.encode(e) != data:
            raise AssertionError("a decoded message does not re-encode to its bytes")
        if e.codec is not None:
            shape = flat[e.codec](len(e.payload))  # the receiver's bundle gives the shape
            try:
                x = e.tensor(shape)
            except DecodeError:
                return
            if x.shape != shape or not np.isfinite(x).all():
                raise AssertionError(f"tensor {x.shape} for shape {shape}, or not finite")

    runs = [f"-runs={args.runs}"] if args.runs > 0 else []
    atheris.Setup([sys.argv[0], *runs, *extra, str(corpus)], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
