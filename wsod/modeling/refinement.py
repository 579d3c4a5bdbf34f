"""Refinement students, MIST and OICR: pseudo ground truth from a teacher's scores, the students' losses.

Pseudo-labelling is a pure per-image function, run without gradients, so that it can be checked on its
own. Boxes are xyxy floats in input pixels; IoU is torchvision's ``box_iou`` (width = x2 - x1) and
regression targets are torchvision's ``BoxCoder`` encoding with weights (10, 10, 5, 5).

``MISTMethod`` and ``OICRMethod`` are the two as refinement methods (``wsod.modeling.method``): their
labeller plus ``refinement_losses``, student 1's losses weighted by ``first_student_loss_weight``;
``LabelerMethod`` does the same for any ``PseudoLabeler``.

Ordering conventions (they decide ties): proposals of a class are ranked by score with a stable sort, so
equal scores keep proposal order; pseudo boxes are listed class by class in ascending class order and,
within a class, in rank order; each ROI takes the first pseudo box of maximal IoU.

Foreground rule: MIST calls an ROI foreground at IoU >= ``fg_iou`` with its pseudo box, OICR at IoU >
``fg_iou`` (strict), as the reference code's two labellers do (docs/METHOD.md §4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import box_iou, nms

from wsod.modeling.box_coder import encode_boxes
from wsod.modeling.method import PseudoLabels, RefinementMethod, check_init_stds, check_source_scores
from wsod.modeling.mil import init_linear
from wsod.modeling.partial_labels import PartialLabels, partial_pseudo_labels

__all__ = [
    "RefinementStudent",
    "PseudoLabeler",
    "MISTLabeler",
    "OICRLabeler",
    "LabelerMethod",
    "MISTMethod",
    "OICRMethod",
    "PseudoBoxes",
    "mist_pseudo_boxes",
    "mist_pseudo_labels",
    "oicr_pseudo_boxes",
    "oicr_pseudo_labels",
    "refinement_losses",
    "roi_normalizer",
]

# A labeller's per-ROI (labels, weights, targets); the method record ``PseudoLabels`` holds the same three.
LabelTriple = tuple[Tensor, Tensor, Tensor]


class PseudoLabeler(Protocol):
    """A per-image labeller: one image's proposals (R, 4), source scores (R, C) of the foreground classes
    and image labels (C,) -> per-ROI labels (R,) int64 (0 = background, c + 1 = class c), weights (R,)
    and regression targets (R, 4). Called without gradients. See ``mist_pseudo_labels``; with the
    students' losses it is a refinement method (``LabelerMethod``)."""

    def __call__(self, proposals: Tensor, scores: Tensor, image_labels: Tensor) -> LabelTriple: ...


