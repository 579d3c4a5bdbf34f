"""VGG16 backbone: sequential backprop through fc6/fc7 with dropout, stride 8, RoIPool at 1/8, a training
step of the whole detector, weights by file path and by torchvision name."""

from __future__ import annotations

import urllib.error

import pytest
import torch
import torchvision
from torch.nn.modules.utils import _pair
from torchvision.ops import RoIPool

from wsod.modeling import build_detector
from wsod.modeling.roi_head import _NeckWithPooling
from wsod.modeling.vgg import TORCHVISION_NAMES, vgg16_backbone
from wsod.sequential_backprop import SequentialBackprop

NUM_ROIS = 7
NARROW = 1 / 16  # 32 channels into fc6 (32 x 7 x 7 = 1568), fc6/fc7 256 wide: float64 stays fast


@pytest.fixture(scope="module")
def torchvision_vgg16() -> torchvision.models.VGG:
    torch.manual_seed(0)
    return torchvision.models.vgg16().eval()


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def _boxes(count: int, height: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x1 = torch.rand(count, generator=g) * (width - 20)
    y1 = torch.rand(count, generator=g) * (height - 20)
    w = torch.rand(count, generator=g) * (width - x1 - 12) + 12
    h = torch.rand(count, generator=g) * (height - y1 - 12) + 12
    return torch.stack([x1, y1, x1 + w, y1 + h], dim=1)


def _run(module, forward, features, rois):
    """Seeded forward through ``forward``, backward of a fixed output gradient: output and grads of the
    feature map and of every parameter."""
    features.grad = None
    module.zero_grad(set_to_none=True)
    torch.manual_seed(42)  # the same dropout masks for the reference and the wrapper
    out = forward(features, rois)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype))
    return out.detach(), [features.grad.clone()] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("chunk_size", [NUM_ROIS, 3], ids=["one-chunk", "three-chunks"])
def test_sequential_backprop_of_the_neck_with_dropout_equals_autograd(chunk_size):
    torch.manual_seed(0)
    backbone = vgg16_backbone(_width=NARROW)
    module = _NeckWithPooling(RoIPool(7, 1 / backbone.stride), backbone.neck).double().train()
    features = torch.randn(2, backbone.base.out_channels, 12, 16, dtype=torch.double, requires_grad=True)
    boxes = _boxes(NUM_ROIS, 96, 128, seed=1).double()
    rois = torch.cat([(torch.arange(NUM_ROIS) % 2).double()[:, None], boxes], dim=1)

    def chunked_plain(x, r):  # the reference: plain autograd over the same chunks, in the same order
        return torch.cat([module(x, r[s : s + chunk_size]) for s in range(0, NUM_ROIS, chunk_size)])

    ref_out, ref_grads = _run(module, chunked_plain, features, rois)
    wrapper = SequentialBackprop(module, chunk_size, shared_inputs=(0,))
    out, grads = _run(module, wrapper, features, rois)

    assert out.shape == (NUM_ROIS, 256)
    assert _max_rel_err(out, ref_out) < 1e-12
    assert len(grads) == 1 + 4  # feature map, fc6 and fc7 weights and biases
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert ref.abs().max() > 0 and _max_rel_err(grad, ref) < 1e-10
    with torch.no_grad():  # dropout was on: the masks really had to be replayed
        assert not torch.allclose(ref_out, module.eval()(features, rois))


def test_base_has_stride_8_and_freezes_conv1_conv2():
    torch.manual_seed(0)
    backbone = vgg16_backbone()
    assert backbone.stride == 8 and backbone.feature_dim == 4096 and backbone.base.out_channels == 512
    with torch.no_grad():
        features = backbone.base(torch.randn(1, 3, 600, 1000))
    assert features.shape == (1, 512, 75, 125)
    assert (features < 0).any(), "no ReLU after conv5_3"
    frozen = {n for n, p in backbone.base.named_parameters() if not p.requires_grad}
    assert frozen == {f"conv{b}_{i}.{k}" for b in (1, 2) for i in (1, 2) for k in ("weight", "bias")}
    assert all(p.requires_grad for p in backbone.neck.parameters())
    assert backbone.base.conv5_1.dilation == (2, 2) and backbone.base.conv4_3.dilation == (1, 1)
    narrow = vgg16_backbone(_width=NARROW, freeze_at=0)
    assert all(p.requires_grad for p in narrow.base.parameters())
    with pytest.raises(ValueError, match="freeze_at"):
        vgg16_backbone(_width=NARROW, freeze_at=6)


