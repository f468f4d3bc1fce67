"""The DDNN network's parts: quantized device features, late fusion at the edge, the device's
size, the paper preset and the training loss options."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddnn.errors import ConfigError  # noqa: E402
from ddnn.models.config import DDNNConfig  # noqa: E402
from ddnn.models.export import export_segments  # noqa: E402
from ddnn.models.network import DDNN, Quantize, aggregate  # noqa: E402
from ddnn.models.presets import preset  # noqa: E402
from ddnn.models.train import _distill, joint_loss  # noqa: E402


def _model(views=4, classes=3, size=32, **kw):
    torch.manual_seed(0)
    return DDNN(DDNNConfig.from_flat(**kw), views, classes, size, size).eval()


def _inputs(b=6, views=4, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, views, 3, size, size, generator=g)
    present = torch.rand(b, views, generator=g) > 0.3
    present[:, 0] = True
    return torch.where(present[..., None, None, None], x, torch.zeros_like(x)), present


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_quantizer_levels_never_zero_and_gradient_passes_inside(bits):
    q = Quantize(bits)
    x = torch.linspace(-2, 2, 101, requires_grad=True)
    q.train()(x).sum().backward()
    assert torch.all(x.grad[(x.abs() <= 1).detach()] == 1) and torch.all(x.grad[x.abs() > 1] == 0)
    out = q.eval()(x.detach())
    assert len(out.unique()) == 2**bits and not (out == 0).any() and out.abs().max() == 1


@pytest.mark.parametrize("codec", ["binary", "bits2", "bits4"])
def test_device_features_take_the_codec_levels(codec):
    model = _model(device_codec=codec)
    _, feats = model.devices[0](torch.rand(3, 3, 32, 32))
    levels = feats.unique()
    assert len(levels) <= 2 ** DDNNConfig.from_flat(device_codec=codec).device.bits
    assert not (levels == 0).any()


def test_late_fusion_ignores_absent_views_and_view_order():
    """Per-view edge and averaged device log-probabilities: a view's slot does not matter, and
    what an absent camera's (zeroed) slot would hold never changes an exit."""
    model = _model()
    x, present = _inputs()
    with torch.no_grad():
        out = model(x, present)
        perm = torch.tensor([2, 0, 3, 1])
        shuffled = model(x[:, perm], present[:, perm])
        noisy = model(torch.where(present[..., None, None, None], x, torch.rand_like(x)), present)
    for k in ("local", "edge", "cloud"):
        torch.testing.assert_close(out[k], shuffled[k], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[k], noisy[k], atol=1e-5, rtol=1e-5)


def test_local_exit_is_the_mean_of_device_log_probabilities():
    model = _model()
    x, present = _inputs()
    with torch.no_grad():
        out = model(x, present)
    dev = out["device"]
    torch.testing.assert_close(dev.exp().sum(-1)[present], torch.ones(int(present.sum())))
    torch.testing.assert_close(out["local"], aggregate(dev, present, "avg"))


@pytest.mark.parametrize("classes", [3, 10])
def test_default_device_segment_stays_under_16_kb(classes, tmp_path):
    model = _model(views=6, classes=classes)
    spec = export_segments(model, tmp_path, (3, 32, 32))["device-0"]
    assert spec.size <= 16 * 1024
    # 1 bit a value: far more than 50x under the view's 8-bit image
    assert np.prod(spec.output("features").sample_shape) // 8 * 50 <= 3 * 32 * 32


@pytest.mark.parametrize("size", [16, 20, 24, 32, 40])
def test_any_image_size_from_16(size):
    model = _model(views=2, size=size)
    x, present = _inputs(views=2, size=size)
    with torch.no_grad():
        out = model(x, present)
    assert out["cloud"].shape == (6, 3) and torch.isfinite(out["cloud"]).all()