class RefinementStudent(nn.Module):
    """One student: a (C+1)-way classifier (column 0 = background) and, with ``box_regression`` (the
    default), a class-specific box regressor, starting at weights N(0, ``cls_std``) and N(0, ``box_std``),
    biases 0 (the method's ``student_cls_std`` and ``student_box_std``)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        box_regression: bool = True,
        cls_std: float = 0.001,
        box_std: float = 0.001,
    ) -> None:
        super().__init__()
        self.cls_score = init_linear(nn.Linear(in_features, num_classes + 1), cls_std)
        self.bbox_pred = (
            init_linear(nn.Linear(in_features, 4 * (num_classes + 1)), box_std) if box_regression else None
        )

    @property
    def box_regression(self) -> bool:
        return self.bbox_pred is not None

    def forward(self, roi_features: Tensor) -> tuple[Tensor, Tensor | None]:
        """roi_features (R, D) -> logits (R, C+1), box deltas (R, 4 (C+1)) laid out class by class (None
        without a box regressor)."""
        deltas = None if self.bbox_pred is None else self.bbox_pred(roi_features)
        return self.cls_score(roi_features), deltas


def _suppress_candidates(candidates: Tensor, tau: float, suppress: str) -> Tensor:
    """Indices of the kept candidates (rank order). candidates (k, 4) sorted by decreasing score."""
    if suppress == "candidates":
        # Reference code: a candidate survives if its IoU with *every* higher-ranked candidate is < tau,
        # whether or not those were kept themselves.
        earlier = box_iou(candidates, candidates).tril(diagonal=-1)
        keep = earlier.amax(dim=1) < tau
        keep[0] = True
        return keep.nonzero().squeeze(1)
    if suppress == "kept":
        # The paper's Algorithm 1: compare only with the kept ones, i.e. greedy NMS in rank order.
        # nms suppresses IoU > threshold; the rule is keep iff IoU < tau, so suppress IoU >= tau.
        threshold = torch.nextafter(
            torch.tensor(tau, dtype=candidates.dtype), torch.tensor(-1.0, dtype=candidates.dtype)
        ).item()
        rank_scores = torch.arange(len(candidates), 0, -1, dtype=candidates.dtype, device=candidates.device)
        return nms(candidates, rank_scores, threshold)
    raise ValueError(f"unknown suppress='{suppress}': expected 'candidates' or 'kept'")


def _assign_to_pseudo_boxes(
    proposals: Tensor,
    boxes: Tensor,
    classes: Tensor,
    box_scores: Tensor,
    fg_iou: float,
    *,
    strict: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Each ROI takes the pseudo box of maximal IoU: its class if IoU >= fg_iou (IoU > fg_iou when
    ``strict``), else background."""
    num_rois = proposals.shape[0]
    if boxes.shape[0] == 0:
        return (
            torch.zeros(num_rois, dtype=torch.int64, device=proposals.device),
            proposals.new_zeros(num_rois),
            proposals.new_zeros(num_rois, 4),
        )
    overlaps = box_iou(proposals, boxes)  # (R, G)
    assigned = overlaps.argmax(dim=1)  # first maximal pseudo box on ties
    max_iou = overlaps.gather(1, assigned[:, None]).squeeze(1)
    foreground = max_iou > fg_iou if strict else max_iou >= fg_iou
    labels = torch.where(foreground, classes[assigned] + 1, 0)
    weights = box_scores[assigned].to(proposals.dtype)
    targets = encode_boxes(boxes[assigned], proposals)
    targets = targets * (labels > 0)[:, None]  # background ROIs regress nothing
    return labels, weights, targets


PseudoBoxes = tuple[Tensor, Tensor, Tensor]  # boxes (G, 4), classes (G,) int64 in 0..C-1, scores (G,)


def _no_boxes(proposals: Tensor, scores: Tensor) -> PseudoBoxes:
    return (
        proposals.new_zeros(0, 4),
        torch.zeros(0, dtype=torch.int64, device=proposals.device),
        scores.new_zeros(0),
    )


@torch.no_grad()
def mist_pseudo_boxes(
    proposals: Tensor,
    scores: Tensor,
    image_labels: Tensor,
    *,
    p: float = 0.15,
    tau: float = 0.2,
    suppress: str = "candidates",
) -> PseudoBoxes:
    """MIST's pseudo ground-truth boxes for one image: for each class present in ``image_labels``, the
    top ``max(1, int(p * R))`` proposals by score, the first and each later one whose IoU with the
    earlier ones is < ``tau`` (all higher-ranked candidates for ``suppress="candidates"``, the reference
    code's rule; only the kept ones for ``suppress="kept"``, the paper's Algorithm 1), each carrying its
    score. Returns (boxes (G, 4), classes (G,) int64, scores (G,)), class by class in ascending order."""
    check_source_scores(proposals, scores, image_labels)
    top_k = max(1, int(p * proposals.shape[0]))  # the reference code crashes when int(p R) == 0
    boxes, classes, box_scores = [], [], []
    for c in (image_labels > 0).nonzero().flatten().tolist():
        order = torch.sort(scores[:, c], descending=True, stable=True).indices[:top_k]
        kept = order[_suppress_candidates(proposals[order], tau, suppress)]
        boxes.append(proposals[kept])
        classes.append(torch.full_like(kept, c))
        box_scores.append(scores[kept, c])
    if not boxes:
        return _no_boxes(proposals, scores)
    return torch.cat(boxes), torch.cat(classes), torch.cat(box_scores)


