"""Training rules for partial labels: points, scribbles and boxes on some objects (docs/METHOD.md §4).

An image's partial labels reach the method in its targets dict (``wsod.data.targets``; made by
``wsod.data.partial_labels``), in the resized, flipped image's pixels. ``PartialLabels.from_targets``
reads them; an image without any (no field, or empty ones) gets None, and its pseudo-labels are made
exactly as with image labels alone.

The rules, per image, as the reference code applies them (NVlabs/wetectron, UFO2: ``roi_sampler.py``,
``loss.py`` ``filter_pseudo_labels``), with the box kind and per-object mixing added by wsod:

* a point of class c is *in* an ROI when it lies strictly inside it (x1 < x < x2, y1 < y < y2: the
  reference's test);
* a scribble stands for its bounding box (the min and max of its points); an ROI *covers* a scribble
  when the part of the scribble box inside the ROI is at least ``SCRIBBLE_COVERAGE`` (0.5) of the
  scribble box's area, both measured in inclusive pixels (width x2 - x1 + 1): the reference's
  ``boxlist_iou_async``, intersection over the scribble box's own area, which the issue text and the
  UFO2 paper call IoU;
* pseudo-label filter: a foreground pseudo-label of class c on an ROI stays foreground only if the ROI
  holds a point of class c or covers a scribble of class c, else it becomes background (its weight and
  regression target unchanged). Applied only to the classes that have points or scribbles in the
  image: a class with only an image label keeps the image-label rules there;
* supervising boxes: each box of class c is one of that class's pseudo boxes, score 1, for every
  student. A class whose objects in the image are all boxed (boxes and no point or scribble) takes its
  boxes instead of the labeller's picks; a class with boxes and points or scribbles keeps both (the
  picks then obey the filter, the boxes do not). ROIs are assigned as the labeller assigns them to its
  picks (MIST: IoU >= fg_iou; OICR: IoU > fg_iou), the supervising boxes listed before the picks so
  that an ROI as close to both takes the box; an ROI assigned to a supervising box keeps its label;
* ROI sampling (``sample_training_rois``), before pooling, only in images with points or scribbles: at
  most ``rois_per_image`` (1,024) ROIs, at most ``positive_fraction`` (25%) of them positive, drawn at
  random by torchvision's ``BalancedPositiveNegativeSampler`` (the reference's sampler, the same
  rule); positive = holds a point, covers a scribble, or (wsod, for mixed images) overlaps a
  supervising box at IoU >= 0.5.

Differences from the reference (docs/METHOD.md §4, partial labels): the scribble filter accepts an ROI
covering *any* scribble of its class (the reference takes only the scribble the ROI covers most, which
can be of another class); the box kind and per-object mixing do not exist there (one global switch:
every image points, or every image scribbles); an empty scribble is an error at loading (the reference
substitutes the box [1, 2, 3, 4]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler
from torchvision.ops import box_iou

from wsod.modeling.method import PseudoLabels

__all__ = [
    "PARTIAL_LABEL_FIELDS",
    "SCRIBBLE_COVERAGE",
    "SAMPLER_BOX_IOU",
    "PartialLabels",
    "scribble_boxes",
    "points_in_rois",
    "scribble_coverage",
    "partial_guidance",
    "filter_pseudo_labels",
    "with_supervising_boxes",
    "partial_pseudo_labels",
    "positive_rois",
    "sample_training_rois",
]

# The targets fields that hold partial labels (``wsod.data.targets`` names the rest of each kind).
PARTIAL_LABEL_FIELDS = ("points", "scribble_points", "boxes")
# The reference's scribble matcher: Matcher(0.5, 0.5) on intersection over the scribble box's area.
SCRIBBLE_COVERAGE = 0.5
# A supervising box makes an ROI positive for the sampler at this IoU (the reference's ROI_HEADS
# FG_IOU_THRESHOLD, which its box sampler uses).
SAMPLER_BOX_IOU = 0.5


@dataclass(frozen=True)
class PartialLabels:
    """One image's partial labels in the resized image's pixels; classes are foreground indices 0..C-1.

    points (P, 2) x y, point_classes (P,); scribble_boxes (S, 4) xyxy (one per stroke), scribble_classes
    (S,); boxes (G, 4) xyxy supervising boxes, box_classes (G,). Empty kinds are (0, 2) / (0, 4) / (0,).
    """

    points: Tensor
    point_classes: Tensor
    scribble_boxes: Tensor
    scribble_classes: Tensor
    boxes: Tensor
    box_classes: Tensor

    @classmethod
    def from_targets(cls, targets: Mapping[str, Tensor], like: Tensor) -> PartialLabels | None:
        """The partial labels of an image's targets dict, None when it has none; tensors on ``like``'s
        device and dtype (the proposals')."""
        if all(targets.get(name) is None or targets[name].numel() == 0 for name in PARTIAL_LABEL_FIELDS):
            return None
        device, dtype = like.device, like.dtype

        def geometry(name: str, width: int) -> Tensor:
            value = targets.get(name)
            return like.new_zeros(0, width) if value is None else value.to(device, dtype).reshape(-1, width)

        def classes(name: str) -> Tensor:
            value = targets.get(name)
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return empty if value is None else value.to(device, torch.int64).reshape(-1)

        stroke_boxes, stroke_classes = scribble_boxes(
            geometry("scribble_points", 2), classes("scribble_labels"), classes("scribble_ids")
        )
        return cls(
            points=geometry("points", 2),
            point_classes=classes("point_labels"),
            scribble_boxes=stroke_boxes,
            scribble_classes=stroke_classes,
            boxes=geometry("boxes", 4),
            box_classes=classes("box_labels"),
        )

    @property
    def has_points_or_scribbles(self) -> bool:
        return self.points.shape[0] > 0 or self.scribble_boxes.shape[0] > 0

    def guided_classes(self) -> Tensor:
        """The classes with a point or a scribble in the image (the filter's), sorted, int64."""
        return torch.unique(torch.cat([self.point_classes, self.scribble_classes]))

    def boxed_only_classes(self) -> Tensor:
        """The classes with supervising boxes and no point or scribble: their boxes replace the picks."""
        boxed = torch.unique(self.box_classes)
        return boxed[~torch.isin(boxed, self.guided_classes())]


def scribble_boxes(points: Tensor, classes: Tensor, stroke_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Each stroke's bounding box: points (S, 2), classes (S,) and stroke ids (S,) of the flat scribble
    fields -> boxes (N, 4) xyxy and classes (N,), one per distinct stroke id in ascending id order."""
    if points.shape[0] == 0:
        return points.new_zeros(0, 4), classes.new_zeros(0)
    ids, inverse = torch.unique(stroke_ids, return_inverse=True)
    index = inverse[:, None].expand(-1, 2)
    low = points.new_full((len(ids), 2), float("inf")).scatter_reduce(0, index, points, "amin")
    high = points.new_full((len(ids), 2), float("-inf")).scatter_reduce(0, index, points, "amax")
    stroke_classes = classes.new_zeros(len(ids)).scatter(0, inverse, classes)  # one class per stroke
    return torch.cat([low, high], dim=1), stroke_classes


def points_in_rois(rois: Tensor, points: Tensor) -> Tensor:
    """(R, P) bool: point p lies strictly inside ROI r (x1 < x < x2 and y1 < y < y2)."""
    x, y = points[None, :, 0], points[None, :, 1]
    return (rois[:, None, 0] < x) & (x < rois[:, None, 2]) & (rois[:, None, 1] < y) & (y < rois[:, None, 3])


def scribble_coverage(rois: Tensor, boxes: Tensor) -> Tensor:
    """(R, S): the share of scribble box s inside ROI r, areas in inclusive pixels (x2 - x1 + 1)."""
    top_left = torch.maximum(rois[:, None, :2], boxes[None, :, :2])
    bottom_right = torch.minimum(rois[:, None, 2:], boxes[None, :, 2:])
    overlap = (bottom_right - top_left + 1).clamp(min=0).prod(dim=2)
    area = (boxes[:, 2:] - boxes[:, :2] + 1).prod(dim=1)
    return overlap / area[None, :]


def partial_guidance(rois: Tensor, partial: PartialLabels, num_classes: int) -> Tensor:
    """(R, C) bool: ROI r holds a point of class c or covers a scribble of class c."""
    allowed = torch.zeros(rois.shape[0], num_classes, dtype=torch.bool, device=rois.device)
    if partial.points.shape[0]:
        inside = points_in_rois(rois, partial.points).to(torch.int64)  # (R, P)
        hits = inside.new_zeros(rois.shape[0], num_classes).index_add_(1, partial.point_classes, inside)
        allowed |= hits > 0
    if partial.scribble_boxes.shape[0]:
        covered = (scribble_coverage(rois, partial.scribble_boxes) >= SCRIBBLE_COVERAGE).to(torch.int64)
        hits = covered.new_zeros(rois.shape[0], num_classes).index_add_(1, partial.scribble_classes, covered)
        allowed |= hits > 0
    return allowed


def filter_pseudo_labels(
    labels: Tensor, rois: Tensor, partial: PartialLabels, num_classes: int, exempt: Tensor | None = None
) -> Tensor:
    """labels (R,) int64 (0 background, c + 1 class c) with every foreground label of a class that has
    points or scribbles in the image set to 0 unless its ROI holds a point or covers a scribble of that
    class; ``exempt`` (R,) bool marks ROIs kept whatever the rule says (assigned to a supervising box)."""
    guided = torch.zeros(num_classes + 1, dtype=torch.bool, device=labels.device)
    guided[partial.guided_classes() + 1] = True
    allowed = partial_guidance(rois, partial, num_classes)  # (R, C)
    allowed = torch.cat([allowed.new_ones(rois.shape[0], 1), allowed], dim=1)  # background: allowed
    keep = ~guided[labels] | allowed.gather(1, labels[:, None]).squeeze(1)
    if exempt is not None:
        keep |= exempt
    return torch.where(keep, labels, 0)


def with_supervising_boxes(
    picks: tuple[Tensor, Tensor, Tensor], partial: PartialLabels
) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    """The supervising boxes (score 1) followed by the labeller's picks (boxes (G, 4), classes (G,),
    scores (G,)), each in ascending class order (stable), and (G',) bool marking the supervising boxes.
    Boxes first: an ROI as close to a supervising box as to a pick takes the box (the labellers assign
    the first pseudo box of maximal IoU). The caller leaves out the picks of boxed-only classes."""
    boxes, classes, scores = picks
    order = torch.sort(partial.box_classes, stable=True).indices
    supervised = torch.cat(
        [torch.ones(len(order), dtype=torch.bool), torch.zeros(len(boxes), dtype=torch.bool)]
    ).to(boxes.device)
    all_boxes = torch.cat([partial.boxes[order].to(boxes.dtype), boxes])
    all_classes = torch.cat([partial.box_classes[order], classes])
    all_scores = torch.cat([scores.new_ones(len(order)), scores])
    return (all_boxes, all_classes, all_scores), supervised


@torch.no_grad()
def partial_pseudo_labels(
    labeler, proposals: Tensor, scores: Tensor, image_labels: Tensor, partial: PartialLabels
) -> PseudoLabels:
    """One image's pseudo-labels under its partial labels (the module docstring's rules), for a labeller
    with ``pseudo_boxes(proposals, scores, image_labels)`` and ``assign(proposals, pseudo_boxes)`` (MIST,
    OICR): picks for the classes not boxed-only, the supervising boxes added, ROIs assigned, filtered."""
    num_classes = image_labels.shape[0]
    pick_labels = image_labels.clone()
    pick_labels[partial.boxed_only_classes()] = 0
    picks = labeler.pseudo_boxes(proposals, scores, pick_labels)
    pseudo_boxes, supervised = with_supervising_boxes(picks, partial)
    labels, weights, targets = labeler.assign(proposals, pseudo_boxes)
    exempt = None
    if len(pseudo_boxes[0]):
        # The labellers assign each ROI the first pseudo box of maximal IoU: the same argmax here.
        exempt = supervised[box_iou(proposals, pseudo_boxes[0]).argmax(dim=1)]
    if partial.has_points_or_scribbles:
        labels = filter_pseudo_labels(labels, proposals, partial, num_classes, exempt)
    return PseudoLabels(
        labels,
        weights,
        targets,
        pseudo_boxes=pseudo_boxes[0],
        pseudo_classes=pseudo_boxes[1],
        pseudo_scores=pseudo_boxes[2],
    )


def positive_rois(rois: Tensor, partial: PartialLabels) -> Tensor:
    """(R,) bool: the sampler's positives, ROIs that hold a point, cover a scribble (any class), or
    overlap a supervising box at IoU >= ``SAMPLER_BOX_IOU``."""
    positive = torch.zeros(rois.shape[0], dtype=torch.bool, device=rois.device)
    if partial.points.shape[0]:
        positive |= points_in_rois(rois, partial.points).any(dim=1)
    if partial.scribble_boxes.shape[0]:
        positive |= (scribble_coverage(rois, partial.scribble_boxes) >= SCRIBBLE_COVERAGE).any(dim=1)
    if partial.boxes.shape[0]:
        positive |= (box_iou(rois, partial.boxes) >= SAMPLER_BOX_IOU).any(dim=1)
    return positive


def sample_training_rois(
    rois: Tensor,
    targets: Mapping[str, Tensor],
    rois_per_image: int = 1024,
    positive_fraction: float = 0.25,
) -> Tensor | None:
    """The indices (K,) ascending of the ROIs to train on in an image with points or scribbles, or None
    to keep them all (no points or scribbles in the image, or nothing dropped).

    torchvision's ``BalancedPositiveNegativeSampler`` (the reference's sampler, the same rule): at most
    ``int(rois_per_image * positive_fraction)`` positives (``positive_rois``) and the rest of
    ``rois_per_image`` negatives, each drawn uniformly without replacement from torch's global generator
    (which the dataset seeds per item); the kept ROIs keep their order.
    """
    partial = PartialLabels.from_targets(targets, rois)
    if partial is None or not partial.has_points_or_scribbles:
        return None
    positive = positive_rois(rois, partial)
    sampler = BalancedPositiveNegativeSampler(rois_per_image, positive_fraction)
    (kept_positive,), (kept_negative,) = sampler([positive.to(torch.int64)])
    kept = (kept_positive | kept_negative).nonzero().squeeze(1)
    return None if len(kept) == rois.shape[0] else kept
