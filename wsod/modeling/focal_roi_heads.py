"""torchvision's box head with a softmax focal loss on its classifier, for the third stage (SoS-WSOD trains
its ROI classifier with unbiased-teacher's focal loss on every image; docs/METHOD.md, issue 38).

``FocalRoIHeads`` is torchvision's ``RoIHeads`` (same sampler, matcher, box coder, post-processing);
only its training forward differs: the classification loss over the sampled ROIs is

    FL = mean over ROIs of (1 - p_t)^gamma x CE,   CE = -log p_t,   p_t = softmax(logits)[label],

which is the cross-entropy at gamma = 0; the box loss is torchvision's ``fastrcnn_loss``'s. Evaluation is
torchvision's forward, unchanged. Box heads only (no mask or keypoint branch). The reference's
(facebookresearch/unbiased-teacher, MIT, ``ubteacher/modeling/roi_heads/fast_rcnn.py``): gamma 1.5
(line 75), no class weight (``weight`` is stored, never used), the sum over the sampled ROIs divided by
their number (line 79); SoS-WSOD's copy is the same (``unbias/ubteacher/modeling/roi_heads/
fast_rcnn.py`` lines 77, 81).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.models.detection.roi_heads import RoIHeads, fastrcnn_loss

__all__ = ["FocalRoIHeads", "softmax_focal_loss"]


def softmax_focal_loss(logits: Tensor, labels: Tensor, gamma: float) -> Tensor:
    """The mean over the N rows of (1 - p_t)^gamma x CE: logits (N, C+1), labels (N,) int64 (0 is the
    background). p_t is exp(-CE), so the factor and the loss come from one log-softmax."""
    ce = F.cross_entropy(logits, labels, reduction="none")
    p_t = torch.exp(-ce)
    return ((1 - p_t) ** gamma * ce).mean()


class FocalRoIHeads(RoIHeads):
    """``RoIHeads`` whose training classification loss is ``softmax_focal_loss`` with ``focal_gamma``
    (the other arguments are ``RoIHeads``'). ``from_heads`` rebuilds an existing box head (the one
    ``torchvision.models.detection.FasterRCNN`` made) around the same modules and settings."""

    def __init__(self, *args, focal_gamma: float, **kwargs) -> None:
        if not focal_gamma >= 0:
            raise ValueError(f"FocalRoIHeads: focal_gamma must be >= 0, got {focal_gamma}")
        super().__init__(*args, **kwargs)
        self.focal_gamma = float(focal_gamma)

    @classmethod
    def from_heads(cls, heads: RoIHeads, *, focal_gamma: float) -> FocalRoIHeads:
        """A ``FocalRoIHeads`` sharing ``heads``' pooler, box head and predictor and copying its
        matcher, sampler, box coder and post-processing settings."""
        if heads.has_mask() or heads.has_keypoint():
            raise ValueError("FocalRoIHeads: box heads only (this one has a mask or keypoint branch)")
        return cls(
            heads.box_roi_pool,
            heads.box_head,
            heads.box_predictor,
            heads.proposal_matcher.high_threshold,
            heads.proposal_matcher.low_threshold,
            heads.fg_bg_sampler.batch_size_per_image,
            heads.fg_bg_sampler.positive_fraction,
            heads.box_coder.weights,
            heads.score_thresh,
            heads.nms_thresh,
            heads.detections_per_img,
            focal_gamma=focal_gamma,
        )

    def forward(
        self,
        features: dict[str, Tensor],
        proposals: list[Tensor],
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]] | None = None,
    ) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
        if not self.training:
            return super().forward(features, proposals, image_shapes, targets)
        if targets is None:
            raise ValueError("FocalRoIHeads: training needs targets")
        proposals, _, labels, regression_targets = self.select_training_samples(proposals, targets)
        box_features = self.box_head(self.box_roi_pool(features, proposals, image_shapes))
        class_logits, box_regression = self.box_predictor(box_features)
        # torchvision's box loss (its classification term is recomputed there and dropped: one
        # cross-entropy over the sampled ROIs, a few hundred rows).
        _, loss_box_reg = fastrcnn_loss(class_logits, box_regression, labels, regression_targets)
        loss_classifier = softmax_focal_loss(class_logits, torch.cat(labels), self.focal_gamma)
        return [], {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg}
