"""The stock PyTorch alternatives to sequential backprop, as the ROI benchmark measures them.

A user whose per-ROI head runs out of memory reaches for these first. Each wraps the ROI head's body
(ROI pooling + DropBlock + neck, ``(features (B, C, H, W), rois (R, 5)) -> (R, D)``, the module that
``SequentialBackprop`` wraps in wsod's fused path) and is a few lines a user could write:

* ``ckpt_chunk``: ``torch.utils.checkpoint`` (non-reentrant) called once per chunk of ROIs, pooling
  inside. The engine runs the most recently created nodes first, so each chunk's recompute and backward
  finish before the next chunk's start: one chunk's activations at a time, like wsod's fused path.
* ``offload``: the whole body under ``torch.autograd.graph.save_on_cpu`` (pinned memory on CUDA): every
  tensor autograd saves is copied to host memory and back in backward. On CPU it only adds copies.
* ``compile``: ``torch.compile`` of the body with the min-cut partitioner's activation memory budget
  (``COMPILE_ACTIVATION_MEMORY_BUDGET``), which recomputes what it can in backward instead of saving it.
* ``vmap_chunk``: ``torch.func.vmap(per-ROI neck, chunk_size=chunk)`` over the pooled features: the
  question of the forum thread the project started from (can vmap replace the chunk loop?). Pooling runs
  outside vmap on all ROIs at once: torchvision's ``roi_align`` has no batching rule, and vmap's fallback
  loop makes its backward produce a full feature-map gradient per ROI (measured: 7.7 MB per ROI for the
  R50-C4 head, docs/BENCHMARKS.md), which would measure the missing rule rather than vmap.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["STOCK_STRATEGIES", "COMPILE_ACTIVATION_MEMORY_BUDGET", "StockBackpropBody"]

STOCK_STRATEGIES = ("ckpt_chunk", "offload", "compile", "vmap_chunk")
# torch._functorch.config.activation_memory_budget for ``compile`` (1.0 is torch's default: save what
# the default partitioner saves; 0.0: recompute all it can). On this project's 2-core AMD EPYC machine,
# R50-C4's head (a 1x1024x38x50 feature map, RoIAlign 14x14, res5, mean pool, a 21-way linear layer),
# one forward and backward at 64 and 256 ROIs: 1.0 -> 5.4 MB per ROI, 0.5 -> 4.4, 0.0 -> 6.0 (plain
# autograd: 4.3). 0.5 was the least; none removes the per-ROI slope, since the compiled backward still
# recomputes all ROIs at once.
COMPILE_ACTIVATION_MEMORY_BUDGET = 0.5


class StockBackpropBody(nn.Module):
    """One stock strategy around ``module`` (the ROI head's body: ``(features, rois) -> (R, D)``, with
    ``pooler``, ``dropblock`` and ``neck`` attributes; see the module docstring).

    Args:
        strategy: one of ``STOCK_STRATEGIES``.
        module: the body; kept as ``self.module`` so that ``RoIFeatureHead.dropblock`` finds its DropBlock.
        chunk_size: ROIs per chunk for ``ckpt_chunk`` and ``vmap_chunk`` (ignored by the others).
    """

    def __init__(self, strategy: str, module: nn.Module, chunk_size: int | None = None) -> None:
        super().__init__()
        if strategy not in STOCK_STRATEGIES:
            raise ValueError(f"unknown stock strategy '{strategy}': expected one of {STOCK_STRATEGIES}")
        if strategy in ("ckpt_chunk", "vmap_chunk") and not (chunk_size and chunk_size > 0):
            raise ValueError(f"{strategy} needs a positive chunk_size, got {chunk_size}")
        self.strategy = strategy
        self.module = module
        self.chunk_size = chunk_size
        # Compiled on the first call, under the activation budget (the partitioner reads it then). The bound
        # forward, not the module, so that the body's parameters are not registered a second time.
        self._compiled = torch.compile(module.forward, dynamic=False) if strategy == "compile" else None

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}, chunk_size={self.chunk_size}"

    def forward(self, features: Tensor, rois: Tensor) -> Tensor:
        """features (B, C, H, W), rois (R, 5) -> (R, D)."""
        if self.strategy == "ckpt_chunk":
            return torch.cat(
                [
                    checkpoint(
                        self.module, features, rois[start : start + self.chunk_size], use_reentrant=False
                    )
                    for start in range(0, rois.shape[0], self.chunk_size)
                ]
            )
        if self.strategy == "offload":
            with torch.autograd.graph.save_on_cpu(pin_memory=features.is_cuda):
                return self.module(features, rois)
        if self.strategy == "compile":
            import torch._functorch.config as functorch_config

            with functorch_config.patch(activation_memory_budget=COMPILE_ACTIVATION_MEMORY_BUDGET):
                return self._compiled(features, rois)
        return self._vmap_chunk(features, rois)

    def _vmap_chunk(self, features: Tensor, rois: Tensor) -> Tensor:
        body = self.module
        pooled = body.pooler(features, rois)  # (R, C, S, S), all ROIs at once (module docstring)
        if body.dropblock is not None:
            pooled = body.dropblock(pooled)
        if pooled.shape[0] == 0:
            return body.neck(pooled)
        per_roi = lambda x: body.neck(x.unsqueeze(0)).squeeze(0)  # noqa: E731  (C, S, S) -> (D,)
        return torch.func.vmap(per_roi, chunk_size=self.chunk_size)(pooled)
