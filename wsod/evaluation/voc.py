"""PASCAL VOC detection metrics (AP, mAP), CorLoc, a per-class results table and devkit result files.

Inputs are lists over images, in the same image order:

- detections: ``{"boxes": (D, 4) float xyxy, "scores": (D,) float, "labels": (D,) int64}``
- annotations: ``{"boxes": (G, 4) float xyxy, "labels": (G,) int64, "difficult": (G,) bool}``
  (``"difficult"`` may be omitted: no box is difficult).

Labels index the foreground classes 0..num_classes-1. Tensors may live on any device; numpy arrays and
nested lists work too. Everything is computed on the CPU in float64, as the MATLAB devkit does.

Boxes are 0-based inclusive pixel coordinates (``wsod.data.box_formats``), and IoU follows the devkit's
inclusive convention: a box covers (x2 - x1 + 1) x (y2 - y1 + 1) pixels, so [0, 0, 9, 9] is a 10 x 10 box.

AP follows the official devkit (VOCevaldet.m), not the widely copied Python port: per class, the
detections of all images are ranked by decreasing score; each is compared with the ground-truth box of
its image and class that has the highest IoU, whether or not that box is matched already; if that IoU is
>= the threshold (the port uses >), a difficult box makes the detection neither TP nor FP, a free box
makes it a TP and becomes matched, a matched box makes it a FP (duplicate); otherwise it is a FP.
Recall counts non-difficult boxes only.

Ties: equal scores keep input order (stable sort), i.e. image order, then detection order within an
image -- the order of the lines of a devkit result file, which MATLAB's stable sort keeps too. Among
ground-truth boxes of equal IoU, the first in annotation order is taken (the devkit's strict ``>``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from wsod.data.box_formats import to_one_based
from wsod.data.proposals.parts import part_proposal_mask
from wsod.modeling.inclusive_boxes import inclusive_box_iou

__all__ = [
    "METRICS",
    "PART_INSIDE",
    "average_precision",
    "corloc",
    "evaluate",
    "format_results",
    "write_voc_results",
]

METRICS = ("voc07", "area")

# MATLAB's 0:0.1:1, the devkit's 11 recall thresholds. MATLAB builds a colon range from both ends
# (a + k d for the first half, b - k d for the second), so each value is the double nearest k / 10
# except the fourth, 3 * 0.1 = 0.30000000000000004: a recall of exactly 0.3 (3 of 10 objects) does not
# reach it. Kept for bit-compatibility with the official devkit; the Python port's
# np.arange(0, 1.1, 0.1) also misses 0.6 and 0.7.
_VOC07_RECALL_THRESHOLDS = torch.tensor(
    [k * 0.1 if k <= 5 else 1.0 - (10 - k) * 0.1 for k in range(11)], dtype=torch.float64
)

_Images = Sequence[Mapping[str, Any]]

# The share of a top detection's area that must lie in an object's box for ``corloc`` to call it on a part
# of the object. Half, where a proposal must lie 90% inside (wsod.data.proposals.parts): a detection is a
# proposal moved by box regression, and a part's box regressed toward the whole object straddles its
# border (measured on the toy's part-dominated runs: a median 73% inside, docs/RESULTS.md).
PART_INSIDE = 0.5


def average_precision(recall: Tensor, precision: Tensor, metric: str = "voc07") -> float:
    """AP of one class from its precision-recall points (N,) in rank order, as the devkit computes it.

    "voc07": mean over t in 0, 0.1, ..., 1 of the highest precision at recall >= t (0 if recall never
    reaches t), VOC 2007's 11-point interpolated AP. "area": area under the precision envelope (at each
    recall, the highest precision at that recall or beyond), VOC 2010 onwards.
    """
    recall, precision = recall.double().cpu(), precision.double().cpu()
    if metric == "voc07":
        if len(recall) == 0:
            return 0.0
        reached = recall[None, :] >= _VOC07_RECALL_THRESHOLDS[:, None]  # (11, N)
        # Precision is >= 0, so a 0 fill gives both the maximum and the devkit's 0 where none reaches t.
        return torch.where(reached, precision[None, :], 0.0).amax(dim=1).mean().item()
    if metric == "area":
        recall = torch.cat([recall.new_zeros(1), recall, recall.new_ones(1)])
        precision = torch.cat([precision.new_zeros(1), precision, precision.new_zeros(1)])
        envelope = precision.flip(0).cummax(0).values.flip(0)
        # Points where recall does not move add a zero-width strip, so all steps can be summed.
        return ((recall[1:] - recall[:-1]) * envelope[1:]).sum().item()
    raise ValueError(f"unknown metric '{metric}': expected one of {METRICS}")


def evaluate(
    detections: _Images, annotations: _Images, num_classes: int, metric: str = "voc07", iou: float = 0.5
) -> dict[str, Any]:
    """Per-class AP and mAP of ``detections`` against ``annotations`` (see the module docstring).

    Returns a dict of plain Python values (JSON-friendly), per-class lists indexed by class:

    - ``"metric"``: ``metric``; ``"iou"``: ``iou``
    - ``"ap"``: AP per class, in [0, 1]
    - ``"recall"``: fraction of the non-difficult boxes found at any score, per class
    - ``"num_gt"``: non-difficult ground-truth boxes per class; ``"num_detections"``: detections per class
    - ``"mAP"``: mean of ``"ap"`` over the classes with ``num_gt > 0``

    A class without non-difficult ground truth has no defined recall, so its AP and recall are NaN and it
    is left out of the mean (the devkit gives 0 or NaN depending on the metric; COCOeval leaves such
    classes out too). With no such class at all, mAP is NaN. A class with ground truth but no detection
    has AP 0.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric '{metric}': expected one of {METRICS}")
    if not 0.0 < iou <= 1.0:
        raise ValueError(f"iou must be in (0, 1], got {iou}")
    images = _load(detections, annotations, num_classes)

    # Per detection: its class, score, highest IoU with a box of its class in its image, and that box's
    # index among all images' boxes. The best box does not depend on which boxes are matched already
    # (the devkit ignores that when choosing), so this is computed for all detections at once per image.
    scores, labels, best_iou, best_box, gt_labels, gt_difficult = [], [], [], [], [], []
    num_boxes = 0
    for det, ann in images:
        overlaps = inclusive_box_iou(det["boxes"], ann["boxes"])  # (D, G)
        # Boxes of other classes get IoU -1, so they never win and never reach the threshold.
        overlaps.masked_fill_(det["labels"][:, None] != ann["labels"][None, :], -1.0)
        if overlaps.shape[1] > 0:
            # amax + argmax rather than max(dim=1), which can be 1000x slower on tiny CPU tensors when
            # several intra-op threads are available. argmax takes the first box on IoU ties, as the
            # devkit's strict ">" does.
            image_best_iou = overlaps.amax(dim=1)
            image_best_box = overlaps.argmax(dim=1)
        else:
            image_best_iou = torch.full_like(det["scores"], -1.0)
            image_best_box = torch.zeros_like(det["labels"])
        scores.append(det["scores"])
        labels.append(det["labels"])
        best_iou.append(image_best_iou)
        best_box.append(image_best_box + num_boxes)
        gt_labels.append(ann["labels"])
        gt_difficult.append(ann["difficult"])
        num_boxes += len(ann["labels"])
    scores, best_iou = _cat(scores, torch.float64), _cat(best_iou, torch.float64)
    labels, best_box, gt_labels = (_cat(t, torch.int64) for t in (labels, best_box, gt_labels))
    gt_difficult = _cat(gt_difficult, torch.bool)

    # Rank by decreasing score (stable), then group by class keeping that rank order within each class.
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[torch.sort(labels[order], stable=True).indices]
    labels, best_iou, best_box = labels[order], best_iou[order], best_box[order]

    hit = best_iou >= iou
    hit_difficult = torch.zeros_like(hit)
    hit_difficult[hit] = gt_difficult[best_box[hit]]
    # A detection hitting a non-difficult box is a TP if it is the best-ranked one to hit that box, and a
    # duplicate (FP) otherwise. Boxes have one class, so only detections of that class compete for them.
    claims = hit & ~hit_difficult
    rank = torch.arange(len(labels))
    first_claim = torch.full((num_boxes,), len(labels)).scatter_reduce(
        0, best_box[claims], rank[claims], reduce="amin"
    )
    tp = torch.zeros_like(hit)
    tp[claims] = first_claim[best_box[claims]] == rank[claims]
    # Detections on difficult boxes are neither TP nor FP: dropping them leaves the devkit's curve
    # (they only repeat the previous precision-recall point).
    counted = ~hit_difficult

    num_detections = torch.bincount(labels, minlength=num_classes)
    num_gt = torch.bincount(gt_labels[~gt_difficult], minlength=num_classes)
    ap, recall = [], []
    per_class = zip(tp.split(num_detections.tolist()), counted.split(num_detections.tolist()), strict=True)
    for c, (class_tp, class_counted) in enumerate(per_class):
        class_tp = class_tp[class_counted]
        if num_gt[c] == 0:
            ap.append(math.nan)
            recall.append(math.nan)
            continue
        tp_cumsum = class_tp.double().cumsum(0)
        fp_cumsum = (~class_tp).double().cumsum(0)
        class_recall = tp_cumsum / num_gt[c].item()
        class_precision = tp_cumsum / (tp_cumsum + fp_cumsum)
        ap.append(average_precision(class_recall, class_precision, metric))
        recall.append(class_recall[-1].item() if len(class_recall) else 0.0)
    return {
        "metric": metric,
        "iou": iou,
        "ap": ap,
        "recall": recall,
        "num_gt": num_gt.tolist(),
        "num_detections": num_detections.tolist(),
        "mAP": _nanmean(ap),
    }