@pytest.mark.parametrize("name, stem", [("pi", (16, 48)), ("deep", (32, 64))])
def test_pi_class_presets_fit_a_small_board_and_send_few_bytes(tmp_path, name, stem):
    cfg = preset(name)
    assert (cfg.device.stem, cfg.device.convs, cfg.device.filters, cfg.escalation.detail) == (
        stem, 2, 64, "none")
    assert preset(name).replace(escalate="view").escalation.detail == "view"  # overrides on top
    torch.manual_seed(0)
    model = DDNN(cfg, 6, 10, 32, 32).eval()
    stem = model.devices[0].stem
    convs = [sum(isinstance(m, torch.nn.Conv2d) for m in block.modules()) for block in stem]
    assert convs == [2, 2]  # VGG-style double-conv blocks, each halving the resolution
    spec = export_segments(model, tmp_path, (3, 32, 32))["device-0"]
    assert 16 * 1024 < spec.size <= 256 * 1024  # a Pi-class board's model, not a microcontroller's
    # 64 binary features on a 4x4 map: 128 B a view, 24x under its 8-bit image
    assert np.prod(spec.output("features").sample_shape) // 8 == 128


@pytest.mark.parametrize("kw, message", [
    ({"device_convs": 0}, "must be 1, 2 or 3"),
    ({"device_convs": 4}, "must be 1, 2 or 3"),
    ({"device_convs": 2, "device_stem": ()}, "give a stem"),  # else silently ignored
])
def test_device_convs_takes_one_to_three_convolutions_of_a_stem(kw, message):
    with pytest.raises(ConfigError, match=message):
        DDNNConfig.from_flat(**kw)


def test_paper_preset_is_the_previous_architecture():
    cfg = preset("paper")
    assert (cfg.edge.scheme, cfg.device.filters, cfg.device.stem, cfg.device.binary) == (
        "MP-AP", 4, (), True)
    assert (cfg.device.scores, cfg.edge.codec, cfg.edge.per_view) == ("logits", "binary", False)
    model = DDNN(cfg, 3, 3, 32, 32)
    weights = 3 * 4 * 9 + 2 * 4 + 4 * 16 * 16 * 3 + 3  # conv, batch norm, linear exit
    assert sum(p.numel() for p in model.devices[0].parameters()) == weights
    assert preset("paper").replace(scheme="MP-CC").edge.scheme == "MP-CC"


def test_bad_architecture_settings_are_refused():
    with pytest.raises(ConfigError, match="device codec"):
        DDNNConfig.from_flat(device_codec="int8")
    with pytest.raises(ConfigError, match="edge codec"):
        DDNNConfig.from_flat(edge_codec="bits2")
    with pytest.raises(ConfigError, match="maxmean"):
        DDNNConfig.from_flat(edge_view_pool="maxmean", edge_codec="binary")
    with pytest.raises(ConfigError, match="device_scores"):
        DDNNConfig.from_flat(device_scores="probs")


def _training_outputs():
    """An escalating model's outputs in training mode, with labels and the exits' weights."""
    model = _model(views=3, escalate="view")
    model.train()
    x, present = _inputs(views=3)
    y = torch.where(present, torch.tensor(1), torch.tensor(-1))
    label = torch.ones(len(x), dtype=torch.long)
    return model(x, present), y, label, present, (1.0, 1.0, 1.0, 1.0)


def test_device_distillation_is_optional():
    out, y, label, present, w = _training_outputs()
    with_dev = joint_loss(out, y, label, w, distill=1.0, distill_device=True)
    without = joint_loss(out, y, label, w, distill=1.0, distill_device=False)
    none = joint_loss(out, y, label, w, distill=0.0)
    assert without < with_dev and none < without
    # The difference is exactly the device exits' distillation term; the top exit teaches.
    teacher = out["escalated"].detach()[:, None].expand(-1, 3, -1)[present]
    kd = _distill(out["device"][present], teacher, 2.0)
    torch.testing.assert_close(with_dev - without, kd)


@pytest.mark.parametrize("samples", [1, 2, 63, 64, 65, 129, 193])
def test_training_batches_cover_every_sample_once_and_never_hold_one_alone(samples):
    # A lone sample in the last batch broke training (batch norm on a 1 x 1 map) whenever the
    # training split was one more than a multiple of the batch size (48 x 48 images, 2 views).
    from ddnn.models.distributed import Distributed

    dist = Distributed.from_env(DDNNConfig.from_flat(device="cpu"))
    batches = list(dist.batches(samples, 64, seed=0, epoch=3))
    assert sorted(np.concatenate(batches).tolist()) == list(range(samples))
    assert len(batches) == dist.steps_per_epoch(samples, 64)
    assert samples == 1 or min(len(b) for b in batches) > 1


