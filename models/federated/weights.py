"""Trainable weights from a bundle, and a model's weights as named numpy arrays.

A bundle stores its weights in its ONNX files only. Each segment is exported module by module
(``models.export``), so an ONNX initializer carries the name of the segment's parameter or
statistic (``stem.0.conv.weight``; ``….f16`` where the device file stores it as float16, which
is exact: export rounds the device weights to float16 first). :func:`model_from_bundle`
rebuilds the network from the manifest's training config and reads every parameter and
statistic back from the initializers, then checks the result against ONNX Runtime on the same
inputs: any bundle ever exported federates, with no second copy of the weights in it, and the
files signed and checked by every tier stay the only source.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ddnn.bundle import Bundle, load_bundle
from ddnn.errors import BundleError
from ddnn.models.config import DDNNConfig
from ddnn.models.network import DDNN, folded_pairs
from ddnn.stacking import Stacking

Weights = dict[str, np.ndarray]


def config_of(bundle: Bundle) -> DDNNConfig:
    """The DDNNConfig a bundle was trained with (fields this ddnn does not know are ignored)."""
    saved = bundle.manifest.training.get("config")
    if not isinstance(saved, dict):
        raise BundleError(f"{bundle.path}: the manifest has no training config to rebuild the "
                          "network from")
    return DDNNConfig.from_saved(saved)


def architecture(bundle: Bundle) -> dict:
    """What a site needs to build the same network and answer as the bundle does: config,
    views, classes, input shape and the stacking of its exits (None: unstacked)."""
    m = bundle.manifest
    return {"config": config_of(bundle).to_dict(), "views": m.views, "classes": list(m.classes),
            "input_shape": list(m.input_shape),
            "stacking": m.stacking.to_dict() if m.stacking is not None else None}


def stacking_of(arch: dict) -> Stacking | None:
    """The stacked exits of the architecture :func:`architecture` described."""
    d = arch.get("stacking")
    return Stacking.from_dict(d) if d is not None else None


def build_model(arch: dict) -> DDNN:
    """An untrained network of the architecture :func:`architecture` described."""
    cfg = DDNNConfig.from_saved(arch["config"])
    _, h, w = arch["input_shape"]
    return DDNN(cfg, int(arch["views"]), len(arch["classes"]), int(h), int(w))


def trainable_names(arch: dict) -> list[str]:
    """The network's trainable parameters, in order: the arrays a SCAFFOLD control variate
    holds (batch-norm statistics are weights but no parameters)."""
    return [n for n, p in build_model(arch).named_parameters() if p.requires_grad]


def model_weights(model: torch.nn.Module) -> Weights:
    """Every float parameter and statistic, once each (shared device weights appear once)."""
    out: Weights = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            out[name] = t.detach().cpu().numpy().astype(np.float32, copy=True)
    return out


def set_weights(model: torch.nn.Module, weights: Weights) -> None:
    """Copy ``weights`` into the model in place; names and shapes must match exactly."""
    own = dict([*model.named_parameters(), *model.named_buffers()])
    expected = {k for k, t in own.items() if t.is_floating_point()}
    if set(weights) != expected:
        raise BundleError(f"weights do not fit the model: missing "
                          f"{sorted(expected - set(weights))[:3]}, unexpected "
                          f"{sorted(set(weights) - expected)[:3]}")
    with torch.no_grad():
        for name, value in weights.items():
            t = own[name]
            if tuple(value.shape) != tuple(t.shape):
                raise BundleError(f"{name}: shape {value.shape}, the model has {tuple(t.shape)}")
            t.copy_(torch.from_numpy(np.array(value, dtype=np.float32)))  # a copy: may be read-only


def _initializers(graph) -> dict[str, np.ndarray]:
    """An ONNX graph's weights by name, float32 (a float16 copy's ``.f16`` suffix dropped)."""
    from onnx import numpy_helper

    out = {}
    for init in graph.initializer:
        name = init.name.removesuffix(".f16")
        out[name] = numpy_helper.to_array(init).astype(np.float32)
    return out


def _unfolded(module: torch.nn.Module, graph, inits: dict[str, np.ndarray], path: Path,
              prefix: str = "") -> dict[str, np.ndarray]:
    """A segment's convolutions that batch norm follows directly (the escalated cloud's view
    trunk, a deep device's double-conv blocks) as weights of their modules, named under
    ``prefix``: the export (``graph``, whose weights are ``inits``) folded each such batch norm
    into its convolution (unnamed ``onnx::Conv_*`` weight and bias, in graph order), which a batch
    norm of unit scale and variance and zero mean gives back exactly in evaluation. (In training
    mode such a batch norm normalizes by the batch's statistics without the scale it had: the
    first local steps of federated fine-tuning start from a slightly different network.)"""
    folded = [(inits[n.input[1]], inits[n.input[2]]) for n in graph.node
              if n.op_type == "Conv" and len(n.input) == 3 and n.input[1].startswith("onnx::")]
    # The pairs the export folds (models.network.folded_pairs), where the file lost the batch
    # norm's statistics.
    pairs = [(conv, bn, mod.eps) for conv, _, bn, mod in folded_pairs(module)
             if prefix + bn + ".running_mean" not in inits]
    if len(folded) != len(pairs):
        raise BundleError(f"{path.name}: {len(folded)} folded convolutions, the network has "
                          f"{len(pairs)}; this network cannot be rebuilt from its ONNX files")
    out = {}
    for (weight, bias), (conv, bn, eps) in zip(folded, pairs, strict=True):
        out[f"{prefix}{conv}.weight"] = weight
        out[f"{prefix}{bn}.weight"] = np.ones_like(bias)
        out[f"{prefix}{bn}.bias"] = bias
        out[f"{prefix}{bn}.running_mean"] = np.zeros_like(bias)
        out[f"{prefix}{bn}.running_var"] = np.full_like(bias, 1.0 - eps)
    return out


def _segments(model: DDNN, bundle: Bundle) -> list[tuple[torch.nn.Module, Path, str]]:
    """Each segment's module, its ONNX file and the prefix its weights have there."""
    m = bundle.manifest
    # A device that escalates is exported wrapped (export._WithDetail): its weights are named
    # under "device." in its file.
    wrapped = "device." if m.escalated is not None else ""
    parts = [(dev, bundle.file(m.devices[i]), wrapped) for i, dev in enumerate(model.devices)]
    if model.local is not None and m.local is not None:
        parts.append((model.local, bundle.file(m.local), ""))
    parts += [(model.edge, bundle.file(m.edge), ""), (model.cloud, bundle.file(m.cloud), "")]
    if model.escalated is not None and m.escalated is not None:
        parts.append((model.escalated, bundle.file(m.escalated), ""))
    return parts


