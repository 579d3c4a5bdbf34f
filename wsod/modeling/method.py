"""The refinement-method seam: how the students learn, as one object the detector asks.

A refinement method (MIST, OICR, PCL...) decides two things for each student k = 1..K:

* ``pseudo_labels``: from one image's proposals, its source scores (the teacher's ROI scores for
  student 1, the softmax of student k-1 for k > 1; foreground columns only) and that image's
  ``targets`` dict, that image's pseudo ground truth, a ``PseudoLabels`` record. Called per image and
  without gradients. A method that follows partial labels (points, scribbles, supervising boxes in the
  targets) says so with ``reads_partial_labels``.
* ``losses``: from the student's outputs over the batch and the per-image records, that student's named
  losses. The method batches its own records (e.g. cluster ids need per-image offsets).

``loss_names(K)`` lists every loss the method returns, in order; the detector's ``loss_names`` are
``("loss_mil", *method.loss_names(K))``, which is what counts losses (GradNorm's weights, the logs), so a
method without a box loss or with three losses per student needs nothing changed elsewhere.

The detector owns the chain of source scores and the students; the method never sees a student
module, only its outputs. ``wsod.modeling.refinement`` holds MIST and OICR as methods
(``MISTMethod``, ``OICRMethod``) and ``LabelerMethod``, which turns any per-image ``PseudoLabeler``
into a method with the students' weighted losses; ``wsod.modeling.detector.METHODS`` names them for
configs (``configs/method/*.yaml``).

Targets (one dict per image, from the data loader): ``"labels"`` (C,) multi-hot, always; optional
supervision in the resized, flipped image's pixels, e.g. ``"points"`` (P, 2) xy with ``"point_labels"``
(P,), ``"boxes"`` (G, 4) xyxy with ``"box_labels"`` (G,); ``"proposal_ids"`` (R,) int64, each ROI's
index in its image's proposal list (the same in every view of the image). A method reads what it
understands.

Beyond the per-student losses, a method may add losses over the whole batch (``batch_losses``): it then
sees every view of each image (``MethodBatch``: the batch holds B images x V views, image-major), every
head's outputs, the EMA teacher's per-ROI scores (``RoiScores``) when the run has a teacher
(``solver.ema``), and where the training stands (``TrainingProgress``). Their names come last in
``loss_names``.

A method may own heads besides the students (``build_heads``: CBL's R-CNN head); the detector builds
them on the same ROI features, passes their outputs in ``MethodBatch.heads`` and asks the method what
it predicts with (``detection``). It may weigh the MIL loss by the training's progress
(``mil_loss_weight``), say which student tensors an EMA teacher's tensors follow (``teacher_sources``)
and how its predictions mix with its teacher's at test time (``mix_predictions``), and name the EMA
teacher's own pseudo boxes (``teacher_pseudo_boxes``), which the training log scores against the true
boxes (``pseudo/precision_teacher``, ``wsod.engine.pseudo_label_quality``) and nothing trains on.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = [
    "PseudoLabels",
    "RoiScores",
    "TrainingProgress",
    "MethodBatch",
    "RefinementMethod",
    "check_source_scores",
    "check_init_stds",
]


@dataclass(frozen=True)
class PseudoLabels:
    """One image's pseudo ground truth for one student.

    labels (R,) int64: 0 for background, c + 1 for foreground class c;
    weights (R,): each ROI's loss weight;
    targets (R, 4): regression targets (the ``BoxCoder`` (10, 10, 5, 5) encoding for MIST and OICR),
        zeros where nothing is regressed;
    extra: any other field the method's loss needs, per ROI (R, ...) or per image (e.g. a cluster id
        per ROI and a score per cluster); the method's ``losses`` is the only reader.
    pseudo_boxes (G, 4), pseudo_classes (G,) int64 (foreground class 0..C-1), pseudo_scores (G,): the
        pseudo ground-truth boxes the ROIs were labelled against (MIST's picks, OICR's top boxes, PCL's
        cluster centres), when the method has such boxes; what the training previews draw. None when
        the method does not say.
    """

    labels: Tensor
    weights: Tensor
    targets: Tensor
    extra: dict[str, Tensor] = field(default_factory=dict)
    pseudo_boxes: Tensor | None = None
    pseudo_classes: Tensor | None = None
    pseudo_scores: Tensor | None = None

    def __post_init__(self) -> None:
        if self.labels.dim() != 1 or self.labels.dtype != torch.int64:
            raise ValueError(
                f"PseudoLabels.labels must be (R,) int64, got {tuple(self.labels.shape)} {self.labels.dtype}"
            )
        num_rois = self.labels.shape[0]
        if self.weights.shape != (num_rois,) or self.targets.shape != (num_rois, 4):
            raise ValueError(
                f"PseudoLabels: weights must be (R,) and targets (R, 4) with R = {num_rois} (the labels'),"
                f" got {tuple(self.weights.shape)} and {tuple(self.targets.shape)}"
            )

        given = [t is not None for t in (self.pseudo_boxes, self.pseudo_classes, self.pseudo_scores)]
        if any(given) and not all(given):
            raise ValueError(
                "PseudoLabels: give pseudo_boxes, pseudo_classes and pseudo_scores together, or none"
            )
        if all(given):
            count = self.pseudo_boxes.shape[0]
            if (
                self.pseudo_boxes.shape != (count, 4)
                or self.pseudo_classes.shape != (count,)
                or self.pseudo_scores.shape != (count,)
            ):
                raise ValueError(
                    f"PseudoLabels: pseudo_boxes must be (G, 4), pseudo_classes and pseudo_scores (G,), got"
                    f" {tuple(self.pseudo_boxes.shape)}, {tuple(self.pseudo_classes.shape)},"
                    f" {tuple(self.pseudo_scores.shape)}"
                )

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass(frozen=True)
class RoiScores:
    """A weakly-supervised detector's per-ROI class probabilities on a batch (R = the batch's ROIs,
    images in order; column 0 the background), detached.

    mil: (R, C+1) the MIL head's (softmax over classes x softmax over each image's ROIs);
    students: K x (R, C+1), each student's softmax (none for a method without students).
    """

    mil: Tensor
    students: tuple[Tensor, ...] = ()

    @property
    def detection(self) -> Tensor:
        """(R, C+1) the scores the detector predicts with: the students' mean, or the MIL head's when
        there are no students (``WeaklySupervisedDetector.predict_rois``)."""
        if not self.students:
            return self.mil
        return torch.stack(self.students).mean(dim=0)


@dataclass(frozen=True)
class TrainingProgress:
    """Where a training run stands: the 0-based ``iteration`` of the optimizer step being computed, of
    ``max_iter``. The loop gives it to every training forward, so that a method whose losses follow a
    schedule (CBL's loss weights and thresholds) computes the same step on a resume."""

    iteration: int
    max_iter: int

    def __post_init__(self) -> None:
        if self.max_iter < 1 or self.iteration < 0:
            raise ValueError(f"TrainingProgress: need 0 <= iteration and max_iter >= 1, got {self}")

    @property
    def fraction(self) -> float:
        """iteration / max_iter."""
        return self.iteration / self.max_iter


@dataclass(frozen=True)
class MethodBatch:
    """One training batch as ``RefinementMethod.batch_losses`` sees it (full precision).

    proposals: B x V tensors (R_j, 4), view v of image i at ``j = i * V + v``, in that view's pixels;
    targets: the B x V targets dicts in the same order (``"proposal_ids"`` (R_j,) maps each ROI of a
        view to its image's proposal list: ROI a of one view and ROI b of another are the same box
        when their ids are equal);
    views: V;
    mil_scores: (R, C+1) the MIL head's ROI scores (with their graph);
    student_logits: K x (R, C+1) each student's logits (with their graph);
    teacher: the EMA teacher's ``RoiScores`` on the same views and ROIs, or None without a teacher;
    heads: each of the method's own heads' (``build_heads``) outputs on the batch's ROI features (with
        their graph), by name;
    progress: where the training stands, or None when the caller did not say (a forward outside the
        training loop).
    """

    proposals: Sequence[Tensor]
    targets: Sequence[Mapping[str, Tensor]]
    views: int
    mil_scores: Tensor
    student_logits: tuple[Tensor, ...]
    teacher: RoiScores | None = None
    heads: Mapping[str, Any] = field(default_factory=dict)
    progress: TrainingProgress | None = None

    @property
    def counts(self) -> list[int]:
        """R_j, the ROIs of each image-view."""
        return [len(p) for p in self.proposals]

    def by_view(self, per_roi: Tensor) -> list[list[Tensor]]:
        """A per-ROI tensor (R, ...) -> ``[image i][view v]`` its (R_iv, ...) rows."""
        parts = per_roi.split(self.counts)
        return [list(parts[i : i + self.views]) for i in range(0, len(parts), self.views)]

    def proposal_ids(self) -> list[list[Tensor]]:
        """``[image i][view v]`` the (R_iv,) proposal ids (``arange`` when the targets carry none)."""
        ids = [
            t["proposal_ids"] if "proposal_ids" in t else torch.arange(len(p), device=p.device)
            for t, p in zip(self.targets, self.proposals, strict=True)
        ]
        return [ids[i : i + self.views] for i in range(0, len(ids), self.views)]


class RefinementMethod(ABC):
    """How each student learns: per image pseudo-labels (no gradient), per student losses.

    ``student`` is the student's number k = 1..K, as in the loss names (student 1 learns from the MIL
    teacher). Every tensor is in full precision (the detector casts reduced-precision ROI features up
    and turns autocast off before calling a method).

    Two class attributes say what the detector builds for the method: ``box_regression`` (False: the
    students have no box regressor, ``losses`` receives ``deltas=None`` and inference keeps each
    proposal's own box, as PCL's reference does) and ``trains_students`` (False: no students at all,
    K = 0, and the MIL teacher's ROI scores are the detections: WSDDN).

    Three more say how the detector initialises the heads it builds: weights N(0, std), biases 0, with
    ``mil_std`` for the MIL head's two streams and ``student_cls_std`` / ``student_box_std`` for each
    student's classifier and box regressor. The defaults are wetectron's, MIST's code (0.001 for every
    head layer, ``roi_weak_predictors.py``:136-140); a method whose reference initialises otherwise takes
    its reference's as constructor arguments (PCL, OICR, CBL: N(0, 0.01), ``configs/method/<m>.yaml``).
    """

    box_regression: ClassVar[bool] = True
    trains_students: ClassVar[bool] = True
    # The heads' initial weights N(0, std): wetectron's, unless a method's constructor sets its own.
    mil_std: float = 0.001
    student_cls_std: float = 0.001
    student_box_std: float = 0.001
    # Whether the method learns from an EMA teacher (``MethodBatch.teacher``): the config checks then
    # refuse a run without one (``solver.ema.enabled``).
    needs_teacher: ClassVar[bool] = False
    # The names of the heads ``build_heads`` makes (the detector checks it holds exactly these).
    head_names: ClassVar[tuple[str, ...]] = ()
    # Whether ``pseudo_labels`` follows an image's partial labels (points, scribbles, boxes; see
    # wsod.modeling.partial_labels): the detector refuses to train a method that would ignore them.
    reads_partial_labels: ClassVar[bool] = False

    # Methods are equal when their settings (attributes) are: configs and checkpoints compare them.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # equal by settings, and mutable

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({settings})"

    @abstractmethod
    def loss_names(self, num_students: int) -> tuple[str, ...]:
        """Every loss ``losses`` returns for K = ``num_students`` students, student 1's first, each
        student's in the order its ``losses`` dict has them."""

    @abstractmethod
    def pseudo_labels(
        self, student: int, proposals: Tensor, scores: Tensor, targets: Mapping[str, Tensor]
    ) -> PseudoLabels:
        """One image's record: proposals (R, 4) xyxy in the resized image's pixels; scores (R, C) the
        source scores of the C foreground classes; targets the image's dict (``targets["labels"]``
        (C,) multi-hot, plus whatever supervision the data carries). Called under ``torch.no_grad``."""

    @abstractmethod
    def losses(
        self,
        student: int,
        logits: Tensor,
        deltas: Tensor | None,
        records: Sequence[PseudoLabels],
        proposals: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        """The student's named scalar losses: logits (R, C+1) (column 0 background) and box deltas
        (R, 4 (C+1); None when ``box_regression`` is False) of the whole batch (images concatenated in
        order, R = sum R_i); records and proposals (R_i, 4) one per image, in the same order."""

    def batch_losses(self, batch: MethodBatch) -> dict[str, Tensor]:
        """Losses over the whole batch (every view, every head, the EMA teacher's scores), after the
        students' own; their names end ``loss_names``. Default: none."""
        return {}

    def mix_scores(self, student: Tensor, teacher: Tensor) -> Tensor:
        """The per-ROI class probabilities (R, C+1) evaluation uses with ``model.eval_weights=mix``,
        from the student's and the EMA teacher's on the same ROIs. Default: their mean."""
        return (student + teacher) / 2

    def mix_predictions(self, own: Mapping[str, Tensor], teacher: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """One image-view's prediction record (``WeaklySupervisedDetector.predict_view``: ``scores``
        (R, C+1), ``boxes`` (R, C+1, 4), ``image_scores`` (C,), ``student_scores`` (K, R, C+1)) mixed
        with its EMA teacher's on the same ROIs (``model.eval_weights=mix``). Default: the scores by
        ``mix_scores``, the boxes and image scores averaged."""
        return {
            "scores": self.mix_scores(own["scores"], teacher["scores"]),
            "boxes": (own["boxes"] + teacher["boxes"]) / 2,
            "image_scores": (own["image_scores"] + teacher["image_scores"]) / 2,
        }

    def build_heads(self, in_features: int, num_classes: int) -> dict[str, nn.Module]:
        """The method's own heads on the (R, D = ``in_features``) ROI features, besides the MIL head and
        the students, by name (the detector holds them as ``method_heads.<name>``): exactly
        ``head_names``. Default: none."""
        return {}

    def detection(
        self,
        student_probs: Sequence[Tensor],
        student_deltas: Sequence[Tensor | None],
        heads: Mapping[str, Any],
    ) -> tuple[Tensor, Tensor | None]:
        """What inference predicts with, per ROI: from each student's softmax (R, C+1), its box deltas
        (R, 4 (C+1)) or None, and the method's heads' outputs, the class probabilities (R, C+1) and the
        box deltas (R, 4 (C+1)), or None to keep each proposal's box. Default: the students' mean
        probabilities and, with ``box_regression``, their mean deltas."""
        probs = torch.stack(list(student_probs)).mean(dim=0)
        if not self.box_regression:
            return probs, None
        return probs, torch.stack(list(student_deltas)).mean(dim=0)

    def mil_loss_weight(self, progress: TrainingProgress | None) -> float:
        """The factor of the MIL loss at this point of the training. Default: 1."""
        return 1.0

    def teacher_sources(self, num_students: int) -> dict[str, dict[str, float]]:
        """For an EMA teacher (``solver.ema``): ``{teacher state name: {student state name: weight}}``,
        the teacher tensors that follow a weighted sum of student tensors instead of their namesake
        (``wsod.engine.ema.EMATeacher``'s ``sources``; names as in the detector's ``state_dict``).
        Default: none."""
        return {}

    def teacher_pseudo_boxes(
        self, teacher: RoiScores, proposals: Sequence[Tensor], targets: Sequence[Mapping[str, Tensor]]
    ) -> list[tuple[Tensor, Tensor, Tensor]] | None:
        """The EMA teacher's pseudo boxes on a training batch, for the training log only
        (``pseudo/precision_teacher``): per image-view, (boxes (G, 4) in its pixels, classes (G,) int64
        in 0..C-1, scores (G,)), from the teacher's ``RoiScores`` on the batch's ROIs and the
        ``proposals`` / ``targets`` of ``MethodBatch``. Called without gradients at log steps only; it
        must draw no random number and change nothing, so a run logs it without training differently.
        Default: None (no teacher pseudo boxes to score)."""
        return None

    def loss_scales(self, student: int, records: Sequence[PseudoLabels]) -> dict[str, Tensor]:
        """How much pseudo-label weight each of the student's losses carries on this batch: a detached
        scalar per loss name (its per-ROI weights averaged as the loss averages its terms), so that
        ``loss / scale`` follows the student's own fit, not its teacher's confidence. GradNorm's rates
        read it (``solver.gradnorm.normalize_rates``). Default: none (every scale 1)."""
        return {}


def check_init_stds(**stds: float) -> None:
    """Initial weights' standard deviations (``mil_std=0.01``, ...) are finite and at least 0."""
    bad = [f"{name}={std}" for name, std in stds.items() if not 0 <= std < math.inf]
    if bad:
        raise ValueError(f"a head's initial std must be finite and >= 0, got {', '.join(bad)}")


def check_source_scores(proposals: Tensor, scores: Tensor, image_labels: Tensor) -> None:
    """A labeller's inputs agree: scores (R, C) for proposals (R, 4) and image_labels (C,)."""
    num_rois = proposals.shape[0]
    if scores.shape != (num_rois, image_labels.shape[0]):
        raise ValueError(
            f"scores must be (R, C) = ({num_rois}, {image_labels.shape[0]}), got {tuple(scores.shape)}"
        )
