"""The runtime tiers and the contract run on a machine without torch or onnx."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Any import of these fails inside the child, as on a board where they are not installed.
BLOCK = (
    "import sys\n"
    "for m in ('torch', 'onnx', 'onnxscript', 'ddnn.models'):\n"
    "    sys.modules[m] = None\n"
)


def _run(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        **kw,
    )


def test_device_segment_and_hierarchy_run_without_torch(tiny_bundle, tiny_data):
    proc = _run(f"""
        import numpy as np
        from ddnn.dataset import load_dataset
        from ddnn.tools.evaluate import evaluate
        from ddnn.runtime import BundleRuntime
        from ddnn.bundle import load_bundle
        ds = load_dataset({str(tiny_data.test)!r})
        rt = BundleRuntime(load_bundle({str(tiny_bundle)!r}))
        scores, feats = rt.device(0, ds.X[:4, 0])
        assert scores.shape == (4, 3) and set(np.unique(feats)) <= {{-1.0, 1.0}}
        print(evaluate({str(tiny_bundle)!r}, {str(tiny_data.test)!r})["samples"])
        assert "torch" not in sys.modules or sys.modules["torch"] is None
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "120"


def test_tier_commands_import_without_torch():
    proc = _run("""
        import importlib
        for name in ("ddnn", "ddnn.cli", "ddnn.runtime", "ddnn.tools.evaluate",
                     "ddnn.tools.broker"):
            importlib.import_module(name)
        for name in ("ddnn.device.cli", "ddnn.edge.cli", "ddnn.cloud.cli"):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != name and e.name != name.split(".")[0]:
                    raise
        from ddnn.cli import main
        main(["--help"])
    """)
    assert proc.returncode == 0, proc.stderr
    assert "evaluate" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_device_extra_installs_and_runs_in_a_fresh_venv(tiny_bundle, tmp_path):
    """pip install '.[device]' into an empty venv: no torch, no onnx, and the segment runs."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{ROOT}[device]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if install.returncode != 0:
        pytest.fail(f"pip install .[device] failed:\n{install.stderr[-3000:]}")
    check = subprocess.run(
        [
            str(py),
            "-c",
            textwrap.dedent(f"""
            import importlib.metadata, importlib.util, numpy as np
            for heavy in ("torch", "onnx", "fastapi", "uvicorn"):
                assert importlib.util.find_spec(heavy) is None, heavy + " was installed"
            # One top-level package from this distribution: no `device`, `cloud` or `models`.
            files = importlib.metadata.distribution("ddnn").files
            top = {{f.parts[0] for f in files if f.suffix == ".py" and len(f.parts) > 1}}
            assert top == {{"ddnn"}}, top
            for name in ("device", "edge", "cloud", "models", "benchmarks"):
                assert importlib.util.find_spec(name) is None, name + " is a top-level package"
            import ddnn.device.cli
            from ddnn.bundle import load_bundle
            from ddnn.runtime import BundleRuntime
            rt = BundleRuntime(load_bundle({str(tiny_bundle)!r}))
            s, f = rt.device(0, np.zeros((1, 3, 16, 16), np.float32))
            print(s.shape, f.shape)
        """),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "(1, 3) (1, 4, 8, 8)"
    helped = subprocess.run([str(venv / "bin" / "ddnn"), "device", "--help"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "--bundle" in helped.stdout and "--broker" in helped.stdout
