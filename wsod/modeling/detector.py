"""The weakly-supervised detector: a backbone's base -> ROI features -> MIL teacher + refinement students.

Batch contract (``forward``):
    images (B, 3, H, W), padded; proposals: list of B tensors (R_i, 4) xyxy in the pixels of the
    resized image; targets (training): list of B dicts, one per image, each with "labels" (C,) multi-hot
    over the foreground classes plus any supervision fields the data carries (in the resized image's
    pixels, see ``wsod.modeling.method``); image_labels (B, C): the same labels as one tensor, enough
    alone (targets are then ``{"labels": row}``); image_sizes: list of (h, w) of each resized image
    before padding; original_sizes: list of (h, w) of each image on disk. Both default to the padded
    size (no rescaling). views: V when the batch holds B images x V views, image-major.

It implements the detector contract (``wsod.modeling.protocol.Detector``). Training returns one
``TrainingOutput`` whose losses are named by ``loss_names``: ``"loss_mil"``, then the refinement
method's (``"loss_ref_cls_k"``, ``"loss_ref_box_k"`` for k = 1..K with MIST and OICR, then any of its
``batch_losses``), scalars whose sum is the training loss. The method
(``wsod.modeling.method.RefinementMethod``) makes each student's pseudo-labels and computes its losses;
the detector only runs the chain of source scores. Evaluation returns per image ``{"boxes" (D, 4) in
original pixels, "scores" (D,), "labels" (D,) foreground class 0..C-1}``.

Precision (docs/METHOD.md §2): under autocast only the base and the per-ROI neck run in reduced
precision. ``losses``, ``predict_rois`` and ``postprocess`` cast reduced-precision ROI features to
float32 and run with autocast off, so the MIL head, the students, the pseudo-labels that rank their
scores, the losses and inference all compute in full precision whatever context the caller is in.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import batched_nms, clip_boxes_to_image, remove_small_boxes

from wsod.modeling.backbone import Backbone
from wsod.modeling.box_coder import decode_boxes
from wsod.modeling.cbl import CBLMethod
from wsod.modeling.dropblock import ConcreteDropBlock
from wsod.modeling.method import MethodBatch, PseudoLabels, RefinementMethod, RoiScores, TrainingProgress
from wsod.modeling.mil import MILHead, mil_loss
from wsod.modeling.partial_labels import PARTIAL_LABEL_FIELDS
from wsod.modeling.pcl import PCLMethod, WSDDNMethod
from wsod.modeling.protocol import DetectionSettings, TrainingOutput, check_keep, unflip_boxes
from wsod.modeling.refinement import (
    LabelerMethod,
    MISTMethod,
    OICRMethod,
    PseudoLabeler,
    RefinementStudent,
)
from wsod.modeling.resnet import resnet_c4_backbone
from wsod.modeling.roi_head import RoIFeatureHead, build_roi_pooler
from wsod.modeling.vgg import vgg16_backbone

__all__ = [
    "WeaklySupervisedDetector",
    "BACKBONES",
    "METHODS",
    "build_backbone",
    "build_detector",
    "detector_from_backbone",
    "proposals_to_rois",
    "postprocess_rois",
    "per_class_nms",
]

# Backbone name -> builder(**options) -> Backbone. A new backbone is one module and one line here.
BACKBONES: dict[str, Callable[..., Backbone]] = {
    **{f"resnet{depth}": partial(resnet_c4_backbone, depth) for depth in (18, 34, 50, 101)},
    "vgg16": vgg16_backbone,
}
# Refinement method name (``configs/method/*.yaml``'s ``name``) -> its class, built with the node's other
# keys (``wsod.build.build_method``). A new method is one module and one line here.
METHODS: dict[str, type[RefinementMethod]] = {
    "mist": MISTMethod,
    "oicr": OICRMethod,
    "pcl": PCLMethod,
    "wsddn": WSDDNMethod,
    "cbl": CBLMethod,
}


def resolve_method_class(name: str) -> type[RefinementMethod]:
    """A built-in method's class (``METHODS``) or a class named by import path, ``module:Class`` or
    ``module.Class`` (a method defined outside wsod, e.g. ``my_methods:PCL``)."""
    if name in METHODS:
        return METHODS[name]
    expected = (
        f"expected one of {sorted(METHODS)} or an import path module:ClassName of a RefinementMethod"
        " subclass (its module on sys.path)"
    )
    module_name, _, class_name = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not module_name:
        raise ValueError(f"unknown method.name='{name}': {expected}")
    try:
        method_class = pkgutil.resolve_name(name)  # module:Class and module.Class alike
    except (ImportError, AttributeError, ValueError) as error:
        problem = f"method.name='{name}': cannot import {module_name}, or it has no {class_name} ({error})"
        raise ValueError(f"{problem}; {expected}") from error
    if not (isinstance(method_class, type) and issubclass(method_class, RefinementMethod)):
        problem = f"method.name='{name}': {module_name} has no RefinementMethod subclass {class_name}"
        raise ValueError(f"{problem}; {expected}")
    return method_class


def partial_label_readers() -> str:
    """The methods whose class reads partial labels, as the fix an error offers ("method=mist or
    method=oicr"): read from ``METHODS`` at each call, so that a method added there is named too."""
    return " or ".join(f"method={name}" for name, cls in METHODS.items() if cls.reads_partial_labels)


ImageSize = tuple[int, int]
Targets = Mapping[str, Tensor]
_REDUCED_PRECISION = (torch.float16, torch.bfloat16)
# Detections narrower or shorter than this (original pixels) are dropped, as torchvision's heads do.
MIN_BOX_SIZE = 1e-2


def _full_precision(features: Tensor) -> Tensor:
    """Reduced-precision (bf16 / fp16) features as float32; float32 and float64 ones unchanged."""
    return features.float() if features.dtype in _REDUCED_PRECISION else features


def _autocast_off(tensor: Tensor) -> torch.autocast:
    """Autocast disabled on ``tensor``'s device type, whatever the caller enabled."""
    return torch.autocast(tensor.device.type, enabled=False)


def proposals_to_rois(proposals: Sequence[Tensor]) -> Tensor:
    """List of B (R_i, 4) boxes -> (sum R_i, 5) rows (batch index, x1, y1, x2, y2), as RoIAlign takes."""
    indices = [torch.full_like(p[:, :1], i) for i, p in enumerate(proposals)]
    return torch.cat([torch.cat(indices), torch.cat(list(proposals))], dim=1)


class WeaklySupervisedDetector(nn.Module):
    """The MIST detector (Ren et al., CVPR 2020) on a base network and a per-ROI feature head: a MIL
    teacher and K students, taught by a refinement method (MIST, OICR, or any ``RefinementMethod``).

    Args:
        base: images (B, 3, H, W) -> feature map (B, C, H/stride, W/stride).
        roi_head: (feature map, rois (R, 5)) -> ROI features (R, D), e.g. ``RoIFeatureHead``.
        mil_head: the WSDDN teacher, ``MILHead(D, C, std=method.mil_std)``.
        students: K ``RefinementStudent(D, C)``: at least one (inference averages them), with a box
            regressor iff the method's ``box_regression``; none when the method trains no students
            (``trains_students`` False, WSDDN: the teacher's ROI scores are the detections).
            ``detector_from_backbone`` initialises them with the method's ``student_cls_std`` and
            ``student_box_std``.
        method: the refinement method (``MISTMethod()`` when neither it nor ``labeler`` is given): each
            student's pseudo-labels from its predecessor's scores, and that student's losses.
        method_heads: the method's own heads (``method.build_heads``, e.g. CBL's R-CNN head), by name;
            exactly the names the method builds (none for MIST, OICR, PCL, WSDDN).
        labeler: instead of ``method``, a plain ``PseudoLabeler`` (``MISTLabeler()``, ``OICRLabeler()``
            or any callable of that signature), trained with the students' weighted losses
            (``LabelerMethod``).
        first_student_loss_weight: with ``labeler`` (or neither): student 1's loss factor (3, the
            reference code's; default); a ``method`` carries its own.
        nms_iou, score_threshold, detections_per_image: inference post-processing.
    """

    def __init__(
        self,
        *,
        base: nn.Module,
        roi_head: nn.Module,
        mil_head: MILHead,
        students: Sequence[RefinementStudent],
        method: RefinementMethod | None = None,
        method_heads: Mapping[str, nn.Module] | None = None,
        labeler: PseudoLabeler | None = None,
        first_student_loss_weight: float | None = None,
        nms_iou: float = 0.3,
        score_threshold: float = 0.0,
        detections_per_image: int = 100,
    ) -> None:
        super().__init__()
        self.method = _as_method(method, labeler, first_student_loss_weight)
        _check_students(self.method, students)
        self.base = base
        self.roi_head = roi_head
        self.mil_head = mil_head
        self.students = nn.ModuleList(students)
        self.method_heads = nn.ModuleDict(dict(method_heads or {}))
        _check_method_heads(self.method, self.method_heads)
        self.nms_iou = nms_iou
        self.score_threshold = score_threshold
        self.detections_per_image = detections_per_image

    @property
    def labeler(self) -> PseudoLabeler | None:
        """The method's per-image labeller when it has one (MIST, OICR, a ``LabelerMethod``), else None."""
        return getattr(self.method, "labeler", None)

    @property
    def loss_names(self) -> tuple[str, ...]:
        """The names of the training losses, in the order ``forward`` returns them: the MIL loss, then
        the method's for the K students. What GradNorm and the logs count."""
        return ("loss_mil", *self.method.loss_names(len(self.students)))

    @property
    def dropblock(self) -> nn.Module | None:
        """The Concrete DropBlock on the pooled ROI features, or None (``roi_head.dropblock``)."""
        return getattr(self.roi_head, "dropblock", None)

    @property
    def num_classes(self) -> int:
        return self.mil_head.cls_score.out_features - 1

    @property
    def detection_settings(self) -> DetectionSettings:
        """Its own post-processing settings (``nms_iou``, ``score_threshold``, ``detections_per_image``)."""
        return DetectionSettings(self.score_threshold, self.nms_iou, self.detections_per_image)

    # Prediction needs the data's proposals: the detector scores them, it proposes none.
    makes_proposals = False

    def module_groups(self) -> dict[str, list[nn.Module]]:
        """The EMA teacher's groups (``wsod.modeling.protocol.MODULE_GROUPS``): the base network, the
        per-ROI neck (with its DropBlock), the MIL head, the students and the method's heads."""
        heads = [self.mil_head, self.students, self.method_heads]
        return {"backbone": [self.base], "neck": [self.roi_head], "heads": heads}

    def teacher_sources(self) -> dict[str, dict[str, float]]:
        """The weighted sources of an EMA teacher's tensors (``RefinementMethod.teacher_sources``)."""
        return self.method.teacher_sources(len(self.students))

    def forward(
        self,
        images: Tensor,
        proposals: Sequence[Tensor],
        image_labels: Tensor | None = None,
        image_sizes: Sequence[ImageSize] | None = None,
        original_sizes: Sequence[ImageSize] | None = None,
        targets: Sequence[Targets] | None = None,
        views: int = 1,
        *,
        teacher_scores: RoiScores | None = None,
        progress: TrainingProgress | None = None,
        keep: Collection[str] = (),
    ) -> TrainingOutput | list[dict[str, Tensor]]:
        """A ``TrainingOutput`` in training mode, detections in eval mode (see the module docstring).

        Training needs ``targets`` or ``image_labels`` (both: they must agree). ``views``: the batch
        holds B images x V views, image-major (each view an image of its own for the MIL loss and the
        students; the method's ``batch_losses`` sees them together). ``teacher_scores``: an EMA
        teacher's per-ROI scores on the same images and ROIs (``teacher_inputs``), for the method.
        ``progress``: where the training stands (the loop's step), for a method whose losses follow a
        schedule. ``keep`` (``TRAINING_EXTRAS``): also return the (R, D) ROI features the losses were computed
        from, the boundary between the neck and the heads where GradNorm measures gradient norms
        (``wsod.engine.gradnorm``), and each loss's detached pseudo-label weight scale
        (``RefinementMethod.loss_scales``; 1 for ``loss_mil`` and for losses the method gives none),
        and the students' ``PseudoLabels`` records the losses were computed from, with the EMA teacher's
        pseudo boxes when ``teacher_scores`` are given (``TrainingOutput.pseudo_labels``,
        ``teacher_pseudo_boxes``: the same records, kept rather than recomputed, so asking for them
        changes no loss); through DistributedDataParallel too, which only sees ``forward``.
        """
        keep = check_keep(keep)
        self._check_inputs(images, proposals, views)
        if self.training:  # checked before the base network runs
            image_labels, targets = self._training_targets(len(proposals), image_labels, targets)
            self._check_teacher_scores(teacher_scores, proposals)
        roi_features = self.roi_features(images, proposals)
        if self.training:
            scales: dict[str, Tensor] | None = {} if "loss_scales" in keep else None
            records: list[list[PseudoLabels]] | None = [] if "pseudo_labels" in keep else None
            losses = self._full_precision_losses(
                roi_features, proposals, image_labels, targets, scales, views, teacher_scores, progress,
                records,
            )  # fmt: skip
            output = TrainingOutput(losses)
            if "roi_features" in keep:
                output.roi_features = roi_features
            if scales is not None:
                one = losses["loss_mil"].new_ones(())
                output.loss_scales = {name: scales.get(name, one) for name in losses}
            if records is not None:
                output.pseudo_labels = records
                if teacher_scores is not None:
                    with torch.no_grad(), _autocast_off(roi_features):  # as the losses' own
                        output.teacher_pseudo_boxes = self.method.teacher_pseudo_boxes(
                            teacher_scores, proposals, targets
                        )
            return output
        padded = (images.shape[-2], images.shape[-1])
        image_sizes = image_sizes or [padded] * len(proposals)
        original_sizes = original_sizes or image_sizes
        per_roi = self.predict_rois(roi_features, proposals, image_sizes, original_sizes)
        return [self.postprocess(scores, boxes) for scores, boxes in per_roi]

    def _check_teacher_scores(self, teacher_scores: RoiScores | None, proposals: Sequence[Tensor]) -> None:
        if teacher_scores is None:
            return
        expected = (sum(len(p) for p in proposals), self.num_classes + 1)
        if teacher_scores.mil.shape != expected:
            raise ValueError(
                f"teacher_scores.mil must be (R, C+1) = {expected} for this batch's ROIs, got"
                f" {tuple(teacher_scores.mil.shape)}: the teacher must score the student's images and ROIs"
            )

    def _check_inputs(self, images: Tensor, proposals: Sequence[Tensor], views: int = 1) -> None:
        if images.dim() != 4 or len(proposals) != images.shape[0]:
            raise ValueError(
                f"expected images (B, 3, H, W) and B proposal tensors; got images"
                f" {tuple(images.shape)} and {len(proposals)} proposal tensors"
            )
        if views < 1 or len(proposals) % views:
            raise ValueError(
                f"views={views}: the batch must hold B images x V views, got {len(proposals)} images"
            )
        for i, boxes in enumerate(proposals):
            if boxes.dim() != 2 or boxes.shape[1] != 4 or boxes.shape[0] == 0:
                raise ValueError(
                    f"image {i} of the batch: proposals must be a non-empty (R, 4) tensor, got"
                    f" {tuple(boxes.shape)}"
                )

    def _training_targets(
        self, batch_size: int, image_labels: Tensor | None, targets: Sequence[Targets] | None
    ) -> tuple[Tensor, Sequence[Targets]]:
        """(image_labels (B, C), one targets dict per image) from whichever the caller gave, checked."""
        expected = (batch_size, self.num_classes)
        if targets is None:
            if image_labels is None or image_labels.shape != expected:
                got = None if image_labels is None else tuple(image_labels.shape)
                raise ValueError(
                    f"training needs targets (B dicts with 'labels' (C,)) or image_labels of shape (B, C) ="
                    f" {expected}, got image_labels {got}"
                )
            return image_labels, [{"labels": row} for row in image_labels]
        if len(targets) != batch_size:
            raise ValueError(f"targets must hold one dict per image ({batch_size}), got {len(targets)}")
        for i, target in enumerate(targets):
            labels = target.get("labels")
            if labels is None or labels.shape != expected[1:]:
                got = None if labels is None else tuple(labels.shape)
                raise ValueError(
                    f"targets[{i}]['labels'] must be the image's (C,) = ({self.num_classes},) multi-hot"
                    f" labels, got {got}"
                )
            if not self.method.reads_partial_labels and any(
                target.get(name) is not None and target[name].numel() for name in PARTIAL_LABEL_FIELDS
            ):
                raise ValueError(
                    f"targets[{i}] holds partial labels (points, scribbles or boxes), which"
                    f" {type(self.method).__name__} does not read: train them with"
                    f" {partial_label_readers()}, or drop the data's partial_labels"
                )
        stacked = torch.stack([target["labels"] for target in targets])
        if image_labels is None:
            return stacked, targets
        if image_labels.shape != expected or not torch.equal(image_labels, stacked.to(image_labels)):
            raise ValueError(
                "image_labels and the targets' 'labels' disagree: pass one of them, or the same labels"
            )
        return image_labels, targets

    def roi_features(self, images: Tensor, proposals: Sequence[Tensor]) -> Tensor:
        """images (B, 3, H, W), proposals B x (R_i, 4) -> ROI features (sum R_i, D)."""
        return self.roi_head(self.base(images), proposals_to_rois(proposals))

    def losses(
        self,
        roi_features: Tensor,
        proposals: Sequence[Tensor],
        image_labels: Tensor | None = None,
        targets: Sequence[Targets] | None = None,
    ) -> dict[str, Tensor]:
        """MIL loss of the teacher, then each student trained on pseudo-labels from its predecessor, as
        the method says. ``image_labels`` (B, C) or ``targets`` (one dict per image), as ``forward``.

        Runs in full precision: ROI features in bf16 / fp16 are cast to float32 and autocast is off, so
        that MIST ranks float32 scores (bf16 keeps 8 significant bits: near-duplicate proposals would
        tie and the top-ranked box would change).
        """
        image_labels, targets = self._training_targets(len(proposals), image_labels, targets)
        return self._full_precision_losses(roi_features, proposals, image_labels, targets)

    def _full_precision_losses(
        self,
        roi_features: Tensor,
        proposals: Sequence[Tensor],
        image_labels: Tensor,
        targets: Sequence[Targets],
        scales: dict[str, Tensor] | None = None,
        views: int = 1,
        teacher_scores: RoiScores | None = None,
        progress: TrainingProgress | None = None,
        records: list[list[PseudoLabels]] | None = None,
    ) -> dict[str, Tensor]:
        with _autocast_off(roi_features):
            features = _full_precision(roi_features)
            return self._losses(
                features, proposals, image_labels, targets, scales, views, teacher_scores, progress, records
            )

    def _losses(
        self,
        roi_features: Tensor,
        proposals: Sequence[Tensor],
        image_labels: Tensor,
        targets: Sequence[Targets],
        scales: dict[str, Tensor] | None = None,
        views: int = 1,
        teacher_scores: RoiScores | None = None,
        progress: TrainingProgress | None = None,
        records: list[list[PseudoLabels]] | None = None,
    ) -> dict[str, Tensor]:
        """The losses; ``scales``, when given, is filled with the method's ``loss_scales``, and
        ``records``, when given, with each student's per-image ``PseudoLabels`` (student 1's first)."""
        counts = [len(p) for p in proposals]
        mil_scores = self.mil_head(roi_features, counts)  # (R, C+1)
        losses = {"loss_mil": mil_loss(mil_scores, counts, image_labels)}
        mil_weight = self.method.mil_loss_weight(progress)
        if mil_weight != 1.0:
            losses["loss_mil"] = losses["loss_mil"] * mil_weight
        student_logits = []
        for k, logits, deltas, student_records in self._students_and_records(
            roi_features, proposals, mil_scores, targets
        ):
            student_logits.append(logits)
            losses.update(self.method.losses(k, logits, deltas, student_records, proposals))
            if scales is not None:
                scales.update(self.method.loss_scales(k, student_records))
            if records is not None:
                records.append(student_records)
        batch = MethodBatch(
            proposals=proposals, targets=targets, views=views, mil_scores=mil_scores,
            student_logits=tuple(student_logits), teacher=teacher_scores,
            heads={name: head(roi_features) for name, head in self.method_heads.items()},
            progress=progress,
        )  # fmt: skip
        losses.update(self.method.batch_losses(batch))
        if tuple(losses) != self.loss_names:  # what GradNorm and the logs count must be what is returned
            raise RuntimeError(
                f"{type(self.method).__name__}.losses returned {list(losses)[1:]} but its loss_names"
                f"({len(self.students)}) are {list(self.loss_names)[1:]}: make the two agree, names and order"
            )
        return losses

    def _students_and_records(
        self,
        roi_features: Tensor,
        proposals: Sequence[Tensor],
        teacher_scores: Tensor,
        targets: Sequence[Targets],
    ) -> Iterator[tuple[int, Tensor, Tensor | None, list[PseudoLabels]]]:
        """The chain of students: per student k = 1..K, (k, its logits (R, C+1), its deltas, one
        ``PseudoLabels`` per image from its predecessor's scores: the teacher's for k = 1, the softmax
        of student k-1 after)."""
        counts = [len(p) for p in proposals]
        source_scores = teacher_scores.detach()
        for k, student in enumerate(self.students, start=1):
            logits, deltas = student(roi_features)
            per_image = zip(proposals, source_scores.split(counts), targets, strict=True)
            with torch.no_grad():
                records = [
                    self.method.pseudo_labels(k, boxes, scores[:, 1:], target)  # column 0: background
                    for boxes, scores, target in per_image
                ]
            yield k, logits, deltas, records
            source_scores = F.softmax(logits.detach(), dim=1)

    @torch.no_grad()
    def pseudo_labels(
        self, images: Tensor, proposals: Sequence[Tensor], targets: Sequence[Targets]
    ) -> list[list[PseudoLabels]]:
        """What each student would learn from on these images now: ``[student k - 1][image i]`` the
        ``PseudoLabels`` the method makes (in the resized image's pixels), the chain of source scores
        as in training. For looking at (the training previews); runs in the module's current mode
        (call ``eval()`` first for previews: no dropout, no DropBlock, no statistics updated) and
        without gradients. ``[]`` for a method without students."""
        self._check_inputs(images, proposals)
        _, targets = self._training_targets(len(proposals), None, targets)
        roi_features = self.roi_features(images, proposals)
        with _autocast_off(roi_features):
            roi_features = _full_precision(roi_features)
            teacher_scores = self.mil_head(roi_features, [len(p) for p in proposals])
            chain = self._students_and_records(roi_features, proposals, teacher_scores, targets)
            return [records for _, _, _, records in chain]

    def predict_rois(
        self,
        roi_features: Tensor,
        proposals: Sequence[Tensor],
        image_sizes: Sequence[ImageSize],
        original_sizes: Sequence[ImageSize],
    ) -> list[tuple[Tensor, Tensor]]:
        """Per-ROI predictions before NMS, for post-processing and test-time augmentation.

        The method's ``detection`` (by default the students' mean class probabilities and box deltas),
        each class's box decoded, clipped to the resized image and mapped to original pixels. Without
        box deltas (PCL) each class's box is the proposal's; without students (WSDDN) the scores are the
        MIL teacher's ROI scores. Returns per image (scores (R_i, C+1), boxes (R_i, C+1, 4)), column 0
        being background. Full precision, like ``losses``.
        """
        per_roi = self._per_roi(roi_features, proposals, image_sizes, original_sizes)
        return [(scores, boxes) for scores, boxes, _ in per_roi]

    def _per_roi(
        self,
        roi_features: Tensor,
        proposals: Sequence[Tensor],
        image_sizes: Sequence[ImageSize],
        original_sizes: Sequence[ImageSize],
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``predict_rois``' (scores, boxes) per image, with each student's softmax (K, R_i, C+1)."""
        with _autocast_off(roi_features):
            return self._predict_rois(_full_precision(roi_features), proposals, image_sizes, original_sizes)

    def _predict_rois(
        self,
        roi_features: Tensor,
        proposals: Sequence[Tensor],
        image_sizes: Sequence[ImageSize],
        original_sizes: Sequence[ImageSize],
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        rois = torch.cat(list(proposals))
        counts = [len(p) for p in proposals]
        num_columns = self.num_classes + 1
        outputs = [student(roi_features) for student in self.students]
        student_probs = [F.softmax(logits, dim=1) for logits, _ in outputs]
        heads = {name: head(roi_features) for name, head in self.method_heads.items()}
        deltas = None
        if outputs:
            probs, deltas = self.method.detection(student_probs, [d for _, d in outputs], heads)
        else:  # WSDDN: softmax over classes x softmax over each image's ROIs, as the MIL loss sees them
            probs = self.mil_head(roi_features, counts)
        if deltas is not None:
            boxes = decode_boxes(deltas, rois)
        else:  # every class keeps the proposal's box
            boxes = rois[:, None, :].expand(-1, num_columns, 4)
        per_student = torch.stack(student_probs) if student_probs else probs.new_zeros(0, *probs.shape)
        results = []
        for image_probs, image_boxes, image_students, size, original in zip(
            probs.split(counts), boxes.split(counts), per_student.split(counts, dim=1), image_sizes,
            original_sizes, strict=True,
        ):  # fmt: skip
            image_boxes = clip_boxes_to_image(image_boxes, size)
            scale = image_boxes.new_tensor([original[1] / size[1], original[0] / size[0]] * 2)
            results.append((image_probs, image_boxes * scale, image_students))
        return results

    @torch.no_grad()
    def roi_scores(self, images: Tensor, proposals: Sequence[Tensor]) -> RoiScores:
        """Every head's per-ROI class probabilities on a batch, without gradients (a teacher's forward:
        the neck runs with its inference chunking and keeps no graph). In the module's current
        mode; full precision, like ``predict_rois``."""
        roi_features = self.roi_features(images, proposals)
        with _autocast_off(roi_features):
            roi_features = _full_precision(roi_features)
            mil = self.mil_head(roi_features, [len(p) for p in proposals])
            students = tuple(F.softmax(student(roi_features)[0], dim=1) for student in self.students)
        return RoiScores(mil, students)

    def teacher_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """As an EMA teacher: ``{"teacher_scores": RoiScores}`` on the student's images and ROIs."""
        return {"teacher_scores": self.roi_scores(inputs["images"], inputs["proposals"])}

    def predict_view(
        self, inputs: Mapping[str, Any], flipped: Sequence[bool], settings: DetectionSettings | None = None
    ) -> list[dict[str, Tensor]]:
        """One test view of a batch -> per image its per-ROI ``scores`` (R, C+1), ``boxes`` (R, C+1, 4)
        in original pixels (flips undone) and ``image_scores`` (C,), averaged over the views by
        ``merge_views`` before the NMS (docs/METHOD.md §5), and each student's softmax
        ``student_scores`` (K, R, C+1), which a method may mix with (``mix_predictions``). ``settings``
        are not needed per view."""
        proposals = inputs["proposals"]
        features = self.roi_features(inputs["images"], proposals)
        per_roi = self._per_roi(features, proposals, inputs["image_sizes"], inputs["original_sizes"])
        per_image = self.image_scores(features, proposals)
        return [
            {
                "scores": scores,
                "boxes": unflip_boxes(boxes, size[1]) if flip else boxes,
                "image_scores": image,
                "student_scores": students,
            }
            for (scores, boxes, students), size, flip, image in zip(
                per_roi, inputs["original_sizes"], flipped, per_image, strict=True
            )
        ]

    def mix_predictions(self, own: dict[str, Tensor], teacher: dict[str, Tensor]) -> dict[str, Tensor]:
        """One image-view's ``predict_view`` record mixed with its EMA teacher's on the same ROIs
        (``model.eval_weights=mix``), as the method says (``RefinementMethod.mix_predictions``: by
        default the class probabilities by its ``mix_scores``, boxes and image scores averaged)."""
        return self.method.mix_predictions(own, teacher)

    def merge_views(
        self, views: Sequence[dict[str, Tensor]], settings: DetectionSettings
    ) -> dict[str, Tensor]:
        """One image's ``predict_view`` records -> its detections: per-ROI scores, boxes and image scores
        averaged over the views (every view shares the image's proposals), then ``postprocess``."""
        merged = ("scores", "boxes", "image_scores")
        total = {name: views[0][name] for name in merged}
        for view in views[1:]:
            total = {name: total[name] + view[name] for name in merged}
        detections = self.postprocess(total["scores"] / len(views), total["boxes"] / len(views), settings)
        detections["image_scores"] = total["image_scores"] / len(views)
        return detections

    def image_scores(self, roi_features: Tensor, proposals: Sequence[Tensor]) -> Tensor:
        """The MIL teacher's image-level class scores (B, C): per image, the sum of its ROI scores
        (docs/METHOD.md §3, the ``phi`` of the MIL loss), clamped to [0, 1], background dropped. What
        label-only evaluation ranks images by (docs/METHOD.md §10). Full precision, like ``predict_rois``."""
        with _autocast_off(roi_features):
            counts = [len(p) for p in proposals]
            roi_scores = self.mil_head(_full_precision(roi_features), counts)
            phi = torch.stack([s.sum(dim=0) for s in roi_scores.split(counts)])
            return phi[:, 1:].clamp(0.0, 1.0)

    def postprocess(
        self, scores: Tensor, boxes: Tensor, settings: DetectionSettings | None = None
    ) -> dict[str, Tensor]:
        """One image's per-ROI scores (R, C+1) and boxes (R, C+1, 4) -> per-class NMS detections, with
        ``settings`` (its own ``detection_settings`` when None)."""
        settings = settings or self.detection_settings
        with _autocast_off(scores):
            return postprocess_rois(
                scores, boxes, score_threshold=settings.score_threshold, nms_iou=settings.nms_iou,
                detections_per_image=settings.detections_per_image,
            )  # fmt: skip


def postprocess_rois(
    scores: Tensor, boxes: Tensor, *, score_threshold: float, nms_iou: float, detections_per_image: int
) -> dict[str, Tensor]:
    """One image's per-ROI scores (R, C+1) and boxes (R, C+1, 4), column 0 the background -> the
    foreground detections of ``per_class_nms``, labels in 0..C-1."""
    num_classes = scores.shape[1] - 1
    fg_scores = scores[:, 1:].reshape(-1)
    fg_boxes = boxes[:, 1:].reshape(-1, 4)
    fg_labels = torch.arange(num_classes, device=scores.device).repeat(scores.shape[0])
    return per_class_nms(fg_boxes, fg_scores, fg_labels, score_threshold, nms_iou, detections_per_image)


def per_class_nms(
    boxes: Tensor, scores: Tensor, labels: Tensor, score_threshold: float | None, nms_iou: float, top: int
) -> dict[str, Tensor]:
    """Detections (D, 4) / (D,) / (D,) scoring above ``score_threshold`` (None: all), without boxes
    clipped to nothing, after per-class NMS at ``nms_iou``: the best ``top``, by decreasing score."""
    if score_threshold is not None:
        keep = scores > score_threshold
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
    # A box clipped to nothing (predicted outside the image) is no detection, and its IoU is 0/0.
    keep = remove_small_boxes(boxes, MIN_BOX_SIZE)
    boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
    kept = batched_nms(boxes.float(), scores.float(), labels, nms_iou)[:top]
    return {"boxes": boxes[kept], "scores": scores[kept], "labels": labels[kept]}


def _check_method_heads(method: RefinementMethod, heads: nn.ModuleDict) -> None:
    """The detector holds exactly the heads its method builds (``head_names``), by name."""
    expected = sorted(method.head_names)
    if sorted(heads) != expected:
        raise ValueError(
            f"{type(method).__name__} trains the heads {expected}, but the detector was given"
            f" {sorted(heads)}: build them with method.build_heads(in_features, num_classes)"
        )


def _check_students(method: RefinementMethod, students: Sequence[RefinementStudent]) -> None:
    """The students must be what ``method`` trains: none for a method without students, at least one
    otherwise, each with a box regressor iff the method regresses boxes."""
    name = type(method).__name__
    if not method.trains_students:
        if len(students):
            raise ValueError(
                f"{name} trains no refinement students (its detections are the MIL teacher's): build the"
                f" detector with num_students=0, got {len(students)} students"
            )
        return
    if len(students) < 1:
        raise ValueError(
            f"{name} trains refinement students: the detector needs at least one (num_students >= 1)"
        )
    wrong = [k for k, s in enumerate(students, start=1) if s.box_regression != method.box_regression]
    if wrong:
        has = "has" if method.box_regression else "has no"
        raise ValueError(
            f"{name} {has} box regression, but students {wrong} {'lack' if method.box_regression else 'have'}"
            " a box regressor: build them with RefinementStudent(..., box_regression=method.box_regression)"
        )


def _as_method(
    method: RefinementMethod | None, labeler: PseudoLabeler | None, first_student_loss_weight: float | None
) -> RefinementMethod:
    """The detector's refinement method from its ``method`` / ``labeler`` / ``first_student_loss_weight``
    arguments: MIST by default, a plain labeller wrapped with the students' weighted losses."""
    if method is not None:
        if labeler is not None or first_student_loss_weight is not None:
            raise ValueError(
                "give either a method or a labeler (with first_student_loss_weight), not both: a method"
                " carries its own settings, e.g. MISTMethod(first_student_loss_weight=3.0)"
            )
        return method
    weight = 3.0 if first_student_loss_weight is None else first_student_loss_weight
    if labeler is None:
        return MISTMethod(first_student_loss_weight=weight)
    return LabelerMethod(labeler, first_student_loss_weight=weight)


def build_backbone(name: str, **options) -> Backbone:
    """The ``Backbone`` called ``name`` in ``BACKBONES``, built with its own ``options`` (for ResNet:
    ``width``, ``weights``, ``norm``, ``neck_norm``, ``freeze_at``, see ``build_resnet_c4``; for VGG16:
    ``weights``, ``freeze_at``, see ``vgg16_backbone``)."""
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone '{name}': expected one of {sorted(BACKBONES)}")
    try:
        return BACKBONES[name](**options)
    except TypeError as error:
        raise TypeError(f"backbone '{name}': {error}") from error


def detector_from_backbone(
    backbone: Backbone,
    num_classes: int,
    chunk_size: int | str | None = 256,
    *,
    test_chunk_size: int | None = None,
    pooler: str | None = None,
    roi_size: int | None = None,
    fuse_pooling: bool = True,
    memory_budget_gb: float | None = None,
    num_students: int = 3,
    dropblock: bool = False,
    dropblock_hidden: int | None = None,
    dropblock_block_size: int = 3,
    **detector_options,
) -> WeaklySupervisedDetector:
    """The detector on a built ``Backbone``: ROI pooler at ``1 / backbone.stride`` (``pooler`` and
    ``roi_size``: the backbone's own, ``backbone.pooler`` and ``backbone.roi_size``, unless given), the
    backbone's neck under sequential backprop (``RoIFeatureHead``; ``chunk_size="auto"`` with
    ``memory_budget_gb``, see ``wsod.modeling.chunking``), the MIL teacher and ``num_students`` students
    of width ``backbone.feature_dim``, initialised as the method says (``mil_std``, ``student_cls_std``,
    ``student_box_std``). ``dropblock``: Concrete DropBlock on the pooled features
    (``ConcreteDropBlock(backbone.channels, block_size=dropblock_block_size,
    hidden_channels=dropblock_hidden)``), trained by the
    adversarial step of ``wsod.engine.adversarial``. ``detector_options`` go to
    ``WeaklySupervisedDetector`` (``method`` or ``labeler``, post-processing)."""
    method = _as_method(
        detector_options.pop("method", None),
        detector_options.pop("labeler", None),
        detector_options.pop("first_student_loss_weight", None),
    )
    block = None
    if dropblock:
        block = ConcreteDropBlock(
            backbone.channels, block_size=dropblock_block_size, hidden_channels=dropblock_hidden
        )
    roi_pooler = build_roi_pooler(
        backbone.pooler if pooler is None else pooler,
        output_size=backbone.roi_size if roi_size is None else roi_size,
        spatial_scale=1 / backbone.stride,
    )
    roi_head = RoIFeatureHead(
        roi_pooler,
        backbone.neck,
        chunk_size=chunk_size,
        inference_chunk_size=test_chunk_size,
        fuse_pooling=fuse_pooling,
        dropblock=block,
        memory_budget_gb=memory_budget_gb,
    )
    return WeaklySupervisedDetector(
        base=backbone.base,
        roi_head=roi_head,
        mil_head=MILHead(backbone.feature_dim, num_classes, std=method.mil_std),
        method_heads=method.build_heads(backbone.feature_dim, num_classes),
        students=[
            RefinementStudent(
                backbone.feature_dim,
                num_classes,
                box_regression=method.box_regression,
                cls_std=method.student_cls_std,
                box_std=method.student_box_std,
            )
            for _ in range(num_students)
        ],
        method=method,
        **detector_options,
    )


def build_detector(
    backbone: str = "resnet50",
    num_classes: int = 20,
    chunk_size: int | str | None = 256,
    *,
    test_chunk_size: int | None = None,
    pooler: str | None = None,
    roi_size: int | None = None,
    fuse_pooling: bool = True,
    memory_budget_gb: float | None = None,
    num_students: int = 3,
    dropblock: bool = False,
    dropblock_hidden: int | None = None,
    dropblock_block_size: int = 3,
    method: RefinementMethod | None = None,
    labeler: PseudoLabeler | None = None,
    first_student_loss_weight: float | None = None,
    nms_iou: float = 0.3,
    score_threshold: float = 0.0,
    detections_per_image: int = 100,
    **backbone_options,
) -> WeaklySupervisedDetector:
    """One-line builder: ``build_detector("resnet50", num_classes=20, chunk_size=256)`` (or ``"vgg16"``,
    each backbone with its own ROI pooling), or ``chunk_size="auto"`` (plain autograd when a step's ROIs
    fit ``memory_budget_gb``, else the largest chunk that does; on CUDA the budget may be ``None``: the
    free memory less a margin). ``method``: the refinement method (``OICRMethod()``...; MIST by default).

    ``backbone`` is a name of ``BACKBONES`` and ``backbone_options`` its builder's options (ResNet:
    ``width``, ``weights``, ``norm``, ``neck_norm``, ``freeze_at``; VGG16: ``weights``, ``freeze_at``);
    see ``detector_from_backbone`` for the ROI head (``chunk_size``, ``test_chunk_size``, ``pooler``,
    ``roi_size``, ``fuse_pooling``, ``memory_budget_gb``, ``dropblock``, ``dropblock_hidden``,
    ``dropblock_block_size``) and
    ``WeaklySupervisedDetector`` for the rest.
    """
    return detector_from_backbone(
        build_backbone(backbone, **backbone_options),
        num_classes,
        chunk_size,
        test_chunk_size=test_chunk_size,
        pooler=pooler,
        roi_size=roi_size,
        fuse_pooling=fuse_pooling,
        memory_budget_gb=memory_budget_gb,
        num_students=num_students,
        dropblock=dropblock,
        dropblock_hidden=dropblock_hidden,
        dropblock_block_size=dropblock_block_size,
        method=method,
        labeler=labeler,
        first_student_loss_weight=first_student_loss_weight,
        nms_iou=nms_iou,
        score_threshold=score_threshold,
        detections_per_image=detections_per_image,
    )
