"""ResNet "C4" trunk: stem + res2..res4 on the whole image (stride 16) and res5 as the per-ROI neck.

The stages are assembled here from torchvision's own ``BasicBlock`` / ``Bottleneck`` classes because
torchvision's ``ResNet`` constructor has no width multiplier (the CPU toy model is a quarter-width
ResNet-18). Module names follow torchvision's (``conv1``, ``bn1``, ``layer1``..``layer4``), so its ImageNet
state dicts load unchanged when the width multiplier is 1.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from wsod.modeling.backbone import Backbone
from wsod.modeling.frozen_bn import FrozenBatchNorm2d, freeze_batchnorm
from wsod.modeling.pretrained import is_weights_file, load_state_dict

__all__ = [
    "build_resnet_trunk",
    "stage_channels",
    "build_resnet_c4",
    "resnet_c4_backbone",
    "ResNetNeck",
    "make_norm_layer",
    "RES5_SPATIAL_STRIDE",
]

# res5's first block has stride 2: 14x14 pooled ROI features come out as 7x7.
RES5_SPATIAL_STRIDE = 2
# stem (4: conv1 and its max pooling) x res3 (2) x res4 (2): the C4 feature map is at 1/16 of the input.
C4_STRIDE = 16

_ARCHS: dict[int, tuple[type[nn.Module], list[int]]] = {
    18: (BasicBlock, [2, 2, 2, 2]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
    101: (Bottleneck, [3, 4, 23, 3]),
}
_STAGE_PLANES = (64, 128, 256, 512)


def make_norm_layer(kind: str) -> Callable[[int], nn.Module]:
    """Return a ``channels -> module`` factory for ``kind`` in {"frozen_bn", "bn", "gn"}.

    ``frozen_bn``: fixed affine statistics (the detection default with ImageNet weights), computed in
    the input's dtype so that autocast keeps activations in reduced precision.
    ``bn``: train-mode BatchNorm (useful from scratch in the base; refused by sequential backprop).
    ``gn``: GroupNorm with up to 32 groups (per-sample, so it may live inside sequential backprop).
    """
    if kind == "frozen_bn":
        return FrozenBatchNorm2d
    if kind == "bn":
        return nn.BatchNorm2d
    if kind == "gn":
        return lambda channels: nn.GroupNorm(math.gcd(32, channels), channels)
    raise ValueError(f"unknown norm '{kind}': expected one of frozen_bn, bn, gn")


def _make_stage(
    block: type[nn.Module],
    inplanes: int,
    planes: int,
    blocks: int,
    stride: int,
    norm_layer: Callable[[int], nn.Module],
) -> tuple[nn.Sequential, int]:
    """One residual stage laid out like torchvision's ``ResNet._make_layer``; returns it and its width."""
    outplanes = planes * block.expansion
    downsample = None
    if stride != 1 or inplanes != outplanes:
        downsample = nn.Sequential(
            nn.Conv2d(inplanes, outplanes, kernel_size=1, stride=stride, bias=False),
            norm_layer(outplanes),
        )
    layers = [block(inplanes, planes, stride, downsample, norm_layer=norm_layer)]
    layers += [block(outplanes, planes, norm_layer=norm_layer) for _ in range(1, blocks)]
    return nn.Sequential(*layers), outplanes


class _ResNetTrunk(nn.Module):
    """ResNet without its classifier, with torchvision's parameter names (so its weights load)."""

    def __init__(
        self,
        depth: int,
        width: float,
        norm_layer: Callable[[int], nn.Module],
        neck_norm_layer: Callable[[int], nn.Module],
        stem_pool: bool = True,
    ) -> None:
        super().__init__()
        if depth not in _ARCHS:
            raise ValueError(f"unsupported ResNet depth {depth}: expected one of {sorted(_ARCHS)}")
        block, counts = _ARCHS[depth]
        widths = [max(1, round(p * width)) for p in _STAGE_PLANES]
        self.conv1 = nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(widths[0])
        self.relu = nn.ReLU(inplace=True)
        # Identity keeps the child (and the names) when the stem does not pool; neither has parameters.
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1) if stem_pool else nn.Identity()
        inplanes = widths[0]
        for index, (planes, count) in enumerate(zip(widths, counts, strict=True)):
            stage_norm = neck_norm_layer if index == 3 else norm_layer
            stage, inplanes = _make_stage(block, inplanes, planes, count, 1 if index == 0 else 2, stage_norm)
            setattr(self, f"layer{index + 1}", stage)
        # torchvision's initialisation, so that random-init runs match what users know.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d | nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def build_resnet_trunk(
    depth: int = 50,
    *,
    width: float = 1.0,
    weights: str | None = None,
    norm: str = "frozen_bn",
    neck_norm: str | None = None,
    stem_pool: bool = True,
) -> nn.Module:
    """The ResNet without its classifier: children ``conv1``, ``bn1``, ``relu``, ``maxpool``, ``layer1`` ..
    ``layer4`` in forward order, with torchvision's parameter names (``build_resnet_c4`` splits it at res5;
    ``wsod.modeling.faster_rcnn`` reads its four stages through an FPN).

    Args:
        depth: 18, 34, 50 or 101.
        width: channel multiplier of every stage (1.0 = torchvision's network; 0.25 for CPU toys).
        weights: ImageNet weights (torchvision name or file path); ``None`` for random initialisation.
        norm: normalisation of the stem and ``layer1`` .. ``layer3``, see ``make_norm_layer``.
        neck_norm: normalisation of ``layer4`` (default: same as ``norm``).
        stem_pool: the stem's 3x3 max pooling (torchvision's ResNet). False halves every stage's stride
            and, in pixels, res4's receptive field (211 -> 107 px for ResNet-18), at four times the
            arithmetic of every stage: the toy_voc base's choice, whose objects are small in pixels
            (its ``ARCH``). A weights file does not record it (the pooling has no parameters): the model must
            be built as its weights were trained.
    """
    neck_norm = neck_norm or norm
    trunk = _ResNetTrunk(depth, width, make_norm_layer(norm), make_norm_layer(neck_norm), stem_pool)
    if weights is not None:
        # torchvision's named weights are the full-width BatchNorm networks; a local file may hold any
        # trunk with torchvision's keys (the toy_voc base: width 0.25, GroupNorm res5), checked below.
        if not is_weights_file(weights):
            if width != 1.0:
                raise ValueError(f"ImageNet weights need width=1.0, got width={width}")
            if "gn" in (norm, neck_norm):
                raise ValueError("ImageNet BatchNorm weights cannot initialise GroupNorm layers")
        state = load_state_dict(weights, f"resnet{depth}")
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        own = trunk.state_dict()
        wrong = [
            f"{k} {tuple(v.shape)} (expected {tuple(own[k].shape)})"
            for k, v in state.items()
            if k in own and v.shape != own[k].shape
        ]
        if wrong:
            raise ValueError(
                f"weights '{weights}' do not fit resnet{depth} at width={width}, norm={norm},"
                f" neck_norm={neck_norm}: {', '.join(wrong[:3])}"
            )
        missing, unexpected = trunk.load_state_dict(state, strict=False)
        # FrozenBatchNorm2d has no num_batches_tracked buffer; anything else missing is a wrong file.
        missing = [k for k in missing if not k.endswith("num_batches_tracked")]
        unexpected = [k for k in unexpected if not k.endswith("num_batches_tracked")]
        if missing or unexpected:
            raise ValueError(
                f"weights '{weights}' do not fit resnet{depth}: missing {missing[:5]},"
                f" unexpected {unexpected[:5]}"
            )
    return trunk


