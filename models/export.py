"""Export a trained DDNN to a bundle: one ONNX file per segment plus ``manifest.json``.

The export is checked before it is published: every exit computed by ONNX Runtime through the
bundle (``ddnn.runtime``, exactly what the tiers run) is compared with torch on held-out data.
The bundle is written to a temporary directory beside the target and renamed into place, so a
model repository watched by the cloud never sees a half-written bundle.
"""

from __future__ import annotations

import datetime as dt
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddnn.bundle import Manifest, check_name, load_bundle
from ddnn.bundle import write_manifest as _write_manifest
from ddnn.dataset import MultiViewDataset
from ddnn.errors import BundleError
from ddnn.models.network import DDNN, aggregate, folded_pairs
from ddnn.runtime import BundleRuntime
from ddnn.segment import BATCH, SegmentSpec, TensorSpec, sha256_file
from ddnn.stacking import Stacking

OPSET = 17
# Logits may differ by float rounding between torch and ONNX Runtime; a sign activation turns a
# rounding difference at exactly 0 into a flipped bit, so a few flipped predictions are tolerated.
PARITY_ATOL = 1e-3
PARITY_MAX_DISAGREE = 0.01
DEVICE_OUTPUTS = ("scores", "features", "detail")  # "detail": where the network escalates


def _export(
    module: nn.Module, inputs: dict[str, torch.Tensor], outputs: list[str], path: Path
) -> None:
    names = list(inputs)
    axes = {n: {0: BATCH} for n in names + outputs}
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of torch.export, but it handles these
        # small static graphs faster and without extra dependencies.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            tuple(inputs.values()),
            str(path),
            input_names=names,
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )


def round_float16(module: nn.Module) -> None:
    """Round a module's float weights and statistics to float16 values, in place: what
    :func:`store_float16` keeps of them, so torch and the file compute the same."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.copy_(t.half().float())


def fold_batch_norms(module: nn.Module) -> None:
    """Fold each batch norm that directly follows a float convolution (a double-conv block's
    first convolutions) into that convolution, in place, for evaluation.

    The ONNX export folds them anyway; folded here first, the product is rounded to float16 by
    :func:`round_float16` once, the same in torch and in the file. (Folded by the export after
    rounding, it was rounded again by :func:`store_float16`: torch and the file then differed by
    float16 rounding, enough to flip a few sign features of a deep device and fail the parity
    check.) Each batch norm keeps its place with unit scale and variance, zero mean and no
    epsilon, its shift the folded bias: exact in evaluation, and the export folds it exactly.
    """
    with torch.no_grad():
        for _, conv, _, bn in folded_pairs(module):
            scale = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
            shift = bn.bias.double() - bn.running_mean.double() * scale
            if conv.bias is not None:
                shift = shift + conv.bias.double() * scale
                conv.bias.zero_()
            conv.weight.copy_(conv.weight.double() * scale[:, None, None, None])
            bn.weight.fill_(1.0)
            bn.bias.copy_(shift)
            bn.running_mean.zero_()
            bn.running_var.fill_(1.0)
            bn.eps = 0.0


def store_float16(path: Path) -> None:
    """Rewrite an ONNX file with its float32 weights stored as float16, each read through a
    ``Cast`` back to float32: half the bytes on the board and over the air, the same float32
    arithmetic (ONNX Runtime folds the casts into float32 weights when it loads the file).
    Exact for weights already folded by :func:`fold_batch_norms` and rounded by
    :func:`round_float16`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inputs = {i.name for i in graph.input}
    kept, casts = [], []
    for init in graph.initializer:
        if init.data_type != TensorProto.FLOAT or init.name in inputs:
            kept.append(init)
            continue
        values = numpy_helper.to_array(init)
        if np.abs(values).max(initial=0.0) > np.finfo(np.float16).max:
            raise BundleError(f"{path.name}: {init.name} holds values beyond float16's range")
        half = numpy_helper.from_array(values.astype(np.float16), f"{init.name}.f16")
        kept.append(half)
        casts.append(helper.make_node("Cast", [half.name], [init.name], to=TensorProto.FLOAT))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = [*casts, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _spec(
    path: Path, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]
) -> SegmentSpec:
    def tensors(d: dict[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(n, (BATCH, *t.shape[1:]), "float32") for n, t in d.items())

    return SegmentSpec(path.name, sha256_file(path), tensors(inputs), tensors(outputs),
                       path.stat().st_size)


@dataclass(frozen=True)
class ParityReport:
    """Largest logit difference and share of disagreeing predictions, per exit."""

    max_abs_diff: dict[str, float]
    disagreement: dict[str, float]

    def to_dict(self) -> dict:
        return {"max_abs_diff": self.max_abs_diff, "disagreement": self.disagreement}


def check_parity(
    torch_logits: dict[str, np.ndarray], onnx_logits: dict[str, np.ndarray], present: np.ndarray
) -> ParityReport:
    """Compare every exit; raise :class:`BundleError` when ONNX disagrees with torch.

    The build and the federated rebuild pass ``onnx_logits`` from exact links
    (:func:`onnx_exits` with ``exact_links``): the wire's own rounding is the calibration's
    business, not the export's. A prediction flipped where torch's own top two logits lie
    within :data:`PARITY_ATOL` is a tie broken by float rounding, not a faulty export: only
    the other flips count against :data:`PARITY_MAX_DISAGREE`; the report gives every flip.
    """
    diff, disagree, real = {}, {}, {}
    for k in torch_logits:
        a, b = torch_logits[k], onnx_logits[k]
        if k == "device":  # absent views are not run by the hierarchy
            a, b = a[present], b[present]
        diff[k] = float(np.abs(a - b).max()) if a.size else 0.0
        flipped = a.argmax(-1) != b.argmax(-1)
        disagree[k] = float(flipped.mean()) if a.size else 0.0
        if a.size:
            picked = np.take_along_axis(a, b.argmax(-1)[..., None], -1)[..., 0]
            real[k] = float((flipped & (a.max(-1) - picked > PARITY_ATOL)).mean())
    report = ParityReport(diff, disagree)
    bad = [k for k in real if real[k] > PARITY_MAX_DISAGREE]
    if bad:
        raise BundleError(f"ONNX export disagrees with torch at exits {bad}: {report.to_dict()}")
    return report


class _WithDetail(nn.Module):
    """A device segment as its file has it where the network escalates: scores, features and
    the detail it keeps for an escalated frame."""

    def __init__(self, device: nn.Module):
        super().__init__()
        self.device = device

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.device.outputs(image)


def export_segments(
    model: DDNN, out: Path, input_shape: tuple[int, int, int]
) -> dict[str, SegmentSpec]:
    """Write every segment's ONNX file into ``out``; return their specs by role.

    The device segments' batch norms are folded and their weights rounded to float16 in place
    first: their files store them so (:func:`store_float16`), which keeps a deeper device under
    the 16 KB of a small board.
    """
    model.eval()
    specs: dict[str, SegmentSpec] = {}
    x = torch.rand(2, *input_shape)
    with torch.no_grad():
        for i, dev in enumerate(model.devices):
            fold_batch_norms(dev)
            round_float16(dev)
            device = dev if dev.escalate == "none" else _WithDetail(dev)
            outputs = dict(zip(DEVICE_OUTPUTS, device(x), strict=False))
            path = out / f"device-{i}.onnx"
            _export(device, {"image": x}, list(outputs), path)
            store_float16(path)
            specs[f"device-{i}"] = _spec(path, {"image": x}, outputs)
        present = torch.ones(2, model.views, dtype=torch.bool)
        dev_scores = torch.stack([dev(x)[0] for dev in model.devices], 1)
        dev_feats = torch.stack([dev(x)[1] for dev in model.devices], 1)
        if model.local is not None:
            s_in = aggregate(dev_scores, present, model.local_op)
            path = out / "local.onnx"
            _export(model.local, {"device_scores": s_in}, ["scores"], path)
            specs["local"] = _spec(path, {"device_scores": s_in}, {"scores": model.local(s_in)})
        f_in = aggregate(dev_feats, present, model.edge_op)
        e_scores, e_feats = model.edge(f_in)
        path = out / "edge.onnx"
        _export(model.edge, {"device_features": f_in}, ["scores", "features"], path)
        specs["edge"] = _spec(
            path, {"device_features": f_in}, {"scores": e_scores, "features": e_feats}
        )
        path = out / "cloud.onnx"
        _export(model.cloud, {"edge_features": e_feats}, ["scores"], path)
        specs["cloud"] = _spec(path, {"edge_features": e_feats}, {"scores": model.cloud(e_feats)})
        if model.escalated is not None:
            slots = model.detail_slots or model.views
            detail = torch.stack([dev.outputs(x)[2] for dev in model.devices], 1)[:, :slots]
            inputs = {"edge_features": e_feats,
                      "device_detail": aggregate(detail, present[:, :slots], "concat")}
            path = out / "escalated.onnx"
            _export(model.escalated, inputs, ["scores"], path)
            specs["escalated"] = _spec(path, inputs, {"scores": model.escalated(*inputs.values())})
    return specs


def build_manifest(
    model: DDNN,
    specs: dict[str, SegmentSpec],
    name: str,
    version: str,
    classes: tuple[str, ...],
    input_shape: tuple[int, int, int],
    thresholds: dict[str, float],
    training: dict,
    calibration: dict,
    escalation_level: int = 0,
    stacking: Stacking | None = None,
) -> Manifest:
    cfg = model.cfg
    codec = {"scores": "float16", "device_features": cfg.device.codec,
             "edge_features": cfg.edge.codec}
    if "escalated" in specs:
        codec["device_detail"] = cfg.escalation.codec
    return Manifest(
        name=check_name("model name", name),
        version=check_name("model version", version),
        classes=tuple(classes),
        views=model.views,
        input_shape=input_shape,
        aggregation={"local": model.local_op, "edge": model.edge_op},
        scheme=cfg.edge.scheme.upper(),
        devices=tuple(specs[f"device-{i}"] for i in range(model.views)),
        local=specs.get("local"),
        edge=specs["edge"],
        cloud=specs["cloud"],
        thresholds=dict(thresholds),
        codec=codec,
        training=training,
        calibration=calibration,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        escalated=specs.get("escalated"),
        escalation_level=escalation_level,
        escalation_views=model.detail_slots if "escalated" in specs else 0,
        stacking=stacking,
    )


def publish(staging: Path, out: Path) -> None:
    """Move a finished bundle into place, replacing an older bundle at ``out``."""
    if out.exists():
        if not (out / "manifest.json").is_file() and any(out.iterdir()):
            raise BundleError(f"{out}: exists and is not a bundle; refusing to overwrite it")
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(trash / out.name)
        staging.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(out)


def staging_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a bundle is meant to be read by services
    return staging


def write_manifest(path: Path, manifest: Manifest) -> None:
    _write_manifest(path, manifest)
    load_bundle(path)  # what we wrote must load and verify


def onnx_exits(path: Path, *datasets: MultiViewDataset, exact_links: bool = False
               ) -> list[dict[str, np.ndarray]]:
    """Every segment's own scores through ONNX Runtime for each of ``datasets``, from one set
    of sessions, unstacked: as the tiers compute them (what the stacking fit and the
    calibration read) or, with ``exact_links``, without the wire's rounding (what the torch
    parity check reads: a float16 score or an int8 edge feature rounded on the wire can flip a
    near tie of an undertrained model, which says nothing of the export)."""
    runtime = BundleRuntime(load_bundle(path, verify=False), exact_links=exact_links)
    return [runtime.run_dataset(ds.X, ds.present, stacked=False) for ds in datasets]
