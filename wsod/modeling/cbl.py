"""CBL: cyclic-bootstrap labelling (Yin et al., ICCV 2023), as a refinement method with an EMA teacher.

The network (docs/METHOD.md §13): the WSDDN (MIL) head, K = 3 OICR refinement students (classifiers
only), and an R-CNN head (``build_heads``: a (C+1)-way classifier and class-specific box regressor) on the
same ROI features. The EMA teacher (``solver.ema``, ``wsod.engine.ema.EMATeacher``) follows the backbone
and the neck, and its copy of student K's classifier follows the weighted mix ``teacher_sources`` names:
(1/2K) x each student's classifier + (1/2) x the R-CNN classifier. Its softmax on the same views and ROIs
(``teacher_scores``: ``RoiScores.students[-1]`` of the teacher) is what the method reads.

Losses, with progress t = iteration / max_iter and the ramp r(t) = min(t / ``ramp_length``, 1):

* ``loss_mil`` x w(t), w(t) = 1 - r(t) (``mil_loss_weight``);
* ``loss_ref_cls_k``: OICR's top-1 seeds (``top1_seeds``) from the predecessor's scores, foreground at
  IoU >= ``fg_iou`` weighted by the seed's score, weight 0 below ``bg_iou`` (``assign_seeds``);
* ``loss_distill`` x (1 - w(t)): ranking distillation of the teacher into the MIL head
  (``ranking_distillation``), with the foreground threshold rising from ``distill_iou_start`` to
  ``distill_iou_stop`` as r(t);
* ``loss_rcnn_cls``, ``loss_rcnn_box``: the R-CNN head's weighted classification and smooth-L1 regression
  against student K's top-1 seeds until t >= ``multi_seed_start``, then against multi-branch seeds
  (``multi_seeds``) over [(teacher + student K) / 2, student 1, ..., student K-1].

Every loss is a mean over each image's ROIs, then over the images (the reference sums its 4 images'
gradients). Inference: ``detection`` is the mean of the students' and the R-CNN head's probabilities with
the R-CNN head's boxes; with ``model.eval_weights=mix`` (the recipe's) it is averaged with the teacher's
probability (``mix_predictions``), as the reference's tester does.

Labelling runs on the scores' device: per image and positive class, torch ops over all ROIs (the
reference loops over them in numpy on the CPU). Ties: proposals of equal score rank by index (stable
sorts); NMS keeps boxes in decreasing score; an ROI takes the first seed of maximal IoU (classes in
ascending order, a class's seeds in NMS order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import box_iou

from wsod.modeling.box_coder import encode_boxes
from wsod.modeling.inclusive_boxes import inclusive_box_iou, inclusive_nms
from wsod.modeling.method import (
    MethodBatch,
    PseudoLabels,
    RefinementMethod,
    RoiScores,
    TrainingProgress,
    check_init_stds,
)
from wsod.modeling.refinement import (
    PseudoBoxes,
    RefinementStudent,
    oicr_pseudo_boxes,
    refinement_losses,
    roi_normalizer,
)

__all__ = [
    "CBLMethod",
    "top1_seeds",
    "assign_seeds",
    "multi_seeds",
    "ranking_distillation",
    "ramp",
]

RCNN = "rcnn"  # the R-CNN head's name (``method_heads.rcnn``)


def ramp(progress: TrainingProgress, length: float) -> float:
    """min(t / length, 1) for t = progress.fraction: the share of CBL's ramp window behind the step."""
    return min(progress.fraction / length, 1.0)


@torch.no_grad()
def top1_seeds(proposals: Tensor, scores: Tensor, image_labels: Tensor, *, score_clip: float) -> PseudoBoxes:
    """OICR's top-1 seeds on scores clipped to [score_clip, 1 - score_clip]: per positive class in
    ascending order, its highest-scoring proposal among those no earlier class took, carrying its
    clipped score (``oicr_pseudo_boxes``). scores (R, C) foreground columns."""
    return oicr_pseudo_boxes(proposals, scores.clamp(score_clip, 1 - score_clip), image_labels)


