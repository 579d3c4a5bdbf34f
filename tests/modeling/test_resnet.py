"""ResNet C4 base and res5 neck: shapes, freezing, weights by file path and by torchvision name."""

from __future__ import annotations

import urllib.error

import pytest
import torch
import torchvision
from torchvision.ops.misc import FrozenBatchNorm2d

from wsod.modeling.frozen_bn import freeze_batchnorm
from wsod.modeling.resnet import build_resnet_c4, resnet_c4_backbone
from wsod.modeling.roi_head import RoIFeatureHead, build_roi_pooler


@pytest.mark.parametrize(
    "depth,width,c4,c5", [(18, 0.25, 64, 128), (18, 1.0, 256, 512), (50, 1.0, 1024, 2048)]
)
def test_output_shapes_and_stride(depth, width, c4, c5):
    base, res5 = build_resnet_c4(depth, width=width)
    assert base.out_channels == c4 and res5.out_channels == c5
    with torch.no_grad():
        features = base(torch.randn(1, 3, 96, 160))
        assert features.shape == (1, c4, 6, 10)
        assert res5(torch.randn(2, c4, 14, 14)).shape == (2, c5, 7, 7)
    assert isinstance(base.stem.bn1, FrozenBatchNorm2d)


def test_without_the_stem_pooling_the_c4_features_are_at_stride_8_with_the_same_parameters():
    pooled = resnet_c4_backbone(18, width=0.25, norm="bn")
    unpooled = resnet_c4_backbone(18, width=0.25, norm="bn", stem_pool=False)
    assert (pooled.stride, unpooled.stride) == (16, 8)
    assert isinstance(unpooled.base.stem.maxpool, torch.nn.Identity)
    assert pooled.base.state_dict().keys() == unpooled.base.state_dict().keys()  # one weights file fits both
    with torch.no_grad():
        assert unpooled.base(torch.randn(1, 3, 96, 160)).shape == (1, 64, 12, 20)


def test_a_frozen_stage_keeps_its_batchnorm_statistics_as_detectron2s_freeze():
    base, res5 = build_resnet_c4(18, width=0.25, norm="bn", neck_norm="bn", freeze_at=3)
    frozen = {
        name: isinstance(m, FrozenBatchNorm2d)
        for name, m in base.named_modules()
        if isinstance(m, FrozenBatchNorm2d | torch.nn.BatchNorm2d)
    }
    assert all(v for n, v in frozen.items() if n.startswith(("stem", "res2", "res3")))
    assert not any(v for n, v in frozen.items() if n.startswith("res4"))
    assert len(frozen) == 1 + 3 * 2 * 2 + 2  # the stem, two per block of res2-res4, two downsamplings
    assert not any(isinstance(m, FrozenBatchNorm2d) for m in res5.modules())
    _, frozen_res5 = build_resnet_c4(18, width=0.25, norm="bn", neck_norm="bn", freeze_at=5)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in frozen_res5.modules())


def test_freezing_a_batchnorm_keeps_what_it_computes_in_eval_mode():
    torch.manual_seed(0)
    layer = torch.nn.BatchNorm2d(4).double()
    layer.running_mean.uniform_(-1, 1), layer.running_var.uniform_(0.5, 2)
    layer.weight.data.uniform_(0.5, 2), layer.bias.data.uniform_(-1, 1)
    frozen = freeze_batchnorm(layer).double()
    assert isinstance(frozen, FrozenBatchNorm2d)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(frozen(x), layer.eval()(x))
    inside = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4))
    assert isinstance(freeze_batchnorm(inside)[1], FrozenBatchNorm2d)  # replaced in place


def test_freeze_at():
    base, res5 = build_resnet_c4(18, width=0.25, freeze_at=2)
    assert not any(p.requires_grad for p in base.stem.parameters())
    assert not any(p.requires_grad for p in base.res2.parameters())
    assert all(p.requires_grad for p in base.res3.parameters())
    assert all(p.requires_grad for p in res5.parameters())
    base, _ = build_resnet_c4(18, width=0.25, freeze_at=0)
    assert all(p.requires_grad for p in base.parameters())