def corloc(detections: _Images, annotations: _Images, num_classes: int, iou: float = 0.5) -> dict[str, Any]:
    """Correct localisation: per (image, class present), is the class's top-scoring detection correct,
    and when it is not, is it on a part of an object?

    A class is present in an image if any of its boxes is annotated there, difficult ones included. Its
    top-scoring detection (the first one on score ties) is correct if its inclusive-pixel IoU with some
    box of that class, difficult ones included, is strictly greater than ``iou``; no detection of the
    class is incorrect. Detections of absent classes are ignored. An incorrect top detection is on a
    part when at least half of its area lies in some box of that class and its area is under half that
    box's (``wsod.data.proposals.parts.part_proposal_mask`` with ``inside=PART_INSIDE``): part domination,
    weakly supervised detection's classic failure, which CorLoc counts without naming.

    Returns a dict of plain Python values, per-class lists indexed by class:

    - ``"corloc"``: correct / images containing the class, per class (NaN if no image contains it)
    - ``"num_images"``: images containing the class; ``"num_correct"``: of those, correctly localised
    - ``"on_part"``: incorrect and on a part / images containing the class (NaN if none);
      ``"num_on_part"``: the count
    - ``"CorLoc"``: mean of ``"corloc"`` over the classes present in some image (NaN if none);
      ``"OnPart"``: the same mean of ``"on_part"`` (the report's ``on a part`` mean)
    """
    num_images = [0] * num_classes
    num_correct = [0] * num_classes
    num_on_part = [0] * num_classes
    for det, ann in _load(detections, annotations, num_classes):
        for c in ann["labels"].unique().tolist():
            num_images[c] += 1
            candidates = (det["labels"] == c).nonzero().squeeze(1)
            if len(candidates) == 0:
                continue
            top = candidates[det["scores"][candidates].argmax()]  # argmax takes the first on ties
            objects = ann["boxes"][ann["labels"] == c]
            correct = inclusive_box_iou(det["boxes"][top, None], objects).max().item() > iou
            num_correct[c] += int(correct)
            on_part = part_proposal_mask(det["boxes"][top, None], objects, inside=PART_INSIDE).any().item()
            num_on_part[c] += int(not correct and on_part)
    per_class = [k / n if n else math.nan for k, n in zip(num_correct, num_images, strict=True)]
    on_part = [k / n if n else math.nan for k, n in zip(num_on_part, num_images, strict=True)]
    return {
        "corloc": per_class,
        "num_images": num_images,
        "num_correct": num_correct,
        "on_part": on_part,
        "num_on_part": num_on_part,
        "CorLoc": _nanmean(per_class),
        "OnPart": _nanmean(on_part),
    }


