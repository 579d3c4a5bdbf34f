"""Proposal recall: the fraction of ground-truth boxes that some proposal among the first N covers.

A ground-truth box counts as recalled at IoU t with N proposals when one of the image's first N
proposals (file order, i.e. the proposal method's ranking) has IoU >= t with it, measured with the
devkit's inclusive convention. Difficult boxes are left out, as VOC recall leaves them out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from wsod.data.proposals.sets import ProposalSet, filter_proposals
from wsod.modeling.inclusive_boxes import inclusive_box_iou

if TYPE_CHECKING:  # only named in annotations: wsod.data.dataset imports this package at run time
    from wsod.data.dataset import ImageRecord

__all__ = [
    "RecallReport",
    "proposal_recall",
    "loaded_proposals_of_boxed_records",
    "records_recall",
    "format_recall_table",
    "plot_recall",
]

DEFAULT_COUNTS = (10, 20, 50, 100, 200, 500, 1000, 2000)


@dataclass(frozen=True)
class RecallReport:
    """``recall[t, k]``: recall at IoU ``thresholds[t]`` with ``counts[k]`` proposals per image (the last
    count is the largest number any image has, i.e. all proposals)."""

    thresholds: tuple[float, ...]
    counts: tuple[int, ...]
    recall: np.ndarray
    num_gt: int
    num_images: int
    mean_proposals: float

    def at(self, threshold: float, count: int | None = None) -> float:
        """Recall at one IoU threshold with ``count`` proposals (None: all)."""
        k = len(self.counts) - 1 if count is None else self.counts.index(count)
        return float(self.recall[self.thresholds.index(threshold), k])


def proposal_recall(
    proposals: Sequence[np.ndarray | torch.Tensor],
    gt_boxes: Sequence[np.ndarray | torch.Tensor],
    gt_difficult: Sequence[np.ndarray | torch.Tensor] | None = None,
    *,
    thresholds: Sequence[float] = (0.5, 0.7),
    counts: Sequence[int] = DEFAULT_COUNTS,
) -> RecallReport:
    """Recall of per-image proposals (R_i, 4) against per-image ground truth (G_i, 4) (see module doc)."""
    if len(proposals) != len(gt_boxes):
        raise ValueError(f"{len(proposals)} proposal arrays for {len(gt_boxes)} images")
    max_proposals = max((len(p) for p in proposals), default=0)
    counts = tuple(c for c in sorted(counts) if c < max_proposals) + (max_proposals,)
    # best[k] collects, for every ground-truth box, its best IoU with the first counts[k] proposals.
    best: list[list[torch.Tensor]] = [[] for _ in counts]
    for i, (boxes, gt) in enumerate(zip(proposals, gt_boxes, strict=True)):
        gt = torch.as_tensor(np.asarray(gt, dtype=np.float32)).reshape(-1, 4)
        if gt_difficult is not None:
            gt = gt[~torch.as_tensor(np.asarray(gt_difficult[i], dtype=bool))]
        if len(gt) == 0:
            continue
        boxes = torch.as_tensor(np.asarray(boxes, dtype=np.float32)).reshape(-1, 4)
        if len(boxes) == 0:
            for per_count in best:
                per_count.append(torch.zeros(len(gt)))
            continue
        running_max = inclusive_box_iou(boxes, gt).cummax(dim=0).values  # (R, G): best of the first r + 1
        for k, count in enumerate(counts):
            best[k].append(running_max[min(count, len(boxes)) - 1])
    num_gt = sum(len(b) for b in best[0])
    recall = np.zeros((len(thresholds), len(counts)))
    if num_gt:
        for k, per_count in enumerate(best):
            ious = torch.cat(per_count)
            recall[:, k] = [(ious >= t).float().mean().item() for t in thresholds]
    return RecallReport(
        thresholds=tuple(thresholds),
        counts=counts,
        recall=recall,
        num_gt=num_gt,
        num_images=len(proposals),
        mean_proposals=float(np.mean([len(p) for p in proposals])) if len(proposals) else 0.0,
    )


def format_recall_table(report: RecallReport) -> str:
    """The report as a text table: one row per number of proposals, one column per IoU threshold."""
    header = f"{'proposals':>10} " + " ".join(f"{f'recall@{t:g}':>11}" for t in report.thresholds)
    rows = [header, "-" * len(header)]
    for k, count in enumerate(report.counts):
        label = f"all {count}" if k == len(report.counts) - 1 else str(count)
        rows.append(f"{label:>10} " + " ".join(f"{r:>11.4f}" for r in report.recall[:, k]))
    rows.append(
        f"{report.num_gt} ground-truth boxes in {report.num_images} images,"
        f" {report.mean_proposals:.1f} proposals per image on average"
    )
    return "\n".join(rows)


def plot_recall(report: RecallReport, path: str | os.PathLike, title: str = "proposal recall") -> None:
    """Recall versus number of proposals (log scale), one line per IoU threshold, saved as an image."""
    # The object-oriented API with the Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for t, threshold in enumerate(report.thresholds):
        axes.plot(report.counts, report.recall[t], marker="o", label=f"IoU {threshold:g}")
    axes.set_xscale("log")
    axes.set_xlabel("proposals per image")
    axes.set_ylabel("recall")
    axes.set_ylim(0, 1.02)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(os.fspath(path))


def loaded_proposals_of_boxed_records(
    proposals: ProposalSet, records: Sequence[ImageRecord], *, min_size: float = 2.0, top_k: int | None = None
) -> tuple[list[ImageRecord], list[torch.Tensor]]:
    """The records with ground-truth boxes, and each one's proposals (R_i, 4) as training loads them
    (``filter_proposals`` with the recorded image size): what the proposal reports measure."""
    with_boxes = [r for r in records if r.has_boxes]
    boxes = [
        filter_proposals(
            proposals[r.image_id],
            (r.height, r.width),
            min_size=min_size,
            top_k=top_k,
            scores=proposals.scores(r.image_id),
        )  # fmt: skip
        for r in with_boxes
    ]
    return with_boxes, boxes


def records_recall(
    proposals: ProposalSet,
    records: Sequence[ImageRecord],
    *,
    min_size: float = 2.0,
    top_k: int | None = None,
    **options,
) -> RecallReport | None:
    """Recall of a proposal file on a dataset's ground truth, after the same filtering as training
    (``filter_proposals`` with the recorded image sizes); None when no record has boxes."""
    with_boxes, boxes = loaded_proposals_of_boxed_records(proposals, records, min_size=min_size, top_k=top_k)
    if not with_boxes:
        return None
    return proposal_recall(
        boxes, [r.gt_boxes for r in with_boxes], [r.gt_difficult for r in with_boxes], **options
    )
