"""ROI feature extraction: ROI pooling + the backbone's per-ROI neck -> one vector per ROI.

Three ways to back-propagate through it (``chunk_size`` and ``fuse_pooling``):

* ``chunk_size=None``: plain autograd; the pooled (R, C, S, S) tensor and every neck activation of
  every ROI are kept until backward (about 4 MB per ROI for ResNet-50's res5 at 14x14).
* ``fuse_pooling=False``: the paper's sequential backprop around the neck only; the pooled tensor is
  kept (about 0.8 MB per ROI for ResNet-50 in float32), the neck's activations are recomputed chunk by
  chunk.
* ``fuse_pooling=True`` (default): pooling and neck are recomputed together, so only the feature map,
  the boxes and the (R, D) output are kept; the pooled tensor never exists for all ROIs at once.

``chunk_size="auto"`` chooses per step between plain autograd and the largest chunk that fits a memory
budget (``wsod.modeling.chunking``, where the budget and the per-ROI cost are defined).
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import Tensor, nn
from torchvision.ops import RoIAlign, RoIPool

from wsod.modeling.chunking import (
    AUTO,
    INFERENCE_FALLBACK_CHUNK,
    MIB,
    AutoChunk,
    Budget,
    NeckCost,
    measure_neck_cost,
    precision_key,
    resolve_budget,
)
from wsod.sequential_backprop import SequentialBackprop, check_per_sample_module

__all__ = ["RoIFeatureHead", "build_roi_pooler"]

logger = logging.getLogger(__name__)


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
        # With a pooler: features (B, C, H, W) shared, rois (R, 5) split; else features = pooled (R, ...).
        x = self.pooler(features, rois) if self.pooler is not None else features
        if self.dropblock is not None:
            x = self.dropblock(x)  # inside the recomputed region: its samples are replayed
        return self.neck(x)


class RoIFeatureHead(nn.Module):
    """Feature map + ROIs -> per-ROI feature vectors.

    Args:
        pooler: ``(features (B, C, H, W), rois (R, 5)) -> (R, C, S, S)``, e.g. ``build_roi_pooler()``.
        neck: ``(R, C, S, S) -> (R, D)``, e.g. ``ResNetNeck`` (res5 + average pooling). Must treat ROIs
            independently when ``chunk_size`` is set.
        chunk_size: ROIs per recompute chunk of sequential backprop; ``None`` for plain autograd;
            ``"auto"``: per step, plain autograd when all ROIs fit ``memory_budget_gb``, else the
            largest chunk that does (``wsod.modeling.chunking``).
        inference_chunk_size: ROIs per chunk when no gradient is needed (evaluation); default
            ``chunk_size`` (with ``"auto"``: the chunk auto chooses for the step's ROIs, which bounds the
            memory without a graph too). Without a graph a chunk costs only its transient activations, so
            this can be several times ``chunk_size``.
        fuse_pooling: recompute the pooling together with the neck (see the module docstring).
        dropblock: applied to the pooled features before the neck, e.g. ``ConcreteDropBlock``; it runs
            inside the sequentially back-propagated region, so its random samples are replayed in the
            recompute, and it must treat ROIs independently (ConcreteDropBlock does).
        memory_budget_gb: with ``chunk_size="auto"`` only: the GB the body (pooling + neck) may use;
            ``None``: on CUDA the allocator's available memory at the first forward minus a margin;
            training on another device needs a number.
    """

    def __init__(
        self,
        pooler: nn.Module,
        neck: nn.Module,
        *,
        chunk_size: int | str | None = 256,
        inference_chunk_size: int | None = None,
        fuse_pooling: bool = True,
        dropblock: nn.Module | None = None,
        memory_budget_gb: float | None = None,
    ) -> None:
        super().__init__()
        self.auto = chunk_size == AUTO
        if isinstance(chunk_size, str) and not self.auto:
            raise ValueError(f"chunk_size must be a positive integer, None or 'auto', got '{chunk_size}'")
        if memory_budget_gb is not None and not self.auto:
            raise ValueError(
                f"memory_budget_gb={memory_budget_gb} is used only with chunk_size='auto' (got chunk_size="
                f"{chunk_size})"
            )
        if memory_budget_gb is not None and not memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb must be a number > 0 or None, got {memory_budget_gb}")
        self.fuse_pooling = fuse_pooling
        self.memory_budget_gb = memory_budget_gb
        chunks = dict(chunk_size=None if self.auto else chunk_size, inference_chunk_size=inference_chunk_size)
        if fuse_pooling:
            self.pooler = None
            body = _NeckWithPooling(pooler, neck, dropblock)
            self.body = SequentialBackprop(body, **chunks, shared_inputs=(0,))
        else:
            self.pooler = pooler
            self.body = SequentialBackprop(_NeckWithPooling(None, neck, dropblock), **chunks)
        # chunk_size="auto": the budget (resolved once), the per-ROI cost per precision (measured once
        # each), the last choice (None: plain autograd) and how often each choice was made in training.
        self.budget: Budget | None = None
        self.costs: dict[str, NeckCost] = {}
        self.last_chunk: int | None = None
        self.choices: Counter[str] = Counter()

    @property
    def dropblock(self) -> nn.Module | None:
        """The DropBlock module inside the recomputed region, or None."""
        return self.body.module.dropblock

    def forward(self, features: Tensor, rois: Tensor) -> Tensor:
        """features (B, C, H, W), rois (R, 5) as (batch index, x1, y1, x2, y2) in input pixels ->
        (R, D)."""
        inputs = (features, rois) if self.fuse_pooling else (self.pooler(features, rois),)
        if not self.auto:
            return self.body(*inputs)
        needs_grad = self.body.needs_grad(*inputs)
        if not needs_grad and self.body.inference_chunk_size is not None:
            return self.body.run(inputs, self.body.inference_chunk_size, needs_grad=False)
        return self.body.run(inputs, self._auto_chunk(inputs, needs_grad), needs_grad=needs_grad)

    def policy(self, inputs: tuple[Tensor, ...], training: bool = True) -> AutoChunk | None:
        """The auto policy for a call on ``inputs`` (``forward``'s body inputs): the budget, resolved at
        the first call, and the per-ROI cost in the call's precision, measured at its first call. ``None``
        when no budget can be found and ``training`` is false."""
        device = inputs[0].device
        if self.budget is None:
            self.budget = resolve_budget(self.memory_budget_gb, device)
            if self.budget is None:
                if training:
                    raise ValueError(
                        f"chunk_size='auto' on {device.type} needs a memory budget: set"
                        " model.memory_budget_gb (build_detector(memory_budget_gb=...)), the GB the ROI"
                        " pooling and neck may use; only CUDA finds one by itself"
                    )
                return None
            logger.info("chunk_size=auto: budget %.3f GB (%s)", self.budget.bytes / 2**30, self.budget.source)
        key = precision_key(device, inputs[0])
        if key not in self.costs:
            if training:
                check_per_sample_module(self.body.module)  # a probe must not update BatchNorm statistics
            self.costs[key] = measure_neck_cost(
                self.body.module, inputs, split=[1] if self.fuse_pooling else [0], grad_inputs=(0,)
            )
            policy = AutoChunk(self.budget.bytes, self.costs[key].per_roi)
            logger.info(
                "chunk_size=auto: ROI %s measured: %s; plain autograd up to %s ROIs, chunks of %s"
                " beyond", "pooling + neck" if self.fuse_pooling else "neck", self.costs[key].describe(),
                policy.max_rois, policy.choose(int(policy.max_rois) + 1) if policy.per_roi_bytes else "-",
            )  # fmt: skip
            if policy.max_rois < 1:  # chunks of one ROI, and still each one beyond the budget
                logger.warning(
                    "chunk_size=auto: the budget of %.3f MB (%s) is smaller than one ROI's cost, %.3f MB in"
                    " %s: every step runs in chunks of 1 ROI (the slowest) and still exceeds it; give"
                    " model.memory_budget_gb more than %.3g (one ROI), or many times that for chunks that"
                    " run fast", self.budget.bytes / MIB, self.budget.source, policy.per_roi_bytes / MIB, key,
                    policy.per_roi_bytes / 2**30,
                )  # fmt: skip
        return AutoChunk(self.budget.bytes, self.costs[key].per_roi)

    def _auto_chunk(self, inputs: tuple[Tensor, ...], training: bool) -> int | None:
        num_rois = inputs[-1].shape[0]
        if num_rois == 0:
            return None
        policy = self.policy(inputs, training)
        if policy is None:  # inference on a device without a budget
            if "fallback" not in self.choices:
                self.choices["fallback"] += 1
                logger.info(
                    "chunk_size=auto without a memory budget on %s: inference in chunks of %d ROIs",
                    inputs[0].device.type, INFERENCE_FALLBACK_CHUNK,
                )  # fmt: skip
            return INFERENCE_FALLBACK_CHUNK
        chunk = policy.choose(num_rois)
        self.last_chunk = chunk
        if training:
            name = "plain" if chunk is None else f"chunk {chunk}"
            if name not in self.choices:  # each kind of choice is logged the first time it is made
                needed = num_rois * policy.per_roi_bytes / MIB
                logger.info(
                    "chunk_size=auto: %d ROIs need %.0f MB of %.0f MB: %s", num_rois, needed,
                    policy.budget_bytes / MIB,
                    "plain autograd" if chunk is None else f"sequential backprop in chunks of {chunk} ROIs",
                )  # fmt: skip
            self.choices[name] += 1
        return chunk

    def extra_repr(self) -> str:
        if not self.auto:
            return ""
        return f"chunk_size=auto, memory_budget_gb={self.memory_budget_gb}"
