"""ROI feature extraction: ROI pooling + the backbone's per-ROI neck -> one vector per ROI.

Three ways to back-propagate through it (``chunk_size`` and ``fuse_pooling``):

* ``chunk_size=None``: plain autograd; the pooled (R, C, S, S) tensor and every neck activation of
  every ROI are kept until backward (about 4 MB per ROI for ResNet-50's res5 at 14x14).
* ``fuse_pooling=False``: the paper's sequential backprop around the neck only; the pooled tensor is
  kept (about 0.8 MB per ROI for ResNet-50 in float32), the neck's activations are recomputed chunk by
  chunk.
* ``fuse_pooling=True`` (default): pooling and neck are recomputed together, so only the feature map,
  the boxes and the (R, D) output are kept; the pooled tensor never exists for all ROIs at once.
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.ops import RoIAlign, RoIPool

from wsod.sequential_backprop import SequentialBackprop

__all__ = ["RoIFeatureHead", "build_roi_pooler"]


def build_roi_pooler(
    kind: str = "align",
    output_size: int = 14,
    spatial_scale: float = 1 / 16,
    sampling_ratio: int = 0,
) -> nn.Module:
    """torchvision's RoIAlign (``aligned=True``, half-pixel corrected) or RoIPool."""
    if kind == "align":
        return RoIAlign(output_size, spatial_scale, sampling_ratio, aligned=True)
    if kind == "pool":
        return RoIPool(output_size, spatial_scale)
    raise ValueError(f"unknown ROI pooler '{kind}': expected 'align' or 'pool'")


class _NeckWithPooling(nn.Module):
    """(optional pooler) -> (optional DropBlock) -> neck -> (R, D). One sample per ROI."""

    def __init__(self, pooler: nn.Module | None, neck: nn.Module, dropblock: nn.Module | None = None) -> None:
        super().__init__()
        self.pooler = pooler
        self.dropblock = dropblock
        self.neck = neck

    def forward(self, features: Tensor, rois: Tensor | None = None) -> Tensor:
        # With a pooler: features (B, C4, H, W) shared, rois (R, 5) split; else features = pooled (R, ...).
        x = self.pooler(features, rois) if self.pooler is not None else features
        if self.dropblock is not None:
            x = self.dropblock(x)  # inside the recomputed region: its samples are replayed
        return self.neck(x)


class RoIFeatureHead(nn.Module):
    """Feature map + ROIs -> per-ROI feature vectors.

    Args:
        pooler: ``(features (B, C4, H, W), rois (R, 5)) -> (R, C4, S, S)``, e.g. ``build_roi_pooler()``.
        neck: ``(R, C, S, S) -> (R, D)``, e.g. ``ResNetNeck`` (res5 + average pooling). Must treat ROIs
            independently when ``chunk_size`` is set.
        chunk_size: ROIs per recompute chunk of sequential backprop; ``None`` for plain autograd.
        inference_chunk_size: ROIs per chunk when no gradient is needed (evaluation); default
            ``chunk_size``. Without a graph a chunk costs only its transient activations, so this can be
            several times ``chunk_size``.
        fuse_pooling: recompute the pooling together with the neck (see the module docstring).
        dropblock: applied to the pooled features before the neck, e.g. ``ConcreteDropBlock``; it runs
            inside the sequentially back-propagated region, so its random samples are replayed in the
            recompute, and it must treat ROIs independently (ConcreteDropBlock does).
    """

    def __init__(
        self,
        pooler: nn.Module,
        neck: nn.Module,
        *,
        chunk_size: int | None = 256,
        inference_chunk_size: int | None = None,
        fuse_pooling: bool = True,
        dropblock: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.fuse_pooling = fuse_pooling
        chunks = dict(chunk_size=chunk_size, inference_chunk_size=inference_chunk_size)
        if fuse_pooling:
            self.pooler = None
            body = _NeckWithPooling(pooler, neck, dropblock)
            self.body = SequentialBackprop(body, **chunks, shared_inputs=(0,))
        else:
            self.pooler = pooler
            self.body = SequentialBackprop(_NeckWithPooling(None, neck, dropblock), **chunks)

    @property
    def dropblock(self) -> nn.Module | None:
        """The DropBlock module inside the recomputed region, or None."""
        return self.body.module.dropblock

    def forward(self, features: Tensor, rois: Tensor) -> Tensor:
        """features (B, C, H, W), rois (R, 5) as (batch index, x1, y1, x2, y2) in input pixels ->
        (R, D)."""
        if self.fuse_pooling:
            return self.body(features, rois)
        return self.body(self.pooler(features, rois))
