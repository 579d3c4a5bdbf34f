"""The third stage's detector: torchvision's Faster R-CNN trained as a student on labelled and unlabelled
images, with pseudo boxes from its EMA teacher (SoS-WSOD's third stage, after unbiased-teacher; docs/
METHOD.md §14; suilin0432/SoS-WSOD has no licence and facebookresearch/unbiased-teacher is MIT: both read
for facts only).

A training batch holds two views of each image, weak then strong (``wsod.data.strong_augmentation.
WeakStrongViews``: the strong view is the weak one's geometry with photometric noise), row ``2 i + v``.
An image whose targets hold ``boxes`` is labelled (its pseudo boxes survived the split,
tools/split_pseudo_labels.py); one without is unlabelled (its image labels only).

- As the teacher (``teacher_inputs``, eval mode, no graph; ``wsod.engine.ema.EMATeacher`` calls it on
  its copy before each forward): torchvision's detections on the weak view of each unlabelled image,
  kept when their score is above ``score_threshold`` (strictly, as the reference's ``>``) and, with
  ``filter_by_image_labels``, when their class is one of the image's labels. They stay in torchvision's
  own terms: continuous xyxy boxes in the weak view's resized pixels and labels 1..C. The strong view
  has the same size and flip, so they are its targets as they are, with no conversion to wsod's
  inclusive boxes in original pixels and back.
- As the student (``forward``): torchvision's four losses on both views of the labelled images against
  their pseudo boxes, weight 1; and on the strong view of the unlabelled images against the teacher's
  boxes, each loss times ``unlabelled_weights[name]`` (SoS: RPN objectness and ROI classification x2,
  both box regressions x0). A zero weight drops that loss from the sum: no gradient flows from it, as
  the reference's multiplication by 0 gives. The unlabelled images' weak views only feed the teacher.

The ROI classifier's loss is ``FocalRoIHeads``'s softmax focal loss (the builder installs it). Prediction
and evaluation are ``FasterRCNNDetector``'s, unchanged: a checkpoint of this model loads into a plain
``FasterRCNNDetector`` (same modules, same state names), which is how tools/eval.py rebuilds it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchvision.models.detection import FasterRCNN

from wsod.modeling.faster_rcnn import FasterRCNNDetector
from wsod.modeling.focal_roi_heads import FocalRoIHeads
from wsod.modeling.method import TrainingProgress
from wsod.modeling.protocol import TrainingOutput

__all__ = ["SemiSupervisedFasterRCNN", "UNLABELLED_SUFFIX", "teacher_targets"]

# The unlabelled images' losses are logged under the labelled loss's name with this suffix.
UNLABELLED_SUFFIX = "_unlabelled"


def teacher_targets(
    detections: Sequence[Mapping[str, Tensor]],
    image_labels: Tensor,
    *,
    score_threshold: float,
    filter_by_image_labels: bool,
) -> list[dict[str, Tensor]]:
    """The teacher's pseudo boxes: per image, torchvision's ``detections[i]`` (``boxes`` (D, 4),
    ``scores`` (D,), ``labels`` (D,) in 1..C) scoring above ``score_threshold`` and, with
    ``filter_by_image_labels``, of a class in ``image_labels[i]`` ((B, C) multi-hot) -> ``{"boxes" (G, 4),
    "labels" (G,) int64 in 1..C}``, torchvision's target layout."""
    out = []
    for found, labels in zip(detections, image_labels, strict=True):
        keep = found["scores"] > score_threshold
        if filter_by_image_labels:
            keep &= labels[found["labels"] - 1] > 0  # torchvision's label c is wsod's class c - 1
        out.append({"boxes": found["boxes"][keep].float(), "labels": found["labels"][keep].long()})
    return out