def model_from_bundle(path: str | Path, check: bool = True) -> DDNN:
    """The bundle's network with its weights, ready to train (see the module docstring)."""
    import onnx

    bundle = load_bundle(path)
    model = build_model(architecture(bundle))
    with torch.no_grad():
        for module, onnx_file, prefix in _segments(model, bundle):
            graph = onnx.load(str(onnx_file)).graph
            inits = _initializers(graph)
            inits.update(_unfolded(module, graph, inits, onnx_file, prefix))
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                if not t.is_floating_point():
                    continue
                value = inits.get(prefix + name)
                if value is None or value.shape != tuple(t.shape):
                    raise BundleError(f"{bundle.path}: {onnx_file.name} holds no weight {name} "
                                      f"of shape {tuple(t.shape)}; this network cannot be "
                                      "rebuilt from its ONNX files")
                t.copy_(torch.from_numpy(value))
    model.eval()
    if check:
        check_against_onnx(model, bundle)
    return model


def check_against_onnx(model: DDNN, bundle: Bundle, samples: int = 16) -> None:
    """Raise :class:`BundleError` unless torch and ONNX Runtime give the same exits on random
    inputs: the rebuilt weights are the bundle's, or federation must not start from them."""
    from ddnn.models.export import check_parity
    from ddnn.runtime import BundleRuntime

    m = bundle.manifest
    rng = np.random.default_rng(0)
    x = rng.random((samples, m.views, *m.input_shape), dtype=np.float32)
    present = rng.random((samples, m.views)) < 0.8
    present[:, 0] = True
    x[~present] = 0.0
    with torch.no_grad():
        out = model.eval()(torch.from_numpy(x), torch.from_numpy(present))
    torch_logits = {k: v.numpy() for k, v in out.items()}
    onnx_logits = BundleRuntime(bundle, exact_links=True).run_dataset(x, present, stacked=False)
    try:
        check_parity(torch_logits, onnx_logits, present)
    except BundleError as e:
        raise BundleError(f"{bundle.path}: the weights read back from the ONNX files do not "
                          f"reproduce the bundle ({e})") from None
