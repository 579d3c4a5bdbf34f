"""VGG16, the backbone of the published WSOD results (WSDDN, OICR, PCL, MIST...): conv1_1..conv5_3 on the
whole image at stride 8, fc6/fc7 as the per-ROI neck.

Base: the convolutions of torchvision's ``vgg16().features`` (its configuration "D") without pool4 and
pool5, with conv5_x dilated by 2 (padding 2) so that they see the receptive field they were trained with
at twice the resolution; no ReLU after conv5_3. Output (B, 512, H/8, W/8).
Neck: pooled ROI features (R, 512, 7, 7) (RoIPool 7x7 at 1/8) flattened as torchvision flattens pool5
-> fc6 (4096) -> ReLU -> Dropout(0.5) -> fc7 (4096) -> ReLU -> Dropout(0.5) -> (R, 4096). No
normalisation, so ROIs are independent under sequential backprop, whose RNG stash replays the dropout
masks in the recompute.

Layers carry the names the papers use (``conv4_2``, ``fc6``); ``TORCHVISION_NAMES`` maps each to its
module in torchvision's ``VGG`` (``features.19``, ``classifier.0``), through which torchvision's state
dicts load.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torchvision.models.vgg import cfgs

from wsod.modeling.backbone import Backbone
from wsod.modeling.pretrained import load_state_dict

__all__ = ["vgg16_backbone", "VGGNeck", "TORCHVISION_NAMES", "VGG16_STRIDE"]

# pool1..pool3 (pool4 removed, conv5 dilated instead, pool5 dropped): the feature map is at 1/8.
VGG16_STRIDE = 8
CONV5_DILATION = 2
FC_DIM = 4096
DROPOUT = 0.5
# The ROI pooler's output side the ImageNet fc6 was trained on (pool5 of a 224 x 224 image is 7 x 7).
ROI_SIZE = 7


def _torchvision_names() -> dict[str, str]:
    """Our layer name -> torchvision's module name, laid out as ``torchvision.models.vgg.make_layers``
    lays out configuration "D" (a conv and its ReLU per number, a max-pool per "M")."""
    names, index, block, number = {}, 0, 1, 1
    for value in cfgs["D"]:
        if value == "M":
            index, block, number = index + 1, block + 1, 1
        else:
            names[f"conv{block}_{number}"] = f"features.{index}"
            index, number = index + 2, number + 1
    names.update(fc6="classifier.0", fc7="classifier.3")
    return names


TORCHVISION_NAMES: dict[str, str] = _torchvision_names()


class VGGNeck(nn.Sequential):
    """fc6 -> relu6 -> drop6 -> fc7 -> relu7 -> drop7 on flattened pooled ROI features:
    (R, C, S, S) -> (R, D). A ``Sequential``, so parameter names are ``fc6.weight``, ``fc7.bias``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if x.shape[1] != self.fc6.in_features:
            raise ValueError(
                f"fc6 takes {self.fc6.in_features} values per ROI (C x {ROI_SIZE} x {ROI_SIZE}), got"
                f" {x.shape[1]}: VGG16 needs roi_size={ROI_SIZE}"
            )
        return super().forward(x)