def stage_channels(stage: nn.Sequential) -> int:
    """The output channels of a residual stage (``layer1`` .. ``layer4``)."""
    last = stage[-1]
    return (last.conv3 if isinstance(last, Bottleneck) else last.conv2).out_channels


def build_resnet_c4(
    depth: int = 50,
    *,
    width: float = 1.0,
    weights: str | None = None,
    norm: str = "frozen_bn",
    neck_norm: str | None = None,
    freeze_at: int = 2,
    stem_pool: bool = True,
) -> tuple[nn.Sequential, nn.Sequential]:
    """Build the C4 base and the res5 neck.

    Args:
        depth, width, weights, norm: see ``build_resnet_trunk``.
        neck_norm: normalisation of res5 (default: same as ``norm``). Keep it per-sample (frozen_bn or
            gn) when the neck runs under sequential backprop.
        freeze_at: 0 trains everything, 1 freezes the stem, 2 the stem and res2 (detectron2's meaning), ...
            5 res5 too; a frozen stage's BatchNorm layers become ``FrozenBatchNorm2d`` (as detectron2's).
        stem_pool: see ``build_resnet_trunk``; False puts the C4 features at stride 8.

    Returns:
        base: images (B, 3, H, W) -> features (B, C4, H/16, W/16) (H/8, W/8 without the stem's
            pooling); ``base.out_channels`` = C4, ``base.stride`` = 16 or 8.
        res5: pooled ROI features (R, C4, S, S) -> (R, C5, S/2, S/2); ``res5.out_channels`` = C5.
    """
    if not 0 <= freeze_at <= 5:
        raise ValueError(f"freeze_at must be in 0..5, got {freeze_at}")
    trunk = build_resnet_trunk(
        depth, width=width, weights=weights, norm=norm, neck_norm=neck_norm, stem_pool=stem_pool
    )

    stem = nn.Sequential(
        OrderedDict(conv1=trunk.conv1, bn1=trunk.bn1, relu=trunk.relu, maxpool=trunk.maxpool)
    )
    base = nn.Sequential(OrderedDict(stem=stem, res2=trunk.layer1, res3=trunk.layer2, res4=trunk.layer3))
    # A frozen stage keeps its BatchNorm statistics too (detectron2's ResNet.freeze).
    for name, stage in list(base.named_children())[:freeze_at]:
        setattr(base, name, freeze_batchnorm(stage).requires_grad_(False))
    res5 = trunk.layer4
    if freeze_at >= 5:
        res5 = freeze_batchnorm(res5).requires_grad_(False)
    base.out_channels = stage_channels(trunk.layer3)
    base.stride = C4_STRIDE if stem_pool else C4_STRIDE // 2
    res5.out_channels = stage_channels(trunk.layer4)
    return base, res5


class ResNetNeck(nn.Sequential):
    """The per-ROI neck of a C4 detector: res5's blocks, then global average pooling.
    (R, C4, S, S) -> (R, C5). A ``Sequential`` of the blocks, so parameter names stay ``0.conv1...``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).mean(dim=(2, 3))


def resnet_c4_backbone(depth: int, **options) -> Backbone:
    """``build_resnet_c4(depth, **options)`` behind the backbone seam: base at stride 16, res5 + average
    pooling as the neck, C5 features per ROI (2048 for ResNet-50/101 at full width), from RoIAlign 14x14
    (the backbone's ``pooler="align", roi_size=14``); stride 8 without the stem's pooling."""
    base, res5 = build_resnet_c4(depth, **options)
    neck = ResNetNeck(*res5)
    return Backbone(
        base=base,
        neck=neck,
        stride=base.stride,
        feature_dim=res5.out_channels,
        channels=base.out_channels,
        pooler="align",
        roi_size=14,
    )
