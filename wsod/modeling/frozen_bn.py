"""Frozen BatchNorm that computes in its input's dtype, so that reduced precision stays reduced.

torchvision's ``FrozenBatchNorm2d`` multiplies the input by float32 scale and shift tensors. Elementwise
ops are not autocast ops, so under bf16/fp16 autocast the product is promoted back to float32: every
convolution of the base and the neck then outputs bf16, the norm turns it into float32, and the next
convolution casts it back. Activations kept for backward are float32 and the casts cost time; AMP saves
far less than it should. Here the folded scale and shift are cast to the input's dtype first.
"""

from __future__ import annotations

from torch import Tensor
from torchvision.ops.misc import FrozenBatchNorm2d as _TorchvisionFrozenBatchNorm2d

__all__ = ["FrozenBatchNorm2d"]


class FrozenBatchNorm2d(_TorchvisionFrozenBatchNorm2d):
    """torchvision's ``FrozenBatchNorm2d`` (same buffers, same state-dict keys) whose output keeps the
    input's dtype. (N, C, H, W) -> (N, C, H, W). In float32 and float64 the result is unchanged."""

    def forward(self, x: Tensor) -> Tensor:
        # Fold statistics and affine parameters in the buffers' precision, then cast the two
        # per-channel vectors (not the activation) to the activation's dtype.
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.to(x.dtype).reshape(1, -1, 1, 1) + shift.to(x.dtype).reshape(1, -1, 1, 1)