@torch.no_grad()
def mist_pseudo_labels(
    proposals: Tensor,
    scores: Tensor,
    image_labels: Tensor,
    *,
    p: float = 0.15,
    tau: float = 0.2,
    fg_iou: float = 0.5,
    suppress: str = "candidates",
) -> tuple[Tensor, Tensor, Tensor]:
    """MIST pseudo ground truth for one image: the pseudo boxes of ``mist_pseudo_boxes``, then each ROI
    assigned to its pseudo box of maximal IoU.

    Args:
        proposals: (R, 4) xyxy boxes with positive width and height.
        scores: (R, C) source scores of the C foreground classes.
        image_labels: (C,) multi-hot; nonzero = present.

    Returns:
        labels (R,) int64: 0 for background, c + 1 for foreground class c (assigned IoU >= fg_iou);
        weights (R,): score of the assigned pseudo box (background ROIs too; all 0 if no class present);
        targets (R, 4): BoxCoder (10, 10, 5, 5) encoding of the assigned box, zeros for background.
    """
    boxes = mist_pseudo_boxes(proposals, scores, image_labels, p=p, tau=tau, suppress=suppress)
    return _assign_to_pseudo_boxes(proposals, *boxes, fg_iou)


@torch.no_grad()
def oicr_pseudo_boxes(proposals: Tensor, scores: Tensor, image_labels: Tensor) -> PseudoBoxes:
    """OICR's pseudo ground-truth boxes for one image (Tang et al., CVPR 2017; reference ``oicr_layer``).

    The classes present in ``image_labels`` take one pseudo box each, in ascending class order: the
    proposal of highest score for that class (the first such proposal on ties), carrying that score.
    A taken proposal is blanked: its scores become 0 for every class, so a later class takes its best
    proposal among those no earlier class took (with scores >= 0, as the source scores are, a blanked
    proposal can be taken again only when every remaining score of that class is 0; it then carries 0).
    """
    check_source_scores(proposals, scores, image_labels)
    remaining = scores.clone()
    taken, classes, box_scores = [], [], []
    for c in (image_labels > 0).nonzero().flatten().tolist():
        top = int(torch.argmax(remaining[:, c]))  # argmax returns the first maximal index
        taken.append(top)
        classes.append(c)
        box_scores.append(remaining[top, c].clone())
        remaining[top] = 0
    if not taken:
        return _no_boxes(proposals, scores)
    index = torch.tensor(taken, dtype=torch.int64, device=proposals.device)
    return (
        proposals[index],
        torch.tensor(classes, dtype=torch.int64, device=proposals.device),
        torch.stack(box_scores),
    )


@torch.no_grad()
def oicr_pseudo_labels(
    proposals: Tensor, scores: Tensor, image_labels: Tensor, *, fg_iou: float = 0.5
) -> tuple[Tensor, Tensor, Tensor]:
    """OICR pseudo ground truth for one image: the boxes of ``oicr_pseudo_boxes``, then each ROI
    assigned to its pseudo box of maximal IoU, foreground when that IoU is **above** ``fg_iou``
    (strict; MIST's ``fg_iou`` is inclusive, IoU >= ``fg_iou``). Arguments and returns as
    ``mist_pseudo_labels``; regression targets are the same encoding as MIST's (the reference code's
    OICR path has no box regression).
    """
    boxes = oicr_pseudo_boxes(proposals, scores, image_labels)
    return _assign_to_pseudo_boxes(proposals, *boxes, fg_iou, strict=True)


