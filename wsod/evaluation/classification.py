"""Image-level classification AP: how well per-image class scores rank the images that contain a class.

What a test set with image-level labels but no boxes can measure (docs/METHOD.md §10). Per class, the
images are ranked by decreasing score (ties keep image order: a stable sort); an image labelled with the
class is a true positive, any other a false positive; precision and recall along that ranking give AP by
the devkit's formulas (``wsod.evaluation.voc.average_precision``): "voc07" the 11-point measure of the
VOC 2007 classification devkit, "area" the area under the precision envelope (VOC 2010 and later).
A class no image is labelled with has no defined recall: its AP is NaN and it is left out of the mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from wsod.evaluation.voc import average_precision

__all__ = ["classification_ap", "format_classification"]


def classification_ap(scores: Tensor, labels: Tensor, metric: str = "area") -> dict[str, Any]:
    """AP per class of ``scores`` (N, C) against multi-hot ``labels`` (N, C) over N images.

    Returns plain Python values: ``"metric"``, ``"ap"`` (per class, NaN without positives),
    ``"num_positives"`` (images labelled with each class) and ``"cls_mAP"`` (mean of the defined APs,
    NaN if none).
    """
    scores = torch.as_tensor(scores).detach().cpu().double()
    labels = torch.as_tensor(labels).detach().cpu().bool()
    if scores.shape != labels.shape or scores.dim() != 2:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} must both be (N, C)")
    ap, positives = [], []
    for c in range(scores.shape[1]):
        order = torch.sort(scores[:, c], descending=True, stable=True).indices
        hits = labels[order, c]
        num_positive = int(hits.sum())
        positives.append(num_positive)
        if num_positive == 0:
            ap.append(math.nan)
            continue
        tp = hits.double().cumsum(0)
        ranks = torch.arange(1, len(hits) + 1, dtype=torch.float64)
        ap.append(average_precision(tp / num_positive, tp / ranks, metric))
    defined = [v for v in ap if not math.isnan(v)]
    return {
        "metric": metric,
        "ap": ap,
        "num_positives": positives,
        "cls_mAP": sum(defined) / len(defined) if defined else math.nan,
    }


def format_classification(results: Mapping[str, Any], class_names: Sequence[str]) -> str:
    """A per-class table (AP in percent, images labelled with the class), the mean, and a line

    ``copypaste: cls_mAP(area)=71.20, per-class AP: 80.00,62.40,...``
    """
    if len(class_names) != len(results["ap"]):
        raise ValueError(f"{len(class_names)} class names for {len(results['ap'])} classes")
    width = max(len(name) for name in ("class", *class_names))
    header = f"{'class':<{width}}{'cls AP(' + results['metric'] + ')':>16}{'images':>10}"
    lines = [header, "-" * len(header)]
    for name, value, count in zip(class_names, results["ap"], results["num_positives"], strict=True):
        lines.append(f"{name:<{width}}{_percent(value, '-'):>16}{count:>10}")
    lines += ["-" * len(header), f"{'mean':<{width}}{_percent(results['cls_mAP'], '-'):>16}"]
    per_class = ",".join(_percent(v) for v in results["ap"])
    lines.append(
        f"copypaste: cls_mAP({results['metric']})={_percent(results['cls_mAP'])}, per-class AP: {per_class}"
    )
    return "\n".join(lines)


def _percent(value: float, missing: str = "nan") -> str:
    return missing if math.isnan(value) else f"{100 * value:.2f}"
