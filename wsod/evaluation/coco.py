"""COCO box evaluation through pycocotools: detections -> results json -> COCOeval's 12 summary numbers.

Detections are per-image dicts ``{"boxes": (D, 4) float xyxy, "scores": (D,), "labels": (D,) int64}``
with continuous pixel corners (x2 = x + w, no +1) and labels indexing the contiguous classes
0..C-1; ``category_ids[label]`` is the COCO category id of a label.

The ground truth is the json as training's loader reads it (``wsod.data.coco.normalise_coco``: the
optional annotation ``id``, ``iscrowd`` and ``area`` filled in), never the raw file: pycocotools indexes
those fields and fails on a file that trains. Errors name the annotation file, pycocotools' own too.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torchvision.ops import box_convert

from wsod.data.coco import coco_index, normalise_coco, read_coco_json
from wsod.data.json_files import read_json

__all__ = [
    "STAT_NAMES",
    "evaluate_coco",
    "format_coco_stats",
    "format_percent",
    "load_coco",
    "save_coco_results",
    "to_coco_results",
    "to_named_results",
]

# The order of COCOeval.stats after summarize() for iouType "bbox".
STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def to_coco_results(
    detections: Sequence[Mapping[str, Any]], image_ids: Sequence[int], category_ids: Sequence[int]
) -> list[dict[str, Any]]:
    """COCO results list: one ``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}`` per detection.

    ``image_ids[i]`` is the COCO image id of ``detections[i]``. Values are plain Python numbers, so the
    list can be written with ``json.dump`` as is. Order: image order, then detection order.
    """
    if len(image_ids) != len(detections):
        raise ValueError(f"{len(image_ids)} image ids for {len(detections)} images")
    results = []
    for image_id, det in zip(image_ids, detections, strict=True):
        boxes = torch.as_tensor(det["boxes"]).detach().cpu().double().reshape(-1, 4)
        boxes = box_convert(boxes, in_fmt="xyxy", out_fmt="xywh")
        scores = torch.as_tensor(det["scores"]).detach().cpu().double().reshape(-1).tolist()
        labels = torch.as_tensor(det["labels"]).detach().cpu().reshape(-1).tolist()
        for box, score, label in zip(boxes.tolist(), scores, labels, strict=True):
            if not 0 <= label < len(category_ids):
                raise ValueError(f"image {image_id}: label {label} outside [0, {len(category_ids)})")
            results.append(
                {"image_id": image_id, "category_id": category_ids[label], "bbox": box, "score": score}
            )
    return results


def to_named_results(
    detections: Sequence[Mapping[str, Any]], file_names: Sequence[str], class_names: Sequence[str]
) -> list[dict[str, Any]]:
    """The results of images known by file name (tools/predict.py's ``predictions.json``): COCO results
    entries ``{"image_id", "file_name", "category_id", "category_name", "bbox": [x, y, w, h], "score"}``.

    Image ids are assigned in sorted file-name order from 1 (pycocotools' ``loadRes`` needs integer ids;
    map them to another json's ids through ``file_name``); entries come in that order. Category ids are
    the class index + 1 (COCO's ids start at 1), ``category_name`` the class name.
    """
    if len(file_names) != len(detections):
        raise ValueError(f"{len(file_names)} file names for {len(detections)} images")
    if len(set(file_names)) != len(file_names):
        raise ValueError("file names must be distinct: they identify the images")
    order = sorted(range(len(file_names)), key=lambda i: file_names[i])
    results = []
    for image_id, i in enumerate(order, start=1):
        for entry in to_coco_results([detections[i]], [image_id], range(1, len(class_names) + 1)):
            results.append(
                {
                    "image_id": image_id,
                    "file_name": file_names[i],
                    "category_id": entry["category_id"],
                    "category_name": class_names[entry["category_id"] - 1],
                    "bbox": entry["bbox"],
                    "score": entry["score"],
                }
            )
    return results


def save_coco_results(results: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write a COCO results list as json (the format of the COCO evaluation server); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(results)))
    return path


def load_coco(
    ground_truth: COCO | str | os.PathLike | Mapping[str, Any], source: str | os.PathLike | None = None
) -> COCO:
    """A COCO ground-truth object from a COCO object (used as is), an instances json path or its loaded
    dict, the latter two normalised as the loader does (``wsod.data.coco.normalise_coco``: missing
    annotation ``id``, ``iscrowd`` and ``area`` filled in, bad entries named). A dict is left as given:
    its annotations are copied (one level) before the defaults go in. ``source`` names a dict in errors.
    """
    if isinstance(ground_truth, COCO):
        return ground_truth
    if isinstance(ground_truth, Mapping):
        data = dict(ground_truth)
        if isinstance(data.get("annotations"), list):
            data["annotations"] = [dict(a) if isinstance(a, Mapping) else a for a in data["annotations"]]
        return coco_index(normalise_coco(data, source or "the ground-truth dict"))
    return read_coco_json(ground_truth)


def evaluate_coco(
    results: Sequence[Mapping[str, Any]] | str | os.PathLike,
    ground_truth: COCO | str | os.PathLike | Mapping[str, Any],
    image_ids: Sequence[int] | None = None,
    *,
    source: str | os.PathLike | None = None,
) -> dict[str, float]:
    """COCOeval (bbox) of a results list (or results json path) -> ``{name: value}`` for ``STAT_NAMES``.

    Values are COCOeval's, in [0, 1], and -1 where undefined (e.g. APs without small objects).
    ``image_ids`` restricts evaluation to those images (pass all predicted images, including those
    without detections, when predicting on part of a split); by default every ground-truth image counts.
    With no detections at all, every defined AP and AR is 0: pycocotools' ``loadRes`` rejects an empty
    list, so an empty results object is built instead and COCOeval runs as usual.

    ``ground_truth`` as ``load_coco`` takes it: a path or dict is normalised as training's loader does,
    so a file that trains evaluates; a COCO object is used as is (not copied: COCOeval writes its
    ``ignore`` flags into the annotations, harmlessly). ``source``: the annotation file, named in errors
    (a path names itself). Errors, each a ``ValueError`` naming it: annotations without boxes (labels
    only), results naming an image the ground truth lacks, and whatever pycocotools raises.
    """
    results_file = None
    if isinstance(results, (str, os.PathLike)):
        results_file = results
        results = read_json(results, "a COCO results json, a list of {image_id, category_id, bbox, score}")
    if source is None and isinstance(ground_truth, (str, os.PathLike)):
        source = ground_truth
    annotation_file = "the ground truth" if source is None else os.fspath(source)
    coco_gt = load_coco(ground_truth, source)
    annotations = coco_gt.dataset.get("annotations", [])
    if annotations and "bbox" not in annotations[0]:
        raise ValueError(
            f"{annotation_file}: its annotations have no 'bbox' (image-level labels only): there are no"
            " boxes to evaluate detections against"
        )
    strays = {r.get("image_id") for r in results} - set(coco_gt.imgs)  # pycocotools: a bare assertion
    if strays:
        raise ValueError(
            f"{annotation_file} has no image {sorted(strays, key=repr)[0]!r} that the results name"
            f" ({len(strays)} such image ids{'' if results_file is None else f' in {results_file}'}):"
            " evaluate results against the annotation file they were predicted for"
        )
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress and its summary
            # loadRes writes "id", "area" and "iscrowd" into the dicts it gets: hand it copies.
            coco_dt = coco_gt.loadRes([dict(r) for r in results]) if results else _empty_results(coco_gt)
            evaluator = COCOeval(coco_gt, coco_dt, iouType="bbox")
            if image_ids is not None:
                evaluator.params.imgIds = sorted(image_ids)
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
    except (AssertionError, AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        where = "" if results_file is None else f" (results {results_file})"
        raise ValueError(
            f"COCO evaluation against {annotation_file} failed{where}: {type(e).__name__}: {e}"
        ) from e
    return {name: float(value) for name, value in zip(STAT_NAMES, evaluator.stats, strict=True)}


def format_coco_stats(stats: Mapping[str, float]) -> str:
    """The 12 numbers in percent as a header, a row, and a ``copypaste:`` line of comma-separated values.

    Undefined values (-1) print as "-" in the row and "nan" in the copypaste line.
    """
    names = [name for name in STAT_NAMES if name in stats]
    values = [stats[name] for name in names]
    header = "".join(f"{name:>8}" for name in names)
    row = "".join(f"{format_percent(v, missing='-'):>8}" for v in values)
    copypaste = ",".join(format_percent(v) for v in values)
    return "\n".join([header, row, f"copypaste: COCO bbox {','.join(names)}: {copypaste}"])


def _empty_results(coco_gt: COCO) -> COCO:
    """What ``loadRes`` would return for an empty results list, had it accepted one."""
    coco_dt = COCO()
    coco_dt.dataset = {
        "images": list(coco_gt.dataset["images"]),
        "categories": copy.deepcopy(coco_gt.dataset["categories"]),
        "annotations": [],
    }
    coco_dt.createIndex()
    return coco_dt


def format_percent(value: float, missing: str = "nan") -> str:
    """A value in [0, 1] as a percent with 2 decimals; ``missing`` for an undefined one (COCOeval's -1,
    or NaN): "-" in tables and report lines, "nan" in ``copypaste:`` lines."""
    return missing if value < 0 or math.isnan(value) else f"{100 * value:.2f}"