@dataclass(frozen=True)
class MISTLabeler:
    """MIST pseudo-labels (``mist_pseudo_labels``) with fixed settings, as a ``PseudoLabeler``.
    ``fg_iou`` is inclusive: an ROI is foreground at IoU >= ``fg_iou``."""

    p: float = 0.15
    tau: float = 0.2
    suppress: str = "candidates"
    fg_iou: float = 0.5

    def __post_init__(self) -> None:
        if self.suppress not in ("candidates", "kept"):
            raise ValueError(f"unknown suppress '{self.suppress}': expected 'candidates' or 'kept'")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"MIST's top fraction p must be in [0, 1], got {self.p}")
        if not (0.0 <= self.tau <= 1.0 and 0.0 <= self.fg_iou <= 1.0):
            raise ValueError(
                f"MIST's tau and fg_iou must be in [0, 1], got tau={self.tau}, fg_iou={self.fg_iou}"
            )

    def __call__(self, proposals: Tensor, scores: Tensor, image_labels: Tensor) -> LabelTriple:
        return self.assign(proposals, self.pseudo_boxes(proposals, scores, image_labels))

    def pseudo_boxes(self, proposals: Tensor, scores: Tensor, image_labels: Tensor) -> PseudoBoxes:
        """The image's pseudo boxes (``mist_pseudo_boxes``)."""
        return mist_pseudo_boxes(
            proposals, scores, image_labels, p=self.p, tau=self.tau, suppress=self.suppress
        )

    def assign(self, proposals: Tensor, pseudo_boxes: PseudoBoxes) -> LabelTriple:
        """Per-ROI labels, weights, targets against ``pseudo_boxes`` (IoU >= ``fg_iou``: foreground)."""
        return _assign_to_pseudo_boxes(proposals, *pseudo_boxes, self.fg_iou)


@dataclass(frozen=True)
class OICRLabeler:
    """OICR pseudo-labels (``oicr_pseudo_labels``) as a ``PseudoLabeler``. ``fg_iou`` is strict: an ROI
    is foreground at IoU > ``fg_iou`` (``MISTLabeler``'s is inclusive, IoU >= ``fg_iou``)."""

    fg_iou: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.fg_iou <= 1.0:
            raise ValueError(f"OICR's fg_iou must be in [0, 1], got {self.fg_iou}")

    def __call__(self, proposals: Tensor, scores: Tensor, image_labels: Tensor) -> LabelTriple:
        return self.assign(proposals, self.pseudo_boxes(proposals, scores, image_labels))

    def pseudo_boxes(self, proposals: Tensor, scores: Tensor, image_labels: Tensor) -> PseudoBoxes:
        """The image's pseudo boxes (``oicr_pseudo_boxes``)."""
        return oicr_pseudo_boxes(proposals, scores, image_labels)

    def assign(self, proposals: Tensor, pseudo_boxes: PseudoBoxes) -> LabelTriple:
        """Per-ROI labels, weights, targets against ``pseudo_boxes`` (IoU > ``fg_iou``: foreground)."""
        return _assign_to_pseudo_boxes(proposals, *pseudo_boxes, self.fg_iou, strict=True)


def roi_normalizer(logits: Tensor, records: Sequence[PseudoLabels]) -> Tensor:
    """(R,) 1 / (R_i x B) for an ROI of image i (``records``: one per image, in order): weighted by it and
    summed, a per-ROI loss is a mean over each image's ROIs, then over the B images."""
    return torch.cat([logits.new_full((len(r),), 1 / (len(r) * len(records))) for r in records])