def format_results(
    results: Mapping[str, Any],
    class_names: Sequence[str],
    corloc_results: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> str:
    """A per-class table of ``evaluate``'s results (and ``corloc``'s, if given: CorLoc and the share of
    images whose top detection of the class is on a part) in percent, the ``notes`` lines, then a line

    ``copypaste: mAP(voc07,iou=0.5)=52.31, CorLoc=60.12, per-class AP: 45.30,60.10,...``

    whose values after "per-class AP:" paste into a spreadsheet row (class order as in the table).
    Undefined values (classes without ground truth) print as "-" in the table and "nan" in that line.
    """
    if len(class_names) != len(results["ap"]):
        raise ValueError(f"{len(class_names)} class names for {len(results['ap'])} classes")
    headers = [f"AP({results['metric']})", "recall"]
    columns = [results["ap"], results["recall"]]
    means = [results["mAP"], _nanmean(results["recall"])]
    summary = f"mAP({results['metric']},iou={results['iou']:g})={_percent(results['mAP'])}"
    if corloc_results is not None:
        headers += ["CorLoc", "on a part"]
        columns += [corloc_results["corloc"], corloc_results["on_part"]]
        means += [corloc_results["CorLoc"], corloc_results["OnPart"]]
        summary += f", CorLoc={_percent(corloc_results['CorLoc'])}"

    name_width = max(len(name) for name in ("class", *class_names))

    def line(name: str, cells: Sequence[str]) -> str:
        return f"{name:<{name_width}}" + "".join(f"{cell:>12}" for cell in cells)

    header = line("class", headers)
    lines = [header, "-" * len(header)]
    for c, name in enumerate(class_names):
        lines.append(line(name, [_percent(values[c], missing="-") for values in columns]))
    lines += ["-" * len(header), line("mean", [_percent(v, missing="-") for v in means]), *notes]
    lines.append(f"copypaste: {summary}, per-class AP: {','.join(_percent(v) for v in results['ap'])}")
    return "\n".join(lines)


def write_voc_results(
    detections: Sequence[Mapping[str, Any]],
    image_ids: Sequence[str],
    class_names: Sequence[str],
    out_dir: str | Path,
    imageset: str = "test",
    prefix: str = "comp4",
) -> list[Path]:
    """Write detections as devkit result files, one per class, and return their paths.

    File ``{out_dir}/{prefix}_det_{imageset}_{class_name}.txt`` (comp4: any training data), one line
    per detection ``image_id score x1 y1 x2 y2`` in the devkit's 1-based pixels, i.e. the 0-based
    inclusive boxes plus 1. Every class gets a file, empty if it has no detection; lines are in image
    order, then detection order.
    """
    if len(image_ids) != len(detections):
        raise ValueError(f"{len(image_ids)} image ids for {len(detections)} images")
    lines: list[list[str]] = [[] for _ in class_names]
    for image_id, det in zip(image_ids, detections, strict=True):
        boxes = to_one_based(_tensor(det["boxes"], torch.float64).numpy()).tolist()
        scores = _tensor(det["scores"], torch.float64).reshape(-1).tolist()
        labels = _tensor(det["labels"], torch.int64).reshape(-1).tolist()
        if not all(0 <= label < len(class_names) for label in labels):
            raise ValueError(f"image {image_id}: labels must be in [0, {len(class_names)})")
        for (x1, y1, x2, y2), score, label in zip(boxes, scores, labels, strict=True):
            # %g rather than a fixed number of decimals keeps tiny scores apart: they still rank.
            lines[label].append(f"{image_id} {score:.6g} {x1:.2f} {y1:.2f} {x2:.2f} {y2:.2f}\n")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, class_lines in zip(class_names, lines, strict=True):
        path = out_dir / f"{prefix}_det_{imageset}_{name}.txt"
        path.write_text("".join(class_lines))
        paths.append(path)
    return paths


def _load(detections: _Images, annotations: _Images, num_classes: int) -> list[tuple[dict, dict]]:
    """Per image (detections, annotations) as CPU tensors: float64 boxes and scores, int64 labels."""
    if len(detections) != len(annotations):
        raise ValueError(f"{len(detections)} images of detections but {len(annotations)} of annotations")
    images = []
    for i, (raw_det, raw_ann) in enumerate(zip(detections, annotations, strict=True)):
        det = {
            "boxes": _tensor(raw_det["boxes"], torch.float64).reshape(-1, 4),
            "scores": _tensor(raw_det["scores"], torch.float64).reshape(-1),
            "labels": _tensor(raw_det["labels"], torch.int64).reshape(-1),
        }
        ann = {
            "boxes": _tensor(raw_ann["boxes"], torch.float64).reshape(-1, 4),
            "labels": _tensor(raw_ann["labels"], torch.int64).reshape(-1),
        }
        difficult = raw_ann.get("difficult")
        ann["difficult"] = (
            torch.zeros(len(ann["labels"]), dtype=torch.bool)
            if difficult is None
            else _tensor(difficult, torch.bool).reshape(-1)
        )
        for kind, item in (("detection", det), ("annotation", ann)):
            if len({len(v) for v in item.values()}) != 1:
                sizes = {k: len(v) for k, v in item.items()}
                raise ValueError(f"image {i}: {kind} fields differ in length {sizes}")
            labels = item["labels"]
            if len(labels) and not 0 <= labels.min() <= labels.max() < num_classes:
                raise ValueError(f"image {i}: {kind} labels must be in [0, {num_classes})")
        images.append((det, ann))
    return images


def _tensor(values: Any, dtype: torch.dtype) -> Tensor:
    return torch.as_tensor(values).detach().to(device="cpu", dtype=dtype)


def _cat(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)


def _nanmean(values: Sequence[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan


def _percent(value: float, missing: str = "nan") -> str:
    return missing if math.isnan(value) else f"{100 * value:.2f}"
