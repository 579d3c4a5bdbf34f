"""Concrete DropBlock on ROI-pooled features (Ren et al., CVPR 2020, "context-focused" training).

A small scorer looks at each ROI's pooled features and proposes where to drop: per location a drop
probability ``p = sigmoid(score) * gamma`` with ``gamma = drop_rate / block_size**2``, a hard
Gumbel-softmax sample of (drop, keep) gives drop seeds, each seed is grown into a ``block_size`` square
and the kept features are rescaled. The sample is straight-through, so the detector loss reaches the
scorer's parameters (the adversarial step that trains it is not part of this module).

Two deliberate differences from the paper's reference implementation, both because the module must
run inside ``SequentialBackprop`` (which recomputes chunks of ROIs and refuses train-mode BatchNorm):

* the scorer normalises with GroupNorm (per ROI) instead of train-mode BatchNorm across all ROIs, which
  would mix ROIs, depend on the chunking and update its running statistics again in every recompute;
* the rescaling ``numel(mask) / sum(mask)`` is computed per ROI (its S x S locations, broadcast over
  channels) instead of over all ROIs at once, so a chunk's output does not depend on the other chunks.
  A ROI whose mask drops every location would divide by zero: its denominator is clamped to 1, so that
  ROI's output is all zeros (everything was dropped) and its gradients stay finite.

Randomness comes only from torch's global RNG (``torch.rand_like``), so ``SequentialBackprop``'s
per-chunk RNG stash and replay redraws exactly the same blocks in the recompute.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wsod.modeling.resnet import make_norm_layer

__all__ = ["ConcreteDropBlock"]


class ConcreteDropBlock(nn.Module):
    """Learned, sampled block dropping on ROI features; the identity in eval mode.

    Args:
        in_channels: C of the pooled features.
        drop_rate: upper bound on the expected dropped fraction of locations (union bound over a block);
            ``gamma = drop_rate / block_size**2`` is the largest seed probability, must be in [0, 1).
        block_size: odd side of the square grown around each seed.
        temperature: of the Gumbel-softmax relaxation whose gradient the straight-through sample uses.
        hidden_channels: width of the scorer's hidden layer; default ``in_channels`` (the reference's).
            The scorer's 3x3 convolution costs ``9 * in_channels * hidden * S**2`` multiply-adds per
            ROI: for ResNet C4's 1024 channels at 14 x 14 a full-width scorer would cost more than res5
            itself, so the ResNet configs use 256 (docs/RECIPES.md).

    Forward: x (R, C, S, S) -> (R, C, S, S) in x's dtype. Training: ``x * keep * S**2 / sum(keep)``
    per ROI, keep (R, 1, S, S) in {0, 1}. Eval: ``x`` itself.
    """

    def __init__(
        self,
        in_channels: int,
        drop_rate: float = 0.3,
        block_size: int = 3,
        temperature: float = 0.01,
        hidden_channels: int | None = None,
    ) -> None:
        super().__init__()
        if block_size < 1 or block_size % 2 == 0:
            # An even block with padding block_size // 2 would change the spatial size.
            raise ValueError(f"block_size must be a positive odd integer, got {block_size}")
        self.gamma = drop_rate / block_size**2
        if not 0 <= self.gamma < 1:
            raise ValueError(f"drop_rate / block_size**2 must be in [0, 1), got {self.gamma}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.drop_rate = drop_rate
        self.block_size = block_size
        self.temperature = temperature
        hidden = hidden_channels or in_channels
        # The reference's residual scorer: conv3x3 - norm - ReLU - conv3x3 - norm, plus a 1x1 shortcut,
        # without biases (the norms' affine parameters are the biases). Output channel 0 is the drop
        # score; channel 1 is unused, as in the reference.
        self.scorer = nn.Sequential(
            nn.Conv2d(in_channels, hidden, 3, padding=1, bias=False),
            make_norm_layer("gn")(hidden),  # per-ROI GroupNorm, up to 32 groups
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden, 2, 3, padding=1, bias=False),
            nn.GroupNorm(2, 2),  # each score map normalised over its ROI's locations
        )
        self.shortcut = nn.Conv2d(in_channels, 2, 1, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference's initialisation (wetectron ``cdb.py``): Kaiming-normal weights, fan_out mode,
        ReLU gain (std sqrt(2 / (out_channels * k * k))) for the three convolutions; the norms' scales 1
        and shifts 0. With PyTorch's default (Kaiming-uniform, fan_in, a = sqrt(5)) the shortcut's
        1 x 1 weights have std 1 / sqrt(3 C), the drop scores start near constant across locations and
        the masks near plain random DropBlock; with these (shortcut std 1) they start far from 0 and
        follow the features, as the reference's."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.GroupNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def extra_repr(self) -> str:
        return f"drop_rate={self.drop_rate}, block_size={self.block_size}, temperature={self.temperature}"

    def _drop_score(self, x: Tensor) -> Tensor:
        """x (R, C, S, S) -> drop score (R, 1, S, S). The scorer sees ``x.detach()``: its path must not
        train the features, which get their gradient through the mask multiplication only."""
        x = x.detach()
        return (self.scorer(x) + self.shortcut(x))[:, :1]

    def seed_probability(self, x: Tensor) -> Tensor:
        """x (R, C, S, S) -> drop-seed probability p (R, 1, S, S) in [0, gamma]."""
        return torch.sigmoid(self._drop_score(x)) * self.gamma

    def keep_mask(self, x: Tensor) -> Tensor:
        """x (R, C, S, S) -> keep mask (R, 1, S, S): exactly 0/1 in forward, straight-through gradient
        to the scorer. Draws one uniform per location and category from the global RNG."""
        score = self._drop_score(x)
        # Sample in float32 at least: a bfloat16 log-probability would distort p by about a percent.
        score = score.to(torch.promote_types(score.dtype, torch.float32))
        # log p and log(1 - p) without forming p first: exact for tiny p, finite for gamma < 1.
        log_drop = F.logsigmoid(score) + (math.log(self.gamma) if self.gamma > 0 else -math.inf)
        log_keep = torch.log1p(-torch.sigmoid(score) * self.gamma)
        logits = torch.cat([log_drop, log_keep], dim=1)  # (R, 2, S, S): category 0 drops
        # Gumbel noise -log(-log u); u clamped above 0 so that the noise stays finite.
        u = torch.rand_like(logits).clamp_(min=torch.finfo(logits.dtype).tiny)
        perturbed = logits - torch.log(-torch.log(u))
        hard = (perturbed[:, :1] > perturbed[:, 1:]).to(logits.dtype)  # Gumbel-max: drop w.p. p
        soft = torch.softmax(perturbed / self.temperature, dim=1)
        # Straight-through: forward is the 0/1 sample (soft - soft.detach() is exactly 0), backward is
        # the relaxation's gradient, which is how the detector loss reaches the scorer.
        seeds = hard + (soft[:, :1] - soft[:, :1].detach())
        blocks = F.max_pool2d(seeds, self.block_size, stride=1, padding=self.block_size // 2)
        return (1 - blocks).to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        keep = self.keep_mask(x)
        # Per-ROI rescaling (see the module docstring); the clamp only acts on a fully dropped ROI.
        kept = keep.sum(dim=(2, 3), keepdim=True).clamp(min=1)
        return x * (keep * (keep.shape[2] * keep.shape[3] / kept))
