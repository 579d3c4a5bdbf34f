"""Frozen BatchNorm that computes in its input's dtype, so that reduced precision stays reduced.

torchvision's ``FrozenBatchNorm2d`` multiplies the input by float32 scale and shift tensors. Elementwise
ops are not autocast ops, so under bf16/fp16 autocast the product is promoted back to float32: every
convolution of the base and the neck then outputs bf16, the norm turns it into float32, and the next
convolution casts it back. Activations kept for backward are float32 and the casts cost time; AMP saves
far less than it should. Here the folded scale and shift are cast to the input's dtype first.
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.ops.misc import FrozenBatchNorm2d as _TorchvisionFrozenBatchNorm2d

__all__ = ["FrozenBatchNorm2d", "freeze_batchnorm"]


class FrozenBatchNorm2d(_TorchvisionFrozenBatchNorm2d):
    """torchvision's ``FrozenBatchNorm2d`` (same buffers, same state-dict keys) whose output keeps the
    input's dtype. (N, C, H, W) -> (N, C, H, W). In float32 and float64 the result is unchanged."""

    def forward(self, x: Tensor) -> Tensor:
        # Fold statistics and affine parameters in the buffers' precision, then cast the two
        # per-channel vectors (not the activation) to the activation's dtype.
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.to(x.dtype).reshape(1, -1, 1, 1) + shift.to(x.dtype).reshape(1, -1, 1, 1)


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """``module`` with every train-mode ``BatchNorm2d`` in it (itself included) replaced by a
    ``FrozenBatchNorm2d`` holding its affine parameters and running statistics: what detectron2's
    ``ResNet.freeze`` does to the stages below ``FREEZE_AT`` (its ``convert_frozen_batchnorm``), so
    that a frozen stage is frozen in its statistics too, not only in its weights. Returns the module
    (a new one when ``module`` is itself a BatchNorm); children are replaced in place."""
    if isinstance(module, nn.BatchNorm2d):
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
        if module.affine:
            frozen.weight.copy_(module.weight.detach())
            frozen.bias.copy_(module.bias.detach())
        frozen.running_mean.copy_(module.running_mean)
        frozen.running_var.copy_(module.running_var)
        return frozen
    for name, child in module.named_children():
        replaced = freeze_batchnorm(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module