def refinement_losses(
    logits: Tensor,
    deltas: Tensor,
    labels: Tensor,
    weights: Tensor,
    targets: Tensor,
    roi_normalizer: Tensor,
) -> tuple[Tensor, Tensor]:
    """Weighted classification and box losses of one student over a batch of images.

    logits (R, C+1), deltas (R, 4 (C+1)); labels, weights, targets as from the pseudo-labellers,
    concatenated over images; roi_normalizer (R,) = 1 / (R_i * B) for an ROI of image i, so that each
    loss is a mean over the ROIs of each image, then a mean over images.

    cls = sum_r w_r CE(logits_r, label_r) n_r;
    box = sum over foreground r of w_r smoothL1_beta1(deltas_r[label_r], target_r) n_r (summed over x,y,w,h).
    """
    ce = F.cross_entropy(logits, labels, reduction="none")
    cls_loss = (weights * ce * roi_normalizer).sum()
    foreground = (labels > 0).nonzero().squeeze(1)
    # Reshape before indexing: (0, -1, 4) is ambiguous when no ROI is foreground (a batch whose images
    # have no positive class, e.g. VOC images whose objects are all difficult).
    per_class = deltas.view(deltas.shape[0], logits.shape[1], 4)
    fg_deltas = per_class[foreground, labels[foreground]]
    smooth_l1 = F.smooth_l1_loss(
        fg_deltas, targets[foreground].to(fg_deltas.dtype), beta=1.0, reduction="none"
    ).sum(dim=1)
    box_loss = (weights[foreground] * smooth_l1 * roi_normalizer[foreground]).sum()
    return cls_loss, box_loss