def test_roi_pool_of_the_registered_detector_maps_boxes_to_eighth_scale_cells():
    torch.manual_seed(0)
    model = build_detector("vgg16", num_classes=20)  # the one-line builder: the backbone's own RoIPool 7x7
    assert model.mil_head.cls_score.in_features == 4096
    pooler = model.roi_head.body.module.pooler
    assert (
        isinstance(pooler, RoIPool) and pooler.spatial_scale == 1 / 8 and _pair(pooler.output_size) == (7, 7)
    )

    features = torch.zeros(1, 1, 20, 20)
    features[0, 0, 5, 9] = 1.0  # the cell over pixels x 72..79, y 40..47
    rois = torch.tensor(
        [
            [0, 72, 40, 79, 47],  # exactly that cell's 8 x 8 pixels
            [0, 56, 24, 100, 70],  # a larger box around it
            [0, 80, 40, 87, 47],  # the next cell to the right
            [0, 72, 48, 79, 55],  # the next cell down
            [0, 0, 0, 60, 30],  # far away
        ],
        dtype=torch.float32,
    )
    seen = pooler(features, rois).amax(dim=(1, 2, 3))
    assert seen.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_training_step_and_evaluation_of_a_vgg16_detector():
    torch.manual_seed(0)
    model = build_detector("vgg16", num_classes=20, chunk_size=4, pooler="pool", roi_size=7)
    images = torch.randn(2, 3, 160, 160)
    proposals = [_boxes(5, 160, 160, seed=2), _boxes(6, 160, 160, seed=3)]
    labels = torch.zeros(2, 20)
    labels[0, [3, 11]] = 1
    labels[1, 7] = 1

    model.train()
    losses = model(images, proposals, labels).losses
    assert {"loss_mil", "loss_ref_cls_1", "loss_ref_box_3"} <= losses.keys()
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    base, neck = model.base, model.roi_head.body.module.neck
    assert neck.fc6.weight.shape == (4096, 512 * 7 * 7) and neck.fc7.weight.shape == (4096, 4096)
    for param in (neck.fc6.weight, neck.fc7.weight, base.conv3_1.weight, base.conv5_3.weight):
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0
    assert base.conv1_1.weight.grad is None and base.conv2_2.weight.grad is None
    fc6_before, conv1_before = neck.fc6.weight.detach().clone(), base.conv1_1.weight.detach().clone()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3).step()
    assert not torch.equal(neck.fc6.weight, fc6_before) and torch.equal(base.conv1_1.weight, conv1_before)

    model.eval()
    with torch.no_grad():
        detections = model(images, proposals)
    assert len(detections) == 2
    for det in detections:
        assert det["boxes"].shape[1] == 4 and len(det["boxes"]) == len(det["scores"]) == len(det["labels"])
        assert len(det["boxes"]) > 0 and torch.isfinite(det["scores"]).all()
        assert (det["boxes"] >= 0).all() and (det["boxes"] <= 160).all()
        assert ((det["labels"] >= 0) & (det["labels"] < 20)).all()


def test_weights_from_a_local_file_match_torchvision(tmp_path, torchvision_vgg16):
    reference = torchvision_vgg16
    path = tmp_path / "vgg16.pth"
    try:
        torch.save(reference.state_dict(), path)
        backbone = vgg16_backbone(weights=str(path))
    finally:
        path.unlink(missing_ok=True)  # half a gigabyte: do not leave it in pytest's kept tmp dirs
    base, neck = backbone.base, backbone.neck
    assert torch.equal(base.conv4_2.weight, reference.features[19].weight)
    assert torch.equal(neck.fc6.weight, reference.classifier[0].weight)
    ours = {**dict(base.named_children()), **dict(neck.named_children())}
    theirs = dict(reference.named_modules())
    for name, tv_name in TORCHVISION_NAMES.items():  # every layer from its own torchvision module
        assert torch.equal(ours[name].weight, theirs[tv_name].weight), name
        assert torch.equal(ours[name].bias, theirs[tv_name].bias), name
    assert not base.conv1_1.weight.requires_grad  # frozen after loading, as configured
    # Same maths as torchvision up to conv4_3 (before the dilated conv5), and fc6/fc7 flatten alike.
    neck.eval()
    image, pooled = torch.randn(1, 3, 64, 64), torch.randn(3, 512, 7, 7)
    with torch.no_grad():
        assert torch.allclose(base[: list(dict(base.named_children())).index("relu4_3") + 1](image),
                              reference.features[:23](image), atol=1e-5)  # fmt: skip
        assert torch.allclose(neck(pooled), reference.classifier[:6](pooled.flatten(1)), atol=1e-5)


def test_bad_weights_give_clear_errors(tmp_path, monkeypatch, torchvision_vgg16):
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        vgg16_backbone(weights=str(tmp_path / "missing.pth"))
    wrong = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), wrong)
    with pytest.raises(ValueError, match="do not fit vgg16"):
        vgg16_backbone(weights=str(wrong))
    with pytest.raises(ValueError, match="unknown weights 'NO_SUCH_WEIGHTS' for vgg16.*IMAGENET1K_V1"):
        vgg16_backbone(weights="NO_SUCH_WEIGHTS")
    with pytest.raises(ValueError, match="_width=1.0"):
        vgg16_backbone(weights="DEFAULT", _width=NARROW)

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    cache = torch.hub.get_dir()
    for name in ("IMAGENET1K_V1", "DEFAULT", "VGG16_Weights.IMAGENET1K_V1"):
        with pytest.raises(RuntimeError, match="vgg16-397923af.pth") as error:
            vgg16_backbone(weights=name)
        assert cache in str(error.value) and "pass the file's path" in str(error.value)

    # IMAGENET1K_FEATURES-like weights: valid convolutions, NaN classifier.
    state = {
        k: v.clone() if k.startswith("classifier.0") else v for k, v in torchvision_vgg16.state_dict().items()
    }
    state["classifier.0.weight"][0, 0] = float("nan")
    monkeypatch.setattr("wsod.modeling.vgg.load_state_dict", lambda weights, arch: state)
    with pytest.raises(ValueError, match="non-finite.*classifier.0.weight.*IMAGENET1K_V1"):
        vgg16_backbone(weights="IMAGENET1K_FEATURES")