def test_precision_names_the_autocast_the_manifest_records():
    from ddnn.models.distributed import Distributed

    assert Distributed.from_env(DDNNConfig.from_flat(device="cpu")).precision == "fp32"
    cpu_amp = DDNNConfig.from_flat(device="cpu", cpu_amp=True)
    assert Distributed.from_env(cpu_amp).precision == "bf16"
    assert Distributed(amp_dtype=torch.float16).precision == "fp16"  # CUDA without bf16


def test_device_file_stores_float16_weights_and_computes_as_torch(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model = _model(views=2, classes=10, escalate="view")
    before = {k: v.clone() for k, v in model.devices[0].state_dict().items()}
    export_segments(model, tmp_path, (3, 32, 32))
    stored = onnx.load(str(tmp_path / "device-0.onnx")).graph.initializer
    assert stored and all(t.data_type == onnx.TensorProto.FLOAT16 for t in stored
                          if len(t.dims) > 1)
    # The weights were rounded in place to what the file holds, so torch and ONNX agree.
    after = model.devices[0].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    x = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    scores, features, detail = ort.InferenceSession(str(tmp_path / "device-0.onnx")).run(
        ["scores", "features", "detail"], {"image": x.numpy()})
    with torch.no_grad():
        t_scores, t_features = model.devices[0](x)
    np.testing.assert_allclose(scores, t_scores.numpy(), atol=1e-5)
    np.testing.assert_array_equal(features, t_features.numpy())
    # The detail kept for an escalated frame: the centred image average-pooled to 16 x 16, on
    # the 16 levels of its 4-bit codec.
    pooled = torch.nn.functional.avg_pool2d(x * 2 - 1, 2)
    np.testing.assert_allclose(detail, Quantize(4).eval()(pooled).numpy(), atol=1e-6)


def test_a_double_conv_device_file_computes_as_torch_with_trained_batch_norms(tmp_path):
    """The export folds a double-conv block's inner batch norms into their convolutions; folded
    before the float16 rounding, torch and the file hold the same product (folded after it,
    rounded twice, they differed by enough to flip sign features and fail the parity check)."""
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = DDNN(preset("pi"), 2, 10, 32, 32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # statistics and scales far from a fresh batch norm's, as trained
        for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            n = bn.num_features
            bn.running_mean.copy_(torch.randn(n, generator=g) * 0.3)
            bn.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.05)
            bn.weight.copy_(torch.rand(n, generator=g) + 0.5)
            bn.bias.copy_(torch.randn(n, generator=g) * 0.2)
    x = torch.rand(256, 3, 32, 32, generator=g)
    with torch.no_grad():
        unfolded = model.devices[0].eval()(x)[0]
    export_segments(model, tmp_path, (3, 32, 32))
    with torch.no_grad():
        t_scores, t_features = model.devices[0](x)
    np.testing.assert_allclose(t_scores, unfolded, atol=0.05)  # the same network, rounded
    scores, features = ort.InferenceSession(str(tmp_path / "device-0.onnx")).run(
        ["scores", "features"], {"image": x.numpy()})
    np.testing.assert_allclose(scores, t_scores.numpy(), atol=1e-5)
    np.testing.assert_array_equal(features, t_features.numpy())  # not one bit flipped


def test_the_folded_pairs_are_a_float_convolution_and_the_batch_norm_right_after_it():
    """What the export folds and the federated rebuild unfolds: each double-conv block's inner
    pair; never the block's own batch norm (a pool lies between), nor one after a binarized
    convolution (its weights are computed)."""
    from ddnn.models.network import folded_pairs

    float_device = DDNN(preset("pi"), 2, 10, 32, 32).devices[0]
    names = [(conv, bn) for conv, _, bn, _ in folded_pairs(float_device)]
    assert names == [("stem.0.conv.0", "stem.0.conv.1"), ("stem.1.conv.0", "stem.1.conv.1")]
    binary = dataclasses.replace(preset("pi"), device=dataclasses.replace(
        preset("pi").device, binary=True))
    assert folded_pairs(DDNN(binary, 2, 10, 32, 32).devices[0]) == []


def test_a_device_weight_beyond_float16_is_refused_by_name(tmp_path):
    pytest.importorskip("onnx")
    from ddnn.errors import BundleError

    model = _model(views=2)
    with torch.no_grad():
        model.devices[0].block.conv.weight[0, 0, 0, 0] = 1e6  # float16 tops out at 65504
    with pytest.raises(BundleError, match="block.conv.weight.*float16"):
        export_segments(model, tmp_path, (3, 32, 32))


def test_the_surest_views_are_picked_alike_in_torch_and_numpy():
    """The edge picks whom to pull details from as training did: the k present views whose
    device scores have the lowest entropy, ties to the lower view index."""
    from ddnn.hierarchy import surest_views as np_surest
    from ddnn.models.network import surest_views

    g = torch.Generator().manual_seed(3)
    scores = torch.log_softmax(torch.randn(50, 6, 10, generator=g) * 3, dim=-1)
    scores[0, 2] = scores[0, 4]  # a tie
    present = torch.rand(50, 6, generator=g) > 0.4
    present[1] = False
    present[1, 5] = True  # one present view: the other slot stays empty
    detail = torch.randn(50, 6, 3, 4, 4, generator=g)
    for k in (1, 2, 6):
        picked, sent = surest_views(detail, scores, present, k)
        np_picked, np_sent = np_surest(detail.numpy(), scores.numpy(), present.numpy(), k)
        np.testing.assert_array_equal(sent.numpy(), np_sent)
        np.testing.assert_array_equal(picked.numpy()[np_sent], np_picked[np_sent])
        assert sent.sum(1).tolist() == np.minimum(present.sum(1).numpy(), k).tolist()
    _, sent = surest_views(detail, scores, present, 2)
    assert sent[1].tolist() == [True, False]


def test_a_teacher_teaches_every_exit_but_the_devices():
    out, y, label, _, w = _training_outputs()
    soft = torch.randn(len(label), 3)
    plain = joint_loss(out, y, label, w)
    taught = joint_loss(out, y, label, w, soft=soft, teacher_weight=0.5)
    kd = sum(_distill(out[k], soft, 2.0) for k in ("local", "edge", "cloud", "escalated"))
    torch.testing.assert_close(taught - plain, 0.5 * kd)
    # An exit that already answers as the teacher does learns nothing more from it.
    agreeing = {**out, **{k: soft.clone() for k in ("local", "edge", "cloud", "escalated")}}
    torch.testing.assert_close(joint_loss(agreeing, y, label, w, soft=soft, teacher_weight=1.0),
                               joint_loss(agreeing, y, label, w))


def test_half_resolution_averages_each_two_by_two_block_at_the_same_size():
    from ddnn.models.train import half_resolution

    x = torch.arange(2 * 3 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 3, 4, 5)
    low = half_resolution(x)
    assert low.shape == x.shape
    block = x[0, 0, 0, :2, :2].mean()
    assert torch.all(low[0, 0, 0, :2, :2] == block)
    torch.testing.assert_close(low[..., :4], half_resolution(x[..., :4]))  # the even part
    assert torch.equal(low[..., 4], x[..., 4])  # an odd last column stays as it was
    with pytest.raises(ConfigError, match="lowres_epochs"):
        DDNNConfig.from_flat(lowres_epochs=-1)


def test_each_batch_learns_from_its_own_samples_teacher_answers(tmp_path):
    # A teacher sure of each sample's label: every batch's soft targets must name the batch's
    # own labels (rows picked as the batch reads them), in low- and full-resolution epochs.
    from ddnn.dataset import load_dataset
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize
    from ddnn.models.teacher import Teacher
    from ddnn.models.train import _ddnn_loss, train

    save_dataset(tmp_path / "d.npz", synthesize(70, SceneConfig(views=2, classes=3, size=16),
                                                seed=3))
    ds = load_dataset(tmp_path / "d.npz")
    teacher = Teacher(10.0 * np.eye(3, dtype=np.float32)[ds.label], {"name": "t"})
    cfg = DDNNConfig.from_flat(epochs=2, batch_size=16, lowres_epochs=1, device="cpu")
    plain, seen = _ddnn_loss(cfg), []

    def spy(out, y, label, soft=None):
        seen.append(bool(torch.equal(soft.argmax(-1), label)))
        return plain(out, y, label, soft)

    ckpt = tmp_path / "run.pt"
    result = train(ds, ds, cfg, progress=False, loss_fn=spy, teacher=teacher, checkpoint=ckpt)
    assert len(seen) > 4 and all(seen) and result.teacher == {"name": "t"}
    with pytest.raises(ConfigError, match="trained with teacher"):  # a resume keeps its teacher
        train(ds, ds, cfg, progress=False, checkpoint=ckpt, resume=True)


@pytest.mark.parametrize("flags, message", [
    (["--baseline", "--teacher", "ref"], "learns from the labels alone"),
    (["--teacher", "ref", "--teacher-weight", "0"], "for nothing"),
    (["--teacher-weight", "-1"], "teacher_weight must be >= 0"),
    (["--epochs", "3", "--lowres-epochs", "3"], "lowres_epochs must lie in"),
    (["--paper", "--deep-device"], "two different networks"),
])
def test_train_refuses_a_teacher_or_curriculum_that_would_do_nothing(tmp_path, capsys, flags,
                                                                      message):
    from ddnn.cli import main

    code = main(["train", "--data", str(tmp_path / "none.npz"), "--out", str(tmp_path / "b"),
                 *flags])
    assert code != 0 and message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # refused before any data is read or file written


@pytest.mark.parametrize("kw", [{}, {"share_device_weights": False},
                                {"escalate": "view", "escalate_views": 2}])
def test_skipping_absent_views_changes_no_exit(kw, monkeypatch):
    """Only present views go through a device (as on the live tiers): every exit is the one a
    pass of every view slot through its device gives, and an absent view's slots are zeros."""
    model = _model(**kw)
    x, present = _inputs()
    with torch.no_grad():
        out = model(x, present)
        monkeypatch.setattr(DDNN, "_present_outputs",
                            staticmethod(lambda dev, images, _: dev.outputs(images)))
        whole = model(x, present)
    assert out.keys() == whole.keys()
    for name in out:
        if name == "device":
            torch.testing.assert_close(out[name][present], whole[name][present])
            assert (out[name][~present] == 0).all()
        else:
            torch.testing.assert_close(out[name], whole[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"share_device_weights": False}])