def test_weights_from_a_local_file_match_torchvision(tmp_path):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)
    base, res5 = build_resnet_c4(18, weights=str(path))
    assert torch.equal(base.stem.conv1.weight, reference.conv1.weight)
    assert torch.equal(base.res4[1].conv2.weight, reference.layer3[1].conv2.weight)
    assert torch.equal(res5[0].downsample[1].running_var, reference.layer4[0].downsample[1].running_var)
    reference.eval()
    image = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ours = res5(base(image))
        theirs = reference.layer4(
            reference.layer3(reference.layer2(reference.layer1(reference.maxpool(reference.relu(
                reference.bn1(reference.conv1(image))))))))  # fmt: skip
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_bad_weights_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        build_resnet_c4(18, weights=str(tmp_path / "missing.pth"))
    wrong = tmp_path / "wrong.pth"
    torch.save(torchvision.models.resnet34().state_dict(), wrong)
    with pytest.raises(ValueError, match="do not fit resnet18"):
        build_resnet_c4(18, weights=str(wrong))
    with pytest.raises(ValueError, match="IMAGENET1K_V1"):
        build_resnet_c4(18, weights="NO_SUCH_WEIGHTS")
    with pytest.raises(ValueError, match="width=1.0"):
        build_resnet_c4(18, width=0.5, weights="DEFAULT")

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    with pytest.raises(RuntimeError, match="download.pytorch.org.*pass the file's path"):
        build_resnet_c4(50, weights="IMAGENET1K_V1")


def test_roi_head_modes_agree():
    torch.manual_seed(0)
    backbone = resnet_c4_backbone(18, width=0.25)
    assert backbone.stride == 16 and backbone.feature_dim == 128
    res5 = backbone.neck  # res5 + average pooling: (R, 64, 14, 14) -> (R, 128)
    features = torch.randn(2, 64, 8, 10, requires_grad=True)
    rois = torch.tensor([[0, 0, 0, 60, 60], [1, 16, 16, 150, 120], [0, 30, 8, 90, 100.0]])
    outputs = []
    for chunk_size, fuse in [(None, True), (2, True), (2, False)]:
        head = RoIFeatureHead(build_roi_pooler("align"), res5, chunk_size=chunk_size, fuse_pooling=fuse)
        out = head(features, rois)
        assert out.shape == (3, 128)
        outputs.append(out.detach())
    assert all(torch.allclose(o, outputs[0], atol=1e-6) for o in outputs)
    pooled = RoIFeatureHead(build_roi_pooler("pool"), res5, chunk_size=2)
    assert pooled(features, rois).shape == (3, 128)


def test_bf16_autocast_keeps_base_and_neck_activations_in_bf16():
    base, res5 = build_resnet_c4(18, width=0.25, norm="frozen_bn")
    dtypes: dict[str, torch.dtype] = {}
    for prefix, part in (("base", base), ("res5", res5)):
        for name, module in part.named_modules():
            if not list(module.children()):  # leaves: conv, frozen BN, ReLU, max-pool
                module.register_forward_hook(
                    lambda _m, _i, out, name=f"{prefix}.{name}": dtypes.__setitem__(name, out.dtype)
                )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = base(torch.randn(1, 3, 64, 64))
        res5(torch.randn(2, features.shape[1], 14, 14))
    assert any(".bn" in name for name in dtypes) and len(dtypes) > 20
    assert {name for name, dtype in dtypes.items() if dtype != torch.bfloat16} == set()


def test_frozen_batchnorm_equals_torchvisions_in_float32_and_keeps_bf16():
    from torchvision.ops.misc import FrozenBatchNorm2d as TorchvisionFrozenBN

    from wsod.modeling.frozen_bn import FrozenBatchNorm2d

    torch.manual_seed(0)
    ours, theirs = FrozenBatchNorm2d(8), TorchvisionFrozenBN(8)
    for buffer in ("weight", "bias", "running_mean"):
        getattr(ours, buffer).normal_()
    ours.running_var.uniform_(0.5, 2.0)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 8, 5, 5)
    assert torch.equal(ours(x), theirs(x))
    assert ours(x.bfloat16()).dtype == torch.bfloat16
    assert theirs(x.bfloat16()).dtype == torch.float32  # the promotion this class exists to avoid