class SemiSupervisedFasterRCNN(FasterRCNNDetector):
    """``FasterRCNNDetector`` trained on weak/strong pairs of labelled and unlabelled images (the module
    docstring).

    Args:
        detector: a torchvision ``FasterRCNN`` of ``num_classes + 1`` classes; its box head becomes a
            ``FocalRoIHeads`` of ``focal_gamma``.
        unlabelled_weights: the weight of each of ``FasterRCNNDetector.loss_names`` on the unlabelled
            images (every name, each >= 0).
        score_threshold: the teacher keeps detections scoring above it.
        filter_by_image_labels: the teacher keeps only the classes among the image's labels.
    """

    def __init__(
        self,
        detector: FasterRCNN,
        num_classes: int,
        *,
        unlabelled_weights: Mapping[str, float],
        focal_gamma: float = 1.5,
        score_threshold: float = 0.7,
        filter_by_image_labels: bool = True,
    ) -> None:
        super().__init__(detector, num_classes)
        if set(unlabelled_weights) != set(FasterRCNNDetector.loss_names):
            raise ValueError(
                f"unlabelled_weights must give each of {FasterRCNNDetector.loss_names} a weight, got"
                f" {sorted(unlabelled_weights)}"
            )
        negative = {k: v for k, v in unlabelled_weights.items() if not v >= 0}
        if negative:
            raise ValueError(f"unlabelled_weights must be >= 0, got {negative}")
        if not 0.0 <= score_threshold < 1.0:
            raise ValueError(f"score_threshold must be in [0, 1), got {score_threshold}")
        self.detector.roi_heads = FocalRoIHeads.from_heads(detector.roi_heads, focal_gamma=focal_gamma)
        self.unlabelled_weights = {name: float(unlabelled_weights[name]) for name in super().loss_names}
        self.score_threshold = float(score_threshold)
        self.filter_by_image_labels = bool(filter_by_image_labels)

    @property
    def loss_names(self) -> tuple[str, ...]:
        """The four labelled losses, then the unlabelled ones of non-zero weight (suffixed)."""
        unlabelled = [f"{n}{UNLABELLED_SUFFIX}" for n, w in self.unlabelled_weights.items() if w]
        return (*FasterRCNNDetector.loss_names, *unlabelled)

    @staticmethod
    def _rows(targets: Sequence[Mapping[str, Tensor]], views: int) -> tuple[list[int], list[int], list[int]]:
        """The rows of the labelled images (both views), and the weak and strong rows of the unlabelled
        ones, for a batch of ``views`` = 2 views per image."""
        if views != 2:
            raise ValueError(
                f"the third stage trains on a weak and a strong view of each image (views=2), got {views}"
            )
        labelled, weak, strong = [], [], []
        for image in range(len(targets) // 2):
            if "boxes" in targets[2 * image]:
                labelled += [2 * image, 2 * image + 1]
            else:
                weak.append(2 * image)
                strong.append(2 * image + 1)
        return labelled, weak, strong

    @torch.no_grad()
    def teacher_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """As the teacher: ``teacher_targets``, the pseudo boxes of each unlabelled image in batch order
        (``teacher_targets``), from its weak view; ``{}`` when the batch holds none."""
        _, weak, _ = self._rows(inputs["targets"], inputs["views"])
        if not weak:
            return {}
        sizes = [inputs["image_sizes"][r] for r in weak]
        detections = self.detector(
            [inputs["images"][r, :, :h, :w] for r, (h, w) in zip(weak, sizes, strict=True)]
        )
        image_labels = torch.stack([inputs["targets"][r]["labels"] for r in weak])  # (U, C) multi-hot
        found = teacher_targets(
            detections, image_labels, score_threshold=self.score_threshold,
            filter_by_image_labels=self.filter_by_image_labels,
        )  # fmt: skip
        return {"teacher_targets": found}

    def forward(
        self,
        images: Tensor,
        proposals: Sequence[Tensor] | None = None,
        image_labels: Tensor | None = None,
        image_sizes: Sequence[tuple[int, int]] | None = None,
        original_sizes: Sequence[tuple[int, int]] | None = None,
        targets: Sequence[dict[str, Tensor]] | None = None,
        views: int = 1,
        *,
        teacher_targets: Sequence[Mapping[str, Tensor]] | None = None,
        progress: TrainingProgress | None = None,
        keep: Collection[str] = (),
    ) -> TrainingOutput:
        """The student's losses (``loss_names``) on a batch of weak/strong pairs (the module docstring):
        inputs as ``FasterRCNNDetector.forward``'s, plus ``teacher_targets``, one per unlabelled image in
        batch order (the teacher's ``teacher_inputs``)."""
        self._check_training_call(keep, targets, image_sizes, original_sizes)
        labelled, _, strong = self._rows(targets, views)
        losses = dict.fromkeys(self.loss_names, images.new_zeros(()))
        if labelled:
            supervised = self._torchvision_targets(targets, image_sizes, original_sizes, labelled)
            losses.update(self._losses(images, image_sizes, supervised, labelled))
        if strong:
            if teacher_targets is None or len(teacher_targets) != len(strong):
                given = "none" if teacher_targets is None else len(teacher_targets)
                raise ValueError(
                    f"{len(strong)} unlabelled images need the teacher's boxes (teacher_targets: {given});"
                    " the third stage trains with its EMA teacher (solver.ema.enabled)"
                )
            found = self._losses(images, image_sizes, [dict(t) for t in teacher_targets], strong)
            for name, weight in self.unlabelled_weights.items():
                if weight:
                    losses[f"{name}{UNLABELLED_SUFFIX}"] = weight * found[name]
        return TrainingOutput({name: losses[name] for name in self.loss_names})
