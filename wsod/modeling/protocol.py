"""The detector contract: what code outside ``wsod/modeling/`` may use of a detector.

The weakly-supervised detector (``WeaklySupervisedDetector``), the second stage's Faster R-CNN wrapper
(``FasterRCNNDetector``) and the teacher–student pair evaluated together (``TeacherStudentPair``)
implement ``Detector``. The training step, the EMA teacher, prediction, evaluation, the export and the
benchmarks use these members and nothing else; none of them asks a model for its class.

Training (``model.train()``): ``model(**model_inputs(batch), **teacher_inputs, keep=...)`` returns one
``TrainingOutput``: the named losses (``loss_names``, in that order), plus the (R, D) ROI features and
each loss's pseudo-label weight scale when ``keep`` asks for them (a companion that combines the losses,
GradNorm, does), and the pseudo-labels the losses were computed from (the training log's pseudo-label
quality asks, at its log steps; a detector without pseudo-labels refuses it). ``views`` (the batch's,
``wsod.data.loader``): the batch holds B images x V views, flattened image-major (row ``i * V + v``).
``progress`` (``wsod.modeling.method.TrainingProgress``): where the training stands, which the training
step passes to every forward (a model whose losses follow no schedule ignores it).

Prediction, one test view at a time (``wsod.engine.inference.predict``): ``predict_view`` gives one
opaque record per image of the batch, in original pixels with flips undone; ``merge_views`` turns one
image's records of every view into its detections, with the ``DetectionSettings`` the caller passes
(the export passes its own cap instead of changing the model). ``postprocess`` is the per-class NMS of
per-ROI scores the random baseline uses.

Teacher and student (``wsod.engine.ema``): ``module_groups`` names the modules the EMA follows
(``"backbone"``, ``"neck"``, ``"heads"``); ``teacher_inputs`` is what this model, as a teacher, gives its
student's forward (the weakly-supervised detector: ``teacher_scores``, its per-ROI ``RoiScores``). A
model may also name weighted sources for some teacher tensors (``teacher_sources``, optional: the
weakly-supervised detector's come from its method, CBL's).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # annotations only: the method seam sits beside this contract
    from wsod.modeling.method import PseudoLabels

__all__ = [
    "DetectionSettings",
    "TrainingOutput",
    "TRAINING_EXTRAS",
    "MODULE_GROUPS",
    "Detector",
    "unflip_boxes",
    "check_keep",
]

# What a training forward's ``keep`` may ask for besides the losses (``TrainingOutput``'s optional fields).
TRAINING_EXTRAS = ("roi_features", "loss_scales", "pseudo_labels")
# The module groups every detector names (``Detector.module_groups``), which ``solver.ema.follow`` lists.
MODULE_GROUPS = ("backbone", "neck", "heads")


@dataclass(frozen=True)
class DetectionSettings:
    """Post-processing of detections: keep scores above ``score_threshold``, per-class NMS at
    ``nms_iou``, the best ``detections_per_image`` per image."""

    score_threshold: float = 0.0
    nms_iou: float = 0.3
    detections_per_image: int = 100


@dataclass
class TrainingOutput:
    """What a training forward returns.

    losses: the named scalar losses, in ``loss_names`` order; their sum is the training loss.
    roi_features: (R, D) the features the heads' losses were computed from (R = sum of the batch's
        ROIs), when ``keep`` holds ``"roi_features"``: where GradNorm measures gradient norms. A caller
        drops it before the backward, which frees it once the heads' gradients are computed.
    loss_scales: each loss's detached pseudo-label weight scale (``RefinementMethod.loss_scales``; 1 for
        losses the method gives none), when ``keep`` holds ``"loss_scales"``.
    pseudo_labels: ``[student k - 1][image i]`` the ``PseudoLabels`` records each student's losses were
        computed from (``wsod.modeling.method``), when ``keep`` holds ``"pseudo_labels"``;
    teacher_pseudo_boxes: with it, per image (boxes (G, 4), classes (G,) int64 in 0..C-1, scores (G,))
        the EMA teacher's pseudo boxes (``RefinementMethod.teacher_pseudo_boxes``), or None when the
        run has no teacher or the method names none. Both are detached and for looking at only (the
        training log's ``pseudo/*`` values, ``wsod.engine.pseudo_label_quality``).
    """

    losses: dict[str, Tensor]
    roi_features: Tensor | None = None
    loss_scales: dict[str, Tensor] | None = None
    pseudo_labels: list[list[PseudoLabels]] | None = None
    teacher_pseudo_boxes: list[tuple[Tensor, Tensor, Tensor]] | None = None


def check_keep(keep: Collection[str]) -> frozenset[str]:
    """``keep`` as a set, refused when it names something a training forward cannot return."""
    unknown = sorted(set(keep) - set(TRAINING_EXTRAS))
    if unknown:
        raise ValueError(
            f"keep={sorted(keep)}: {unknown} unknown; a training forward keeps {TRAINING_EXTRAS}"
        )
    return frozenset(keep)


@runtime_checkable
class Detector(Protocol):
    """What a detector offers to the code outside ``wsod/modeling/`` (the module docstring)."""

    @property
    def num_classes(self) -> int:
        """C, the foreground classes (labels 0..C-1)."""

    @property
    def loss_names(self) -> tuple[str, ...]:
        """The training losses, in the order ``TrainingOutput.losses`` holds them."""

    @property
    def detection_settings(self) -> DetectionSettings:
        """The detector's own post-processing settings (its config's)."""

    @property
    def makes_proposals(self) -> bool:
        """True when the detector proposes its own boxes (a region proposal network): prediction then
        needs no proposals from the data."""

    def predict_view(
        self, inputs: Mapping[str, Any], flipped: Sequence[bool], settings: DetectionSettings
    ) -> list[Any]:
        """One test view of a batch (``model_inputs``; ``flipped`` per image) -> one record per image,
        in original pixels with flips undone, for ``merge_views``. Called under ``torch.no_grad``."""

    def merge_views(self, views: Sequence[Any], settings: DetectionSettings) -> dict[str, Tensor]:
        """One image's ``predict_view`` records of every test view -> its detections: ``boxes`` (D, 4) in
        original pixels, ``scores`` (D,), ``labels`` (D,) in 0..C-1, ``image_scores`` (C,)."""

    def postprocess(
        self, scores: Tensor, boxes: Tensor, settings: DetectionSettings | None = None
    ) -> dict[str, Tensor]:
        """One image's per-ROI scores (R, C+1) and boxes (R, C+1, 4), column 0 the background ->
        detections after per-class NMS (``settings``: the detector's own when None)."""

    def module_groups(self) -> dict[str, list[nn.Module]]:
        """The modules of each group of ``MODULE_GROUPS``, for an EMA teacher to follow group by group."""

    def teacher_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """What this model, as a teacher, gives its student's training forward on the same ``inputs``
        (keyword arguments of the forward). Called under ``torch.no_grad`` in eval mode."""


def unflip_boxes(boxes: Tensor, width: int) -> Tensor:
    """Mirror (..., 4) xyxy boxes of a flipped image of ``width`` back (the transforms' ``x -> W - x``)."""
    return torch.stack([width - boxes[..., 2], boxes[..., 1], width - boxes[..., 0], boxes[..., 3]], dim=-1)
