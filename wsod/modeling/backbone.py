"""The backbone seam: what the detector needs from any network, whatever its family.

A backbone builder (``wsod.modeling.resnet.resnet_c4_backbone``, ``wsod.modeling.vgg``...) returns a
``Backbone``; ``wsod.modeling.detector.BACKBONES`` maps each name that configs may use to its builder.
The detector pools ROI features from ``base``'s output at ``1 / stride`` with the backbone's own
``pooler`` and ``roi_size`` (what its neck was trained on: VGG16's fc6 takes RoIPool 7x7, ResNet C4's
res5 RoIAlign 14x14; a config may still choose others) and hands them to ``neck``, which runs under
sequential backprop and so must treat ROIs independently.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Backbone"]


@dataclass
class Backbone:
    """base: images (B, 3, H, W) -> feature map (B, channels, H / stride, W / stride);
    neck: pooled ROI features (R, channels, S, S) -> ROI feature vectors (R, feature_dim);
    stride: the feature map's stride in input pixels (the ROI pooler's scale is 1 / stride);
    feature_dim: D, the width of the heads' input;
    channels: C, the feature map's (and so the pooled features') channels;
    pooler, roi_size: the ROI pooling the neck expects, S = roi_size ("align": RoIAlign, "pool":
        RoIPool; ``wsod.modeling.roi_head.build_roi_pooler``)."""

    base: nn.Module
    neck: nn.Module
    stride: int
    feature_dim: int
    channels: int
    pooler: str = "align"
    roi_size: int = 14