@torch.no_grad()
def assign_seeds(
    proposals: Tensor, seeds: PseudoBoxes, *, fg_iou: float, bg_iou: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each ROI against the seeds: the first seed of maximal IoU; foreground (its class + 1) at IoU >=
    ``fg_iou``, else background; weighted by the seed's score, 0 where the maximal IoU is < ``bg_iou``.

    Returns labels (R,) int64, weights (R,), targets (R, 4) (``BoxCoder`` (10, 10, 5, 5) encoding of the
    seed, zeros for background) and the maximal IoU (R,) (0 without seeds)."""
    boxes, classes, scores = seeds
    num_rois = proposals.shape[0]
    if boxes.shape[0] == 0:
        zeros = proposals.new_zeros(num_rois)
        labels = torch.zeros(num_rois, dtype=torch.int64, device=proposals.device)
        return labels, zeros, proposals.new_zeros(num_rois, 4), zeros
    overlaps = box_iou(proposals, boxes)
    assigned = overlaps.argmax(dim=1)  # the first maximal seed
    max_iou = overlaps.gather(1, assigned[:, None]).squeeze(1)
    labels = torch.where(max_iou >= fg_iou, classes[assigned] + 1, 0)
    weights = torch.where(max_iou >= bg_iou, scores[assigned].to(proposals.dtype), 0.0)
    targets = encode_boxes(boxes[assigned], proposals) * (labels > 0)[:, None]
    return labels, weights, targets, max_iou


@torch.no_grad()
def multi_seeds(
    proposals: Tensor,
    branches: Sequence[Tensor],
    image_labels: Tensor,
    *,
    top_fraction: float,
    score_ratio: float,
    nms_iou: float,
    vote_iou: float,
    vote_gamma: float,
    vote_offset: float,
) -> PseudoBoxes:
    """CBL's multi-seed boxes for the R-CNN head (reference ``_get_top_scoring_proposals_mtgt``).

    branches: N score tensors (R, C) (foreground columns, clipped), branch 0 the one whose boxes become
    seeds. Per positive class c, in ascending order, and per branch: the top k = min(max(1, int(R x
    top_fraction)), #ROIs scoring > score_ratio x the branch's max) proposals by score; branch 0's are
    suppressed by NMS at ``nms_iou`` (a box goes at IoU >= ``nms_iou`` with a kept one). Each kept branch-0
    box is a seed of class c with score s x (vote_offset + (n / N) ^ vote_gamma), where s is its branch-0
    score and n counts branch 0 and each other branch with a selected box at IoU > ``vote_iou`` with it.
    Both IoUs in inclusive pixels (``x2 - x1 + 1``), as the reference's. Seeds in increasing score order
    within a class, as the reference returns them. Returns (boxes (G, 4), classes (G,), scores (G,))."""
    num_rois = proposals.shape[0]
    cap = max(1, int(num_rois * top_fraction))
    boxes, classes, box_scores = [], [], []
    for c in (image_labels > 0).nonzero().flatten().tolist():
        selected = []
        for column in (branch[:, c] for branch in branches):
            count = min(cap, int((column > column.max() * score_ratio).sum()))
            selected.append(torch.sort(column, descending=True, stable=True).indices[:count])
        top = selected[0]
        # NMS in rank order: scores strictly decreasing by rank, so that equal scores keep index order.
        rank = torch.arange(len(top), 0, -1, dtype=proposals.dtype, device=proposals.device)
        # The reference's cython NMS: inclusive pixels, dropped at IoU >= nms_iou (inclusive_nms).
        kept = top[inclusive_nms(proposals[top], rank, nms_iou)]
        # The reference's seeds of a class come in increasing score order: its top k are np.argsort's last
        # k (ascending) and cython_nms returns the kept ones in input order (cython_nms.pyx:87), so an ROI
        # tied between two seeds of one class goes to the lower-scoring one (assign_seeds takes the first).
        kept = kept.flip(0)
        votes = torch.ones(len(kept), dtype=proposals.dtype, device=proposals.device)
        for other in selected[1:]:
            overlaps = inclusive_box_iou(proposals[kept], proposals[other])  # bbox_overlaps: + 1
            votes += (overlaps > vote_iou).any(dim=1).to(votes.dtype)
        factor = vote_offset + (votes / len(branches)) ** vote_gamma
        boxes.append(proposals[kept])
        classes.append(torch.full_like(kept, c))
        box_scores.append(branches[0][kept, c] * factor.to(branches[0].dtype))
    if not boxes:
        return (
            proposals.new_zeros(0, 4),
            torch.zeros(0, dtype=torch.int64, device=proposals.device),
            branches[0].new_zeros(0),
        )
    return torch.cat(boxes), torch.cat(classes), torch.cat(box_scores)


def ranking_distillation(
    mil_scores: Tensor,
    teacher_probs: Tensor,
    proposals: Tensor,
    image_labels: Tensor,
    *,
    fg_iou: float,
    score_clip: float,
) -> Tensor:
    """One image's ranking-distillation loss (reference ``KLDivergenceLoss_2`` over the pseudo-MIL labels).

    mil_scores (R, C+1): the MIL head's ROI scores (with their graph); teacher_probs (R, C+1): the EMA
    teacher's softmax. Seeds: the teacher's top-1 per positive class (``top1_seeds``, clipped). For each
    positive class c, the ROIs S_c whose first maximal-IoU seed is of class c at IoU >= ``fg_iou`` and
    whose teacher probability for c is > 0 (ROIs between the background bound and ``fg_iou`` are in no
    S_c: ignored); loss = sum_c s_c KL(softmax(T[S_c, c]) || softmax(M[S_c, c])) / |S_c|, with s_c the
    seed's clipped score, T the teacher's unclipped probabilities and M the MIL scores, each softmax over
    the ROIs of S_c (of probabilities, as the reference computes it). A class with empty S_c adds 0."""
    seeds = top1_seeds(proposals, teacher_probs[:, 1:].detach(), image_labels, score_clip=score_clip)
    total = mil_scores.new_zeros(())
    boxes, classes, scores = seeds
    if boxes.shape[0] == 0:
        return total
    overlaps = box_iou(proposals, boxes)
    max_iou = overlaps.amax(dim=1)
    assigned_class = classes[overlaps.argmax(dim=1)]
    for c, score in zip(classes.tolist(), scores, strict=True):  # top-1: one seed per positive class
        teacher = teacher_probs[:, c + 1].detach()
        members = (assigned_class == c) & (max_iou >= fg_iou) & (teacher > 0)
        count = int(members.sum())
        if count == 0:
            continue
        log_student = F.log_softmax(mil_scores[members, c + 1], dim=0)
        target = F.softmax(teacher[members], dim=0)
        kl = F.kl_div(log_student, target, reduction="sum") / count
        total = total + score.to(kl.dtype) * kl
    return total


class CBLMethod(RefinementMethod):
    """CBL (Yin et al., ICCV 2023) as a refinement method: every number of ``configs/method/cbl.yaml``
    (its sources there) is a keyword argument. Needs the EMA teacher (``solver.ema.enabled``) and the
    training's progress (``TrainingProgress``, which the loop passes).

    Args:
        fg_iou: the students' and the R-CNN head's foreground bound (IoU >= fg_iou).
        bg_iou: ROIs whose maximal IoU with a seed is below it weigh 0.
        score_clip: seed scores are clipped to [score_clip, 1 - score_clip].
        ramp_length: the ramp window as a fraction of the run (1.0: the whole run).
        distill_iou_start, distill_iou_stop: the distillation's foreground bound over the window.
        multi_seed_start: the progress from which the R-CNN head learns from multi-seeds.
        top_fraction, score_ratio, nms_iou, vote_iou, vote_gamma, vote_offset: ``multi_seeds``.
        rcnn_cls_std, rcnn_box_std: the R-CNN head's initial weights N(0, std).
        mil_std, student_cls_std: the MIL head's and the students' classifiers' initial weights N(0, std)
            (the reference's 0.01; ``RefinementMethod``).
    """

    box_regression: ClassVar[bool] = False  # the students classify; the R-CNN head regresses
    head_names: ClassVar[tuple[str, ...]] = (RCNN,)
    needs_teacher: ClassVar[bool] = True

    def __init__(
        self,
        *,
        fg_iou: float = 0.5,
        bg_iou: float = 0.1,
        score_clip: float = 1e-9,
        ramp_length: float = 8 / 7,
        distill_iou_start: float = 0.5,
        distill_iou_stop: float = 1.0,
        multi_seed_start: float = 0.4,
        top_fraction: float = 0.05,
        score_ratio: float = 0.7,
        nms_iou: float = 0.4,
        vote_iou: float = 0.5,
        vote_gamma: float = 0.4,
        vote_offset: float = 1.0,
        rcnn_cls_std: float = 0.01,
        rcnn_box_std: float = 0.001,
        mil_std: float = 0.01,
        student_cls_std: float = 0.01,
    ) -> None:
        for name, value in (
            ("fg_iou", fg_iou), ("bg_iou", bg_iou), ("distill_iou_start", distill_iou_start),
            ("distill_iou_stop", distill_iou_stop), ("top_fraction", top_fraction),
            ("score_ratio", score_ratio), ("nms_iou", nms_iou), ("vote_iou", vote_iou),
        ):  # fmt: skip
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"CBL's {name} must be in [0, 1], got {value}")
        if not (ramp_length > 0 and multi_seed_start >= 0 and 0 <= score_clip < 0.5):
            raise ValueError(
                f"CBL needs ramp_length > 0, multi_seed_start >= 0 and score_clip in [0, 0.5), got"
                f" {ramp_length}, {multi_seed_start}, {score_clip}"
            )
        check_init_stds(
            rcnn_cls_std=rcnn_cls_std,
            rcnn_box_std=rcnn_box_std,
            mil_std=mil_std,
            student_cls_std=student_cls_std,
        )
        self.fg_iou, self.bg_iou, self.score_clip = fg_iou, bg_iou, score_clip
        self.ramp_length = ramp_length
        self.distill_iou_start, self.distill_iou_stop = distill_iou_start, distill_iou_stop
        self.multi_seed_start = multi_seed_start
        self.top_fraction, self.score_ratio, self.nms_iou = top_fraction, score_ratio, nms_iou
        self.vote_iou, self.vote_gamma, self.vote_offset = vote_iou, vote_gamma, vote_offset
        self.rcnn_cls_std, self.rcnn_box_std = rcnn_cls_std, rcnn_box_std
        self.mil_std, self.student_cls_std = mil_std, student_cls_std

    # -- the network ------------------------------------------------------------------------------------

    def build_heads(self, in_features: int, num_classes: int) -> dict[str, nn.Module]:
        stds = {"cls_std": self.rcnn_cls_std, "box_std": self.rcnn_box_std}
        return {RCNN: RefinementStudent(in_features, num_classes, box_regression=True, **stds)}

    def teacher_sources(self, num_students: int) -> dict[str, dict[str, float]]:
        """The teacher's copy of student K's classifier follows (1/2K) x each student's + (1/2) x the
        R-CNN head's (reference ``update_ema_variables``, ``refine_avg_cls``)."""
        last = f"students.{num_students - 1}.cls_score"
        return {
            f"{last}.{p}": {
                **{f"students.{k}.cls_score.{p}": 1 / (2 * num_students) for k in range(num_students)},
                f"method_heads.{RCNN}.cls_score.{p}": 0.5,
            }
            for p in ("weight", "bias")
        }

    @staticmethod
    def teacher_scores(scores: RoiScores) -> Tensor:
        """The teacher's per-ROI probabilities (R, C+1): the softmax of its copy of student K."""
        return scores.students[-1]

    def teacher_pseudo_boxes(
        self, teacher: RoiScores, proposals: Sequence[Tensor], targets: Sequence[Mapping[str, Tensor]]
    ) -> list[PseudoBoxes]:
        """Per image-view, the teacher's top-1 seeds (``top1_seeds`` of its probabilities, clipped): the
        seeds the ranking distillation teaches the MIL head with, recomputed here for the training log
        (``pseudo/precision_teacher``). One set, from the teacher's one classifier (its copy of student
        K), not one per student."""
        scores = self.teacher_scores(teacher).detach().split([len(p) for p in proposals])
        return [
            top1_seeds(boxes, probs[:, 1:], target["labels"], score_clip=self.score_clip)
            for boxes, probs, target in zip(proposals, scores, targets, strict=True)
        ]

    # -- the schedule -----------------------------------------------------------------------------------

    def mil_loss_weight(self, progress: TrainingProgress | None) -> float:
        """w(t) = 1 - r(t)."""
        return 1.0 - ramp(self._progress(progress), self.ramp_length)

    def distill_iou(self, progress: TrainingProgress) -> float:
        """The distillation's foreground bound: from ``distill_iou_start`` to ``distill_iou_stop`` as r(t)."""
        share = ramp(progress, self.ramp_length)
        return self.distill_iou_start + (self.distill_iou_stop - self.distill_iou_start) * share

    def multi_seed(self, progress: TrainingProgress) -> bool:
        """Whether the R-CNN head learns from multi-seeds at this step."""
        return progress.fraction >= self.multi_seed_start

    @staticmethod
    def _progress(progress: TrainingProgress | None) -> TrainingProgress:
        if progress is None:
            raise ValueError(
                "CBL's losses follow the training's progress: pass progress=TrainingProgress(iteration,"
                " max_iter) to the training forward (the training loop does)"
            )
        return progress

    # -- the students -----------------------------------------------------------------------------------

    def loss_names(self, num_students: int) -> tuple[str, ...]:
        students = tuple(f"loss_ref_cls_{k}" for k in range(1, num_students + 1))
        return (*students, "loss_distill", "loss_rcnn_cls", "loss_rcnn_box")

    def _seed_record(self, proposals: Tensor, seeds: PseudoBoxes) -> PseudoLabels:
        labels, weights, targets, _ = assign_seeds(proposals, seeds, fg_iou=self.fg_iou, bg_iou=self.bg_iou)
        return PseudoLabels(
            labels, weights, targets, pseudo_boxes=seeds[0], pseudo_classes=seeds[1], pseudo_scores=seeds[2]
        )

    def pseudo_labels(
        self, student: int, proposals: Tensor, scores: Tensor, targets: Mapping[str, Tensor]
    ) -> PseudoLabels:
        seeds = top1_seeds(proposals, scores, targets["labels"], score_clip=self.score_clip)
        return self._seed_record(proposals, seeds)

    def losses(
        self,
        student: int,
        logits: Tensor,
        deltas: Tensor | None,
        records: Sequence[PseudoLabels],
        proposals: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        ce = F.cross_entropy(logits, torch.cat([r.labels for r in records]), reduction="none")
        weights = torch.cat([r.weights for r in records])
        return {f"loss_ref_cls_{student}": (weights * ce * roi_normalizer(logits, records)).sum()}

    # -- the teacher's losses and the R-CNN head --------------------------------------------------------

    def batch_losses(self, batch: MethodBatch) -> dict[str, Tensor]:
        progress = self._progress(batch.progress)
        if batch.teacher is None:
            raise ValueError(
                "CBL learns from an EMA teacher: set solver.ema.enabled=true (configs/method/cbl.yaml does,"
                " with the reference's momentum, ramp schedule and followed groups)"
            )
        counts = batch.counts
        teacher = self.teacher_scores(batch.teacher).detach()
        mil = batch.mil_scores.split(counts)
        per_image_teacher = teacher.split(counts)
        labels = [t["labels"] for t in batch.targets]
        threshold = self.distill_iou(progress)
        distill = sum(
            ranking_distillation(m, t, p, y, fg_iou=threshold, score_clip=self.score_clip)
            for m, t, p, y in zip(mil, per_image_teacher, batch.proposals, labels, strict=True)
        ) / len(counts)

        logits, deltas = batch.heads[RCNN]
        sources = [F.softmax(s.detach(), dim=1)[:, 1:] for s in batch.student_logits]
        records = self._rcnn_records(batch.proposals, sources, per_image_teacher, labels, counts, progress)
        cls_loss, box_loss = refinement_losses(
            logits,
            deltas,
            torch.cat([r.labels for r in records]),
            torch.cat([r.weights for r in records]),
            torch.cat([r.targets for r in records]),
            roi_normalizer(logits, records),
        )
        weight = 1.0 - self.mil_loss_weight(progress)
        return {"loss_distill": weight * distill, "loss_rcnn_cls": cls_loss, "loss_rcnn_box": box_loss}

    @torch.no_grad()
    def _rcnn_records(
        self,
        proposals: Sequence[Tensor],
        student_probs: Sequence[Tensor],
        teacher: Sequence[Tensor],
        labels: Sequence[Tensor],
        counts: list[int],
        progress: TrainingProgress,
    ) -> list[PseudoLabels]:
        """``rcnn_pseudo_labels`` of each image; student_probs: K x (R, C) softmax foreground columns of
        the batch, teacher: per image (R_i, C+1)."""
        per_image = zip(*[s.split(counts) for s in student_probs], strict=True)
        return [
            self.rcnn_pseudo_labels(boxes, students, teacher_probs, image_labels, progress)
            for boxes, students, teacher_probs, image_labels in zip(
                proposals, per_image, teacher, labels, strict=True
            )
        ]

    @torch.no_grad()
    def rcnn_pseudo_labels(
        self,
        proposals: Tensor,
        student_probs: Sequence[Tensor],
        teacher_probs: Tensor,
        image_labels: Tensor,
        progress: TrainingProgress,
    ) -> PseudoLabels:
        """One image's R-CNN record: student K's top-1 seeds, or multi-seeds once ``multi_seed``
        (branches [(teacher + student K) / 2, student 1, ..., student K-1], each clipped). student_probs:
        K x (R, C) softmax foreground columns; teacher_probs: (R, C+1)."""
        if not self.multi_seed(progress):
            seeds = top1_seeds(proposals, student_probs[-1], image_labels, score_clip=self.score_clip)
            return self._seed_record(proposals, seeds)
        clip = (self.score_clip, 1 - self.score_clip)
        clipped = [s.clamp(*clip) for s in student_probs]
        ensemble = (teacher_probs[:, 1:].clamp(*clip) + clipped[-1]) / 2
        seeds = multi_seeds(
            proposals, [ensemble, *clipped[:-1]], image_labels, top_fraction=self.top_fraction,
            score_ratio=self.score_ratio, nms_iou=self.nms_iou, vote_iou=self.vote_iou,
            vote_gamma=self.vote_gamma, vote_offset=self.vote_offset,
        )  # fmt: skip
        return self._seed_record(proposals, seeds)

    # -- inference --------------------------------------------------------------------------------------

    def detection(
        self,
        student_probs: Sequence[Tensor],
        student_deltas: Sequence[Tensor | None],
        heads: Mapping[str, Any],
    ) -> tuple[Tensor, Tensor | None]:
        """The mean of the students' and the R-CNN head's probabilities; the R-CNN head's boxes."""
        logits, deltas = heads[RCNN]
        probs = torch.stack([*student_probs, F.softmax(logits, dim=1)]).mean(dim=0)
        return probs, deltas

    def mix_predictions(self, own: Mapping[str, Tensor], teacher: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The reference's test score: the mean of the student's detection probabilities and the teacher
        classifier's (its copy of student K); the student's boxes and image scores."""
        return {
            "scores": (own["scores"] + teacher["student_scores"][-1]) / 2,
            "boxes": own["boxes"],
            "image_scores": own["image_scores"],
        }