def _build(width: float) -> tuple[nn.Sequential, VGGNeck]:
    """The base and the neck at random initialisation (torchvision's), ``width`` scaling every layer."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    in_channels, block, number = 3, 1, 1
    for value in cfgs["D"]:
        if value == "M":
            if block <= 3:  # pool4 gives way to the dilated conv5; pool5 to the ROI pooler
                layers[f"pool{block}"] = nn.MaxPool2d(kernel_size=2, stride=2)
            block, number = block + 1, 1
            continue
        channels = max(1, round(value * width))
        dilation = CONV5_DILATION if block == 5 else 1
        layers[f"conv{block}_{number}"] = nn.Conv2d(
            in_channels, channels, kernel_size=3, padding=dilation, dilation=dilation
        )
        if (block, number) != (5, 3):
            layers[f"relu{block}_{number}"] = nn.ReLU(inplace=True)
        in_channels, number = channels, number + 1
    base = nn.Sequential(layers)
    base.out_channels = in_channels
    fc_dim = max(1, round(FC_DIM * width))
    neck = VGGNeck(
        OrderedDict(
            fc6=nn.Linear(in_channels * ROI_SIZE * ROI_SIZE, fc_dim),
            relu6=nn.ReLU(inplace=True),
            drop6=nn.Dropout(DROPOUT),
            fc7=nn.Linear(fc_dim, fc_dim),
            relu7=nn.ReLU(inplace=True),
            drop7=nn.Dropout(DROPOUT),
        )
    )
    for m in (*base.modules(), *neck.modules()):  # torchvision's VGG initialisation
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
    return base, neck


def _check_state_dict(state: dict[str, torch.Tensor], layers: dict[str, nn.Module], weights: str) -> None:
    """Raise unless ``state`` (torchvision's VGG16 keys) holds a finite tensor of the right shape for
    every parameter of ``layers`` (ours by name) and nothing else but the ImageNet classifier."""
    expected = {
        f"{TORCHVISION_NAMES[name]}.{kind}": getattr(layer, kind)
        for name, layer in layers.items()
        for kind in ("weight", "bias")
    }
    unused = {"classifier.6.weight", "classifier.6.bias"}  # the ImageNet classifier
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and k not in unused]
    misshapen = [k for k, p in expected.items() if k in state and state[k].shape != p.shape]
    if missing or unexpected or misshapen:
        raise ValueError(
            f"weights '{weights}' do not fit vgg16: missing {missing[:5]}, unexpected {unexpected[:5]},"
            f" wrong shape {misshapen[:5]}"
        )
    nonfinite = [k for k in expected if not torch.isfinite(state[k]).all()]
    if nonfinite:
        raise ValueError(
            f"weights '{weights}' hold non-finite values in {nonfinite[:5]}: fc6 and fc7 need the ImageNet"
            " classifier (VGG16_Weights.IMAGENET1K_V1; IMAGENET1K_FEATURES has none)"
        )


def vgg16_backbone(*, weights: str | None = None, freeze_at: int = 2, _width: float = 1.0) -> Backbone:
    """VGG16 behind the backbone seam: conv1_1..conv5_3 base at stride 8 (512 channels), fc6/fc7 neck
    giving 4096 features per ROI from RoIPool 7x7 (the backbone's ``pooler="pool", roi_size=7``, which
    the detector uses unless told otherwise).

    Args:
        weights: ImageNet weights, a torchvision name ("IMAGENET1K_V1", "DEFAULT",
            "VGG16_Weights.IMAGENET1K_V1") or a local file holding torchvision's ``vgg16`` state dict;
            ``None`` for random initialisation. fc6 and fc7 start from torchvision's ``classifier.0``
            and ``classifier.3``.
        freeze_at: how many conv blocks, from the image up, get no gradient: 0 trains everything, 2 (the
            reference) freezes conv1_x and conv2_x, 5 the whole base. The neck always trains.
        _width: channel and fc width multiplier, for fast tests only (ImageNet weights need 1.0).
    """
    if not 0 <= freeze_at <= 5:
        raise ValueError(f"freeze_at must be in 0..5 (conv blocks frozen), got {freeze_at}")
    if weights is not None and _width != 1.0:
        raise ValueError(f"ImageNet weights need _width=1.0, got {_width}")
    state = load_state_dict(weights, "vgg16") if weights is not None else None  # fail before building
    base, neck = _build(_width)
    if state is not None:
        children = {**dict(base.named_children()), **dict(neck.named_children())}
        layers = {name: children[name] for name in TORCHVISION_NAMES}
        _check_state_dict(state, layers, weights)
        with torch.no_grad():
            for name, layer in layers.items():
                layer.weight.copy_(state[f"{TORCHVISION_NAMES[name]}.weight"])
                layer.bias.copy_(state[f"{TORCHVISION_NAMES[name]}.bias"])
    for name in TORCHVISION_NAMES:
        if name.startswith("conv") and int(name[4]) <= freeze_at:
            getattr(base, name).requires_grad_(False)
    channels = base.conv5_3.out_channels
    return Backbone(
        base=base,
        neck=neck,
        stride=VGG16_STRIDE,
        feature_dim=neck.fc7.out_features,
        channels=channels,
        pooler="pool",  # fc6 was trained on 7x7 max-pooled features
        roi_size=ROI_SIZE,
    )