def test_blank_images_of_absent_views_stay_out_of_batch_norm_statistics(kw):
    model, reference = _model(**kw).train(), _model(**kw).train()
    x, present = _inputs(b=8)
    sum(v.sum() for v in model(x, present).values()).backward()
    for i in range(x.shape[1]):
        reference.devices[i].outputs(x[present[:, i], i])
    for (name, got), (_, want) in zip(model.named_buffers(), reference.named_buffers(),
                                      strict=True):
        if name.startswith("devices."):
            assert torch.allclose(got.float(), want.float()), name


@pytest.mark.parametrize("seen", [0, 1])
def test_a_view_in_fewer_than_two_rows_trains_on_small_images(seen):
    """A view present in one row (or none) of a batch: no batch norm over one image (an 8x8
    view ends in a 1x1 map), zeros in its absent slots, and a gradient, zero or not, for every
    weight of its device (DistributedDataParallel needs one from each process)."""
    model = _model(size=8, share_device_weights=False).train()
    x, present = _inputs(b=4, size=8)
    present[:, 2] = False
    present[:seen, 2] = True
    x = torch.where(present[..., None, None, None], x, torch.zeros_like(x))
    out = model(x, present)
    assert (out["device"][~present[:, 2], 2] == 0).all()
    sum(v.sum() for v in out.values()).backward()
    assert all(p.grad is not None for p in model.devices[2].parameters())
