"""Generated parts of the docs, kept in step with the code: ``python -m ddnn.tools.docs``.

- ``docs/result.schema.json``: the JSON schema of a result (:func:`ddnn.result.json_schema`);
- the options tables of ``ddnn device``, ``ddnn gateway``, ``ddnn edge`` and ``ddnn cloud``,
  between ``<!-- options:NAME -->`` and ``<!-- /options:NAME -->`` in the docs, from each
  command's options table (``OPTIONS`` beside its settings class);
- the device budget, between ``<!-- device-budget -->`` and ``<!-- /device-budget -->``, from
  :mod:`ddnn.benchmarks.device_budget` (what the footprint benchmark checks).

``--check`` writes nothing and exits 1 when a generated part is stale (the tests run it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

from ddnn.plumbing.options import markdown_table
from ddnn.result import json_schema

DOCS = Path(__file__).resolve().parents[2] / "docs"
# command -> (module, settings class); the module also holds OPTIONS and ENV_PREFIX
TIERS = {"device": ("ddnn.device.settings", "DeviceSettings"),
         "gateway": ("ddnn.device.gateway.settings", "GatewaySettings"),
         "edge": ("ddnn.edge.settings", "EdgeSettings"),
         "cloud": ("ddnn.cloud.settings", "CloudSettings")}


def options_table(tier: str) -> str:
    name, settings = TIERS[tier]
    module = importlib.import_module(name)
    return markdown_table(module.OPTIONS, getattr(module, settings), module.ENV_PREFIX)


def generated(docs: Path = DOCS) -> dict[Path, str]:
    """Every generated file's path and the text it should have."""
    out = {docs / "result.schema.json": json.dumps(json_schema(), indent=2) + "\n"}
    for page in sorted(docs.glob("*.md")):
        text = original = page.read_text()
        for tier in TIERS:
            pattern = re.compile(rf"(<!-- options:{tier} -->\n).*?(<!-- /options:{tier} -->)",
                                 re.S)
            if pattern.search(text):
                table = options_table(tier)
                text = pattern.sub(lambda m, t=table: m.group(1) + t + m.group(2), text)
        budget = re.compile(r"(<!-- device-budget -->\n).*?(<!-- /device-budget -->)", re.S)
        if budget.search(text):
            from ddnn.benchmarks.device_budget import markdown_table

            table = markdown_table()
            text = budget.sub(lambda m, t=table: m.group(1) + t + m.group(2), text)
        if text != original:
            out[page] = text
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddnn.tools.docs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if a generated part is stale")
    args = p.parse_args(argv)
    stale = [path for path, text in generated().items()
             if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path} (run python -m ddnn.tools.docs)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated().items():
        if path in stale:
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