class LabelerMethod(RefinementMethod):
    """A ``PseudoLabeler`` as a refinement method: every student gets the labeller's per-ROI labels,
    weights and targets from its source scores and the image's ``targets["labels"]``, and learns with
    ``refinement_losses`` (``loss_ref_cls_k``, ``loss_ref_box_k``), student 1's two losses multiplied by
    ``first_student_loss_weight`` (the reference code's 3).

    Partial labels in an image's targets (points, scribbles, boxes) change that image's pseudo-labels
    by the rules of ``wsod.modeling.partial_labels`` (the labeller must name its pseudo boxes: MIST,
    OICR); an image without them is labelled exactly as before.

    ``mil_std``, ``student_cls_std``, ``student_box_std``: the heads' initial weights N(0, std)
    (``RefinementMethod``); wetectron's 0.001 by default."""

    reads_partial_labels = True

    def __init__(
        self,
        labeler: PseudoLabeler,
        *,
        first_student_loss_weight: float = 3.0,
        mil_std: float = 0.001,
        student_cls_std: float = 0.001,
        student_box_std: float = 0.001,
    ) -> None:
        if not first_student_loss_weight >= 0:
            raise ValueError(f"first_student_loss_weight must be >= 0, got {first_student_loss_weight}")
        check_init_stds(mil_std=mil_std, student_cls_std=student_cls_std, student_box_std=student_box_std)
        self.labeler = labeler
        self.first_student_loss_weight = first_student_loss_weight
        self.mil_std, self.student_cls_std, self.student_box_std = mil_std, student_cls_std, student_box_std

    def loss_names(self, num_students: int) -> tuple[str, ...]:
        return tuple(f"loss_ref_{kind}_{k}" for k in range(1, num_students + 1) for kind in ("cls", "box"))

    def pseudo_labels(
        self, student: int, proposals: Tensor, scores: Tensor, targets: Mapping[str, Tensor]
    ) -> PseudoLabels:
        image_labels = targets["labels"]
        names_boxes = hasattr(self.labeler, "pseudo_boxes") and hasattr(self.labeler, "assign")
        partial = PartialLabels.from_targets(targets, proposals)
        if partial is not None:
            if not names_boxes:
                raise ValueError(
                    f"{type(self.labeler).__name__} has no pseudo_boxes and assign methods, which partial"
                    " labels (points, scribbles, boxes) need (wsod.modeling.partial_labels)"
                )
            return partial_pseudo_labels(self.labeler, proposals, scores, image_labels, partial)
        if not names_boxes:
            return PseudoLabels(*self.labeler(proposals, scores, image_labels))
        # A labeller that names its pseudo boxes (MIST, OICR): the record keeps them for the previews.
        boxes = self.labeler.pseudo_boxes(proposals, scores, image_labels)
        labels, weights, targets_ = self.labeler.assign(proposals, boxes)
        return PseudoLabels(
            labels, weights, targets_, pseudo_boxes=boxes[0], pseudo_classes=boxes[1], pseudo_scores=boxes[2]
        )

    def losses(
        self,
        student: int,
        logits: Tensor,
        deltas: Tensor,
        records: Sequence[PseudoLabels],
        proposals: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        # Each loss is a mean over an image's ROIs, then over the images (docs/METHOD.md §4).
        cls_loss, box_loss = refinement_losses(
            logits,
            deltas,
            torch.cat([r.labels for r in records]),
            torch.cat([r.weights for r in records]),
            torch.cat([r.targets for r in records]),
            roi_normalizer(logits, records),
        )
        factor = self.first_student_loss_weight if student == 1 else 1.0
        return {f"loss_ref_cls_{student}": factor * cls_loss, f"loss_ref_box_{student}": factor * box_loss}

    def loss_scales(self, student: int, records: Sequence[PseudoLabels]) -> dict[str, Tensor]:
        """The mean pseudo-label weight under each loss, with the loss's own averaging (over an image's
        ROIs, then the images): all ROIs for ``loss_ref_cls_k``, the foreground ROIs' weights (each ROI
        still counted against its image's R_i) for ``loss_ref_box_k``. MIST weighs ROIs by its
        teacher's scores, so an untrained teacher gives tiny weights and a tiny loss: divided by
        these, the loss measures the student's fit (docs/METHOD.md §7)."""
        with torch.no_grad():
            cls = sum(r.weights.sum() / len(r) for r in records) / len(records)
            box = sum(r.weights[r.labels > 0].sum() / len(r) for r in records) / len(records)
        return {f"loss_ref_cls_{student}": cls.detach(), f"loss_ref_box_{student}": box.detach()}


class MISTMethod(LabelerMethod):
    """MIST (Ren et al., CVPR 2020): ``MISTLabeler(p, tau, suppress, fg_iou)`` with the students' weighted
    losses. The settings of ``configs/method/mist.yaml`` (the heads' initial stds: wetectron's 0.001)."""

    def __init__(
        self,
        *,
        p: float = 0.15,
        tau: float = 0.2,
        suppress: str = "candidates",
        fg_iou: float = 0.5,
        first_student_loss_weight: float = 3.0,
        mil_std: float = 0.001,
        student_cls_std: float = 0.001,
        student_box_std: float = 0.001,
    ) -> None:
        labeler = MISTLabeler(p=p, tau=tau, suppress=suppress, fg_iou=fg_iou)
        super().__init__(
            labeler,
            first_student_loss_weight=first_student_loss_weight,
            mil_std=mil_std,
            student_cls_std=student_cls_std,
            student_box_std=student_box_std,
        )

    @property
    def fg_iou(self) -> float:
        return self.labeler.fg_iou


class OICRMethod(LabelerMethod):
    """OICR (Tang et al., CVPR 2017): ``OICRLabeler(fg_iou)`` with the students' weighted losses. The
    settings of ``configs/method/oicr.yaml``; the MIL head and the students' classifiers start at the
    authors' N(0, 0.01) (ppengtang/pcl.pytorch ``lib/modeling/pcl_heads.py``), the box regressors, which
    their OICR has not, at 0.001 as MIST's."""

    def __init__(
        self,
        *,
        fg_iou: float = 0.5,
        first_student_loss_weight: float = 3.0,
        mil_std: float = 0.01,
        student_cls_std: float = 0.01,
        student_box_std: float = 0.001,
    ) -> None:
        super().__init__(
            OICRLabeler(fg_iou=fg_iou),
            first_student_loss_weight=first_student_loss_weight,
            mil_std=mil_std,
            student_cls_std=student_cls_std,
            student_box_std=student_box_std,
        )

    @property
    def fg_iou(self) -> float:
        return self.labeler.fg_iou
