"""Part proposals: how many proposals per object, by class, lie inside the object but cover under half of it.

Multiple-instance learning picks, for each image label, the proposals that score the class highest, and a
piece of an object (pure object colour or texture) often scores higher than the object's whole box (which
also holds background): part domination, weakly supervised detection's classic failure. A class whose
objects come with many part proposals is exposed to it, one whose objects have none is not, whatever the
recall. On the toy set the classes that failed were exactly the three with parts (docs/RESULTS.md, "The
quick start's range"), and the fix was to make those parts rare.

A proposal is a part of a ground-truth box when at least ``inside`` (default 0.9) of the proposal's area
lies in the box and the proposal's area is under ``max_area`` (default 0.5) of the box's: the two numbers
say "inside" with a margin for a boundary pixel and "under half of it". Areas and intersections are in the
VOC devkit's inclusive convention (a box ``[x1, y1, x2, y2]`` is ``(x2 - x1 + 1) x (y2 - y1 + 1)`` pixels),
as recall is. Difficult objects are left out, as recall leaves them out. The evaluation's ``on a part``
column applies the same test to top detections, at half inside (``wsod.evaluation.voc.PART_INSIDE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from wsod.data.proposals.recall import loaded_proposals_of_boxed_records
from wsod.data.proposals.sets import ProposalSet

if TYPE_CHECKING:  # only named in annotations: wsod.data.dataset imports this package at run time
    from wsod.data.dataset import ImageRecord

__all__ = [
    "PartReport",
    "part_proposal_mask",
    "count_part_proposals",
    "records_part_proposals",
    "format_part_table",
]


@dataclass(frozen=True)
class PartReport:
    """Per class ``c``: ``objects[c]`` ground-truth objects (difficult ones left out) and ``parts[c]``
    part proposals summed over them (a proposal that is a part of two objects counts for each)."""

    class_names: tuple[str, ...]
    objects: np.ndarray  # (C,) int64
    parts: np.ndarray  # (C,) int64
    inside: float = 0.9
    max_area: float = 0.5

    def per_object(self) -> np.ndarray:
        """(C,) float64: part proposals per object of each class (NaN for a class without objects)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.objects > 0, self.parts / np.maximum(self.objects, 1), np.nan)


def _inclusive_area(boxes: Tensor) -> Tensor:
    """(N,) pixels covered by inclusive boxes (N, 4)."""
    return (boxes[:, 2] - boxes[:, 0] + 1).clamp(min=0) * (boxes[:, 3] - boxes[:, 1] + 1).clamp(min=0)


def part_proposal_mask(
    boxes: Tensor, gt_boxes: Tensor, *, inside: float = 0.9, max_area: float = 0.5
) -> Tensor:
    """(R, G) bool: proposal ``r`` of ``boxes`` (R, 4) is a part of object ``g`` of ``gt_boxes`` (G, 4)."""
    box_area = _inclusive_area(boxes)[:, None]  # (R, 1)
    gt_area = _inclusive_area(gt_boxes)[None, :]  # (1, G)
    top_left = torch.maximum(boxes[:, None, :2], gt_boxes[None, :, :2])  # (R, G, 2)
    bottom_right = torch.minimum(boxes[:, None, 2:], gt_boxes[None, :, 2:])
    overlap = (bottom_right - top_left + 1).clamp(min=0).prod(dim=2)  # (R, G) inclusive pixels in both
    return (overlap >= inside * box_area) & (box_area < max_area * gt_area) & (box_area > 0)


def count_part_proposals(
    proposals: Sequence[np.ndarray | Tensor],
    gt_boxes: Sequence[np.ndarray | Tensor],
    gt_labels: Sequence[np.ndarray | Tensor],
    class_names: Sequence[str],
    gt_difficult: Sequence[np.ndarray | Tensor] | None = None,
    *,
    inside: float = 0.9,
    max_area: float = 0.5,
) -> PartReport:
    """Part proposals per class over images: per image, proposals (R_i, 4), objects (G_i, 4), their class
    indices (G_i,) in ``0..len(class_names) - 1`` and optionally their difficult flags (G_i,)."""
    if not len(proposals) == len(gt_boxes) == len(gt_labels):
        raise ValueError(
            f"{len(proposals)} proposal arrays, {len(gt_boxes)} box and {len(gt_labels)} label arrays"
        )
    objects = np.zeros(len(class_names), np.int64)
    parts = np.zeros(len(class_names), np.int64)
    for i, (boxes, gt, labels) in enumerate(zip(proposals, gt_boxes, gt_labels, strict=True)):
        gt = torch.as_tensor(np.asarray(gt, dtype=np.float32)).reshape(-1, 4)
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if gt_difficult is not None:
            keep = ~np.asarray(gt_difficult[i], dtype=bool).reshape(-1)
            gt, labels = gt[torch.from_numpy(keep)], labels[keep]
        boxes = torch.as_tensor(np.asarray(boxes, dtype=np.float32)).reshape(-1, 4)
        per_object = part_proposal_mask(boxes, gt, inside=inside, max_area=max_area).sum(dim=0).numpy()
        np.add.at(objects, labels, 1)
        np.add.at(parts, labels, per_object)
    return PartReport(tuple(class_names), objects, parts, inside=inside, max_area=max_area)


def records_part_proposals(
    proposals: ProposalSet,
    records: Sequence[ImageRecord],
    class_names: Sequence[str],
    *,
    min_size: float = 2.0,
    top_k: int | None = None,
) -> PartReport | None:
    """Part proposals of a proposal file on a dataset's ground truth, after the same loading rules as
    training (``filter_proposals``, as ``records_recall``); None when no record has boxes."""
    with_boxes, boxes = loaded_proposals_of_boxed_records(proposals, records, min_size=min_size, top_k=top_k)
    if not with_boxes:
        return None
    return count_part_proposals(
        boxes,
        [r.gt_boxes for r in with_boxes],
        [r.gt_labels for r in with_boxes],
        class_names,
        [r.gt_difficult for r in with_boxes],
    )


def format_part_table(report: PartReport) -> str:
    """The report as a text table: one row per class (objects, part proposals, per object)."""
    width = max([len("class"), *(len(name) for name in report.class_names)])
    header = f"{'class':<{width}} {'objects':>8} {'part proposals':>15} {'per object':>11}"
    rows = [header, "-" * len(header)]
    for name, objects, parts, per_object in zip(
        report.class_names, report.objects, report.parts, report.per_object(), strict=True
    ):
        rows.append(f"{name:<{width}} {objects:>8d} {parts:>15d} {per_object:>11.2f}")
    rows.append(
        f"a part: a proposal with at least {report.inside:.0%} of its area inside the object and under"
        f" {report.max_area:.0%} of the object's area\n(wsod/data/proposals/parts.py): many per object"
        " expose a class to part domination"
    )
    return "\n".join(rows)
