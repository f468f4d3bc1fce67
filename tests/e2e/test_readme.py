"""The README's commands keep working: every `ddnn` line parses, the offline block runs."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ddnn.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)


def _commands(block: str) -> list[list[str]]:
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line]


def test_quick_start_is_two_make_targets_that_exist():
    quick = README.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", quick, re.S).group(1)
    commands = _commands(block)
    assert [c[:2] for c in commands] == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in ci and "make test-slow" in ci  # CI leaves no test out


@pytest.mark.parametrize(
    "argv", [c[1:] for b in BLOCKS for c in _commands(b) if c[0] == "ddnn"], ids=" ".join
)
def test_every_ddnn_command_in_the_readme_parses(argv):
    args = build_parser().parse_args(argv)
    assert callable(args.func)


def test_offline_block_runs(tmp_path):
    """The offline-side block, with smaller data and fewer epochs so the suite stays fast."""
    block = next(b for b in BLOCKS if "ddnn train" in b and "ddnn data synth" in b)
    for argv in _commands(block):
        assert argv[0] == "ddnn"
        argv = [re.sub(r"^(3000|1000)$", "120", a) for a in argv[1:]]
        if argv[0] == "train":
            argv += ["--epochs", "1", "--no-progress"]
        proc = subprocess.run([sys.executable, "-m", "ddnn", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"ddnn {' '.join(argv)}\n{proc.stderr[-2000:]}"
    assert (tmp_path / "bundles" / "mvmc" / "manifest.json").is_file()


@pytest.mark.parametrize("command", ["device", "edge", "cloud"])
def test_every_option_of_the_services_is_documented(command):
    """The configuration reference (docs/) names every option the service's --help lists."""
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    options = [s for a in sub._actions for s in a.option_strings if s.startswith("--")]
    undocumented = [o for o in options if o != "--help" and f"`{o}" not in docs]
    assert options and not undocumented, f"ddnn {command}: document {undocumented} in docs/"


def test_generated_docs_are_current():
    """The result schema and the options tables in docs/ match the code (ddnn.tools.docs)."""
    from ddnn.tools.docs import main

    assert main(["--check"]) == 0, "run: python -m ddnn.tools.docs"
