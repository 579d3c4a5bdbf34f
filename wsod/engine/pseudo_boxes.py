"""Which of a trained model's detections on a training image become its pseudo ground truth, and how good
those boxes are (tools/export_pseudo_labels.py; docs/METHOD.md §11).

The rule (``select_pseudo_boxes``) is SoS-WSOD's pseudo ground-truth filter (``tools/pgf.py`` of
suilin0432/SoS-WSOD, CVPR 2022, read for its facts), applied to one image's detections after the model's
own per-class NMS:

1. classes: only detections of the image's labels are kept (its "class filter");
2. score: per class, the top-scoring detection is always kept, the others only with a score of at least
   ``min_score`` (its ``t_keep``, default 0.2). The float32 score is compared in double precision with
   the threshold as given, as pgf.py compares the scores of its json (doubles) with its Python float
   (line 238): a score of exactly float32(0.7) = 0.69999998... is below 0.7 and dropped, and so is
   float32(0.9) below 0.9, where comparing in float32 would keep both;
3. containment: a kept box of class c is dropped when its intersection with another kept box of class
   c, divided by its area + 1e-6, is at least ``containment`` (its ``t_con``, 0.85): the part gives way
   to the whole object, the failure that weakly-supervised models are known for (a face for a person).
   The 1e-6 and the ``>=`` are pgf.py's (``contain_cal``, lines 209-219, and line 259): a box exactly
   ``containment`` inside another stays, and ``containment: 1.0`` drops nothing, not even a box lying
   wholly inside another. Classes listed in ``containment_exempt`` skip this step (SoS-WSOD exempts
   seven VOC classes by default, those whose objects stand in groups and nest in each other's boxes:
   bottle, bus, car, chair, cow, pottedplant, sheep; configs/stage2_experiment/ lists them for VOC).

Line numbers are those of suilin0432/SoS-WSOD's ``tools/pgf.py`` at commit 12d0b3b.

Differences, each so that every labelled class keeps at least one box (the second stage must see every
object class the image holds): of two boxes that contain each other (near-identical boxes, which the
model's NMS rarely leaves) only the lower-scoring one gives way, where SoS-WSOD drops both; a class whose
boxes all gave way keeps its top-scoring one; a labelled class without any detection (a model that never
scores it) gets the whole image as its box, with score 0, and is counted. Areas and intersections are in
wsod's inclusive pixels (``wsod.data.box_formats``); SoS-WSOD measures COCO's continuous boxes.

``pseudo_box_quality`` scores the pseudo boxes against a training set's ground truth (toy, VOC trainval):
precision (the share of pseudo boxes that find an object of their class at IoU >= 0.5, each object found
once, highest score first) and recall (the share of objects found), per class and overall; difficult
objects are neither counted nor counted against, as in the devkit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from wsod.modeling.inclusive_boxes import inclusive_box_iou

__all__ = ["PseudoBoxRule", "select_pseudo_boxes", "containment", "pseudo_box_quality", "SOS_AREA_EPSILON"]


@dataclass(frozen=True)
class PseudoBoxRule:
    """The settings of ``select_pseudo_boxes`` (configs/export.yaml ``rule``).

    Attributes:
        min_score: a class's boxes after its top one are kept from this score up (SoS-WSOD ``t_keep``);
            1.0 keeps exactly one box per labelled class.
        containment: a box this share of which lies inside another kept box of its class is dropped
            (SoS-WSOD ``t_con``; the share is measured against the box's area + 1e-6, so 1.0 drops
            nothing); None switches the step off.
        containment_exempt: class indices that skip the containment step.
    """

    min_score: float = 0.2
    containment: float | None = 0.85
    containment_exempt: tuple[int, ...] = ()


# pgf.py's contain_cal (lines 209-219) divides the intersection by the area + 1e-6, in pixels as here.
SOS_AREA_EPSILON = 1e-6


def containment(boxes: Tensor, epsilon: float = 0.0) -> Tensor:
    """(N, 4) wsod boxes -> (N, N) float64: entry [i, j] is the share of box i's area (inclusive pixels)
    inside box j, the intersection divided by box i's area + ``epsilon`` (the containment step passes
    ``SOS_AREA_EPSILON``)."""
    boxes = boxes.double()
    lt = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    rb = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    inter = (rb - lt + 1).clamp(min=0).prod(dim=2)
    area = ((boxes[:, 2:] - boxes[:, :2] + 1).clamp(min=0)).prod(dim=1)
    return inter / (area + epsilon).clamp(min=1e-12)[:, None]


def select_pseudo_boxes(
    detections: dict[str, Tensor], image_labels: Tensor, image_size: tuple[int, int], rule: PseudoBoxRule
) -> tuple[dict[str, Tensor], list[int]]:
    """One training image's pseudo boxes (the module docstring's rule).

    Args:
        detections: the model's detections of the image, ``boxes`` (D, 4) wsod boxes in original
            pixels, ``scores`` (D,), ``labels`` (D,) in 0..C-1 (any order).
        image_labels: (C,) multi-hot image labels.
        image_size: (H, W); boxes are clipped to the image.

    Returns ``({"boxes" (K, 4), "scores" (K,), "labels" (K,)}, classes given the whole image)``, grouped by
    class in class order, each class's boxes by decreasing score. Every labelled class has at least
    one box; no other class has any.
    """
    height, width = image_size
    boxes = detections["boxes"].float().reshape(-1, 4)
    scores = detections["scores"].float().reshape(-1)
    labels = detections["labels"].long().reshape(-1)
    limits = boxes.new_tensor([width - 1, height - 1] * 2)
    boxes = torch.minimum(boxes.clamp(min=0), limits)
    kept_boxes, kept_scores, kept_labels, whole_image = [], [], [], []
    for c in torch.nonzero(image_labels > 0).flatten().tolist():
        mine = torch.nonzero(labels == c).flatten()
        if len(mine) == 0:
            whole_image.append(c)
            kept_boxes.append(boxes.new_tensor([[0.0, 0.0, width - 1, height - 1]]))
            kept_scores.append(scores.new_zeros(1))
            kept_labels.append(torch.tensor([c]))
            continue
        order = mine[torch.sort(scores[mine], descending=True, stable=True).indices]
        c_boxes, c_scores = boxes[order], scores[order]
        # In double, against the Python float: pgf.py line 238 (module docstring, step 2).
        keep = c_scores.double() >= rule.min_score
        keep[0] = True  # the top box of a labelled class, whatever its score
        c_boxes, c_scores = c_boxes[keep], c_scores[keep]
        if rule.containment is not None and c not in rule.containment_exempt and len(c_boxes) > 1:
            survive = _not_contained(c_boxes, rule.containment)
            c_boxes, c_scores = c_boxes[survive], c_scores[survive]
        kept_boxes.append(c_boxes)
        kept_scores.append(c_scores)
        kept_labels.append(torch.full((len(c_boxes),), c, dtype=torch.long))
    if not kept_boxes:
        empty = {"boxes": boxes.new_zeros(0, 4), "scores": scores.new_zeros(0), "labels": labels.new_zeros(0)}
        return empty, whole_image
    selected = {
        "boxes": torch.cat(kept_boxes),
        "scores": torch.cat(kept_scores),
        "labels": torch.cat(kept_labels),
    }
    return selected, whole_image


def _not_contained(boxes: Tensor, threshold: float) -> Tensor:
    """Boxes of one class, by decreasing score -> which survive the containment step: box i gives way to
    a box j holding ``threshold`` of its area, unless i also holds ``threshold`` of j's and comes first
    (scores in order: the higher one stays); the first box stays when all would go."""
    inside = containment(boxes, SOS_AREA_EPSILON) >= threshold  # [i, j]: i lies in j (pgf.py line 259)
    n = len(boxes)
    inside.fill_diagonal_(False)
    earlier = torch.ones(n, n, dtype=torch.bool).triu(diagonal=1)  # [i, j]: i comes before j
    mutual_winner = inside & inside.T & earlier
    dropped = (inside & ~mutual_winner).any(dim=1)
    survive = ~dropped
    if not survive.any():
        survive[0] = True
    return survive


def pseudo_box_quality(
    pseudo: Sequence[dict[str, Tensor]],
    ground_truth: Sequence[dict[str, Tensor]],
    num_classes: int,
    iou_threshold: float = 0.5,
) -> dict[str, Tensor | float]:
    """Precision and recall of ``pseudo`` (per image ``boxes``, ``scores``, ``labels``) against
    ``ground_truth`` (per image ``boxes``, ``labels``, ``difficult``, ``WeakDetectionDataset.ground_truth``)
    at IoU >= ``iou_threshold`` (inclusive pixels, the devkit's overlap).

    Returns ``{"precision", "recall"}`` overall (floats, NaN with nothing to count) and per class
    (``"class_precision"``, ``"class_recall"``: (C,) float64, NaN where undefined), with the counts
    ``"true_positives"``, ``"pseudo_boxes"``, ``"objects"`` per class ((C,) int64).
    """
    if len(pseudo) != len(ground_truth):
        raise ValueError(f"{len(pseudo)} images of pseudo boxes for {len(ground_truth)} of ground truth")
    tp = torch.zeros(num_classes, dtype=torch.long)
    counted = torch.zeros(num_classes, dtype=torch.long)
    objects = torch.zeros(num_classes, dtype=torch.long)
    for boxes_of, truth in zip(pseudo, ground_truth, strict=True):
        difficult = truth["difficult"].bool()
        for c in range(num_classes):
            gt = truth["boxes"][truth["labels"] == c].float()
            hard = difficult[truth["labels"] == c]
            objects[c] += int((~hard).sum())
            mine = boxes_of["labels"] == c
            if not mine.any():
                continue
            order = torch.sort(boxes_of["scores"][mine].float(), descending=True, stable=True).indices
            boxes = boxes_of["boxes"][mine][order].float()
            if len(gt) == 0:
                counted[c] += len(boxes)
                continue
            overlaps = inclusive_box_iou(boxes, gt)
            taken = torch.zeros(len(gt), dtype=torch.bool)
            for row in overlaps:
                best, j = row.max(dim=0)
                if best < iou_threshold:
                    counted[c] += 1  # a false positive
                elif hard[j]:
                    continue  # a difficult object: neither counted nor counted against
                elif taken[j]:
                    counted[c] += 1  # a second box on a found object
                else:
                    taken[j] = True
                    tp[c] += 1
                    counted[c] += 1
    ratio = lambda a, b: a.double() / b.double()  # noqa: E731  (0 / 0 -> nan)
    return {
        "precision": (tp.sum() / counted.sum()).item() if counted.sum() else float("nan"),
        "recall": (tp.sum() / objects.sum()).item() if objects.sum() else float("nan"),
        "class_precision": ratio(tp, counted),
        "class_recall": ratio(tp, objects),
        "true_positives": tp,
        "pseudo_boxes": counted,
        "objects": objects,
    }
