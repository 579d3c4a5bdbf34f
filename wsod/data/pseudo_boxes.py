"""The pseudo ground-truth file: a COCO instances json of the boxes a weakly-supervised model found on
its own training images (written by tools/export_pseudo_labels.py, read by tools/train_stage2.py).

Layout (pycocotools' ``COCO`` loads it, and ``loadRes`` takes results on its images):

    images       [{"id", "file_name", "width", "height", "source_id"}]: ``file_name`` relative to
                 ``info.images_root`` (the training sets' common image folder: ``JPEGImages`` of one VOC
                 year, a COCO image folder, ``<root>/images`` of a folder dataset, or the devkit for
                 VOC 2007 + 2012), so that the json opens against the source images. ``id``: the source
                 json's own id for COCO; for VOC and the toy set the numeric id (``000005`` -> 5, the
                 convention of detectron2's VOC loaders) when every id is numeric and distinct, else the
                 position from 1. ``source_id``: the dataset's own id, as wsod names the image.
    annotations  [{"id", "image_id", "category_id", "bbox": [x, y, w, h], "area", "iscrowd": 0, "score"}]:
                 wsod boxes written as the COCO results of the evaluation are (``x, y, x2 - x1, y2 - y1``;
                 ``wsod.data.box_formats``), so that reading them back gives the same boxes.
    categories   [{"id", "name"}]: the source's COCO ids, else the class index + 1, every class.
    info         {"description", "images_root", "checkpoint", "rule", "classes"}

Reading it back (``read_pseudo_boxes``, ``attach_pseudo_boxes``): images are matched to a dataset's by
``file_name`` under the dataset's own common image folder, whatever absolute path it has on this
machine; each matched record gets the boxes as its ``supervision`` (``boxes`` (G, 4), ``box_labels``
(G,), ``wsod.data.targets``), which the transforms move with the image. Errors name the file and the
entry: categories that are not the dataset's classes, an annotation of an unknown image or category, a
bbox that is not four finite numbers with w, h >= 0, an image whose size differs from the dataset's, a
file matching none of the dataset's images. Dataset images the file does not hold (no labels, or
another split) are dropped from training with one logged count.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsod.atomic import atomic_write
from wsod.data.box_formats import coco_xywh_to_xyxy
from wsod.data.dataset import ImageRecord

__all__ = [
    "images_root",
    "relative_file_names",
    "coco_image_ids",
    "pseudo_boxes_json",
    "write_pseudo_boxes",
    "read_pseudo_boxes",
    "attach_pseudo_boxes",
]

logger = logging.getLogger(__name__)


def images_root(records: Sequence[ImageRecord]) -> str:
    """The deepest folder holding every record's image (``os.path.commonpath`` of their folders)."""
    return os.path.commonpath([os.path.dirname(os.path.abspath(r.path)) for r in records])


def relative_file_names(records: Sequence[ImageRecord]) -> list[str]:
    """Each record's image path relative to ``images_root(records)``, with ``/`` separators."""
    root = images_root(records)
    return [Path(os.path.relpath(os.path.abspath(r.path), root)).as_posix() for r in records]


def coco_image_ids(records: Sequence[ImageRecord]) -> list[int]:
    """Integer image ids for the json (the module docstring): COCO's own, the numeric VOC ids, or 1..N."""
    ids = [r.image_id for r in records]
    if all(isinstance(i, int) and not isinstance(i, bool) for i in ids) and len(set(ids)) == len(ids):
        return list(ids)
    if all(isinstance(i, str) and i.isdigit() for i in ids) and len({int(i) for i in ids}) == len(ids):
        return [int(i) for i in ids]
    return list(range(1, len(ids) + 1))


def pseudo_boxes_json(
    records: Sequence[ImageRecord],
    boxes: Sequence[Mapping[str, torch.Tensor]],
    classes: Sequence[str],
    category_ids: Sequence[int],
    info: Mapping[str, Any],
) -> dict[str, Any]:
    """The json (module docstring) of ``boxes[i]`` (``boxes`` (K, 4) wsod boxes, ``scores``, ``labels``
    in 0..C-1) on ``records[i]``."""
    if len(records) != len(boxes):
        raise ValueError(f"{len(boxes)} sets of pseudo boxes for {len(records)} images")
    ids, names = coco_image_ids(records), relative_file_names(records)
    images, annotations = [], []
    for record, image_id, name, found in zip(records, ids, names, boxes, strict=True):
        images.append(
            {
                "id": image_id,
                "file_name": name,
                "width": int(record.width),
                "height": int(record.height),
                "source_id": record.image_id,
            }
        )
        xyxy = torch.as_tensor(found["boxes"]).double().reshape(-1, 4)
        for box, score, label in zip(
            xyxy.tolist(), found["scores"].tolist(), found["labels"].tolist(), strict=True
        ):
            w, h = box[2] - box[0], box[3] - box[1]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": int(category_ids[label]),
                    "bbox": [box[0], box[1], w, h],
                    "area": w * h,
                    "iscrowd": 0,
                    "score": float(score),
                }
            )
    categories = [{"id": int(i), "name": n} for i, n in zip(category_ids, classes, strict=True)]
    return {
        "info": {**info, "images_root": _shown(images_root(records)), "classes": list(classes)},
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }


def _shown(folder: str) -> str:
    """A folder as the json records it: relative to the working directory when under it (the data
    configs' own relative paths, no machine path in a shared file), else absolute."""
    relative = os.path.relpath(folder)
    return folder if relative.startswith("..") else Path(relative).as_posix()


def write_pseudo_boxes(content: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write the json atomically (a killed export leaves the old file or the new one)."""
    with atomic_write(path, mode="w") as stream:
        json.dump(content, stream)
    return Path(path)


def _fail(path: str | os.PathLike, problem: str) -> ValueError:
    return ValueError(f"pseudo boxes file {path}: {problem}")


def read_pseudo_boxes(
    path: str | os.PathLike, classes: Sequence[str]
) -> dict[str, tuple[tuple[int, int], np.ndarray, np.ndarray]]:
    """``file_name -> ((height, width), boxes (G, 4) float32 wsod boxes, labels (G,) int64)`` of a pseudo
    boxes json, checked (module docstring); categories are matched to ``classes`` by name."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"pseudo boxes file not found: {path} (write it with tools/export_pseudo_labels.py)"
        )
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise _fail(path, f"not valid json ({error})") from error
    if not isinstance(content, dict) or not all(
        isinstance(content.get(k), list) for k in ("images", "annotations", "categories")
    ):
        raise _fail(path, "expected a COCO instances json with lists images, annotations and categories")
    names = {c.get("id"): c.get("name") for c in content["categories"]}
    unknown = sorted(str(n) for n in names.values() if n not in classes)
    if unknown or len(names) != len(content["categories"]):
        raise _fail(path, f"categories {unknown} are not among the dataset's classes {list(classes)}")
    label_of = {cid: classes.index(name) for cid, name in names.items()}
    images: dict[Any, dict] = {}
    for entry in content["images"]:
        if not isinstance(entry, dict) or not {"id", "file_name", "width", "height"} <= set(entry):
            raise _fail(path, f"image entry {entry!r} lacks id, file_name, width or height")
        images[entry["id"]] = {
            "size": (int(entry["height"]), int(entry["width"])),
            "file_name": entry["file_name"],
            "boxes": [],
            "labels": [],
        }
    for entry in content["annotations"]:
        if not isinstance(entry, dict):
            raise _fail(path, f"annotation {entry!r} is not an object")
        where = f"annotation {entry.get('id')!r}"
        if entry.get("image_id") not in images:
            raise _fail(path, f"{where}: image_id {entry.get('image_id')!r} is none of its images")
        if entry.get("category_id") not in label_of:
            raise _fail(path, f"{where}: category_id {entry.get('category_id')!r} is none of its categories")
        bbox = entry.get("bbox")
        if (
            not isinstance(bbox, list)
            or len(bbox) != 4
            or not all(isinstance(v, int | float) and math.isfinite(v) for v in bbox)
            or bbox[2] < 0
            or bbox[3] < 0
        ):
            raise _fail(path, f"{where}: bbox {bbox!r} is not [x, y, w, h] of finite numbers with w, h >= 0")
        image = images[entry["image_id"]]
        image["boxes"].append(bbox)
        image["labels"].append(label_of[entry["category_id"]])
    result = {}
    for image in images.values():
        boxes = coco_xywh_to_xyxy(np.asarray(image["boxes"], dtype=np.float32).reshape(-1, 4))
        result[image["file_name"]] = (
            image["size"],
            boxes.astype(np.float32),
            np.asarray(image["labels"], dtype=np.int64),
        )
    return result


def attach_pseudo_boxes(
    records: Sequence[ImageRecord], classes: Sequence[str], path: str | os.PathLike
) -> list[ImageRecord]:
    """``records`` that the pseudo boxes file at ``path`` holds, each with its boxes as ``supervision``
    (``boxes``, ``box_labels``); the others are dropped and counted in the log (module docstring)."""
    pseudo = read_pseudo_boxes(path, classes)
    names = relative_file_names(records)
    kept = []
    for record, name in zip(records, names, strict=True):
        if name not in pseudo:
            continue
        size, boxes, labels = pseudo[name]
        if size != (record.height, record.width):
            raise _fail(
                path,
                f"image {name} is {size[0]}x{size[1]} (height x width) there and"
                f" {record.height}x{record.width} in the dataset ({record.path}):"
                " the file was exported from other images",
            )
        kept.append(replace(record, supervision={"boxes": boxes, "box_labels": labels}))
    if not kept:
        example = next(iter(pseudo), None)
        raise _fail(
            path,
            f"none of its {len(pseudo)} images (e.g. {example}) is one of the dataset's {len(records)} (e.g."
            f" {names[0]}, relative to {images_root(records)}): export it from this data config",
        )
    if len(kept) < len(records):
        logger.warning(
            "%d of %d training images have no pseudo boxes in %s (no image label, or not exported): left out",
            len(records) - len(kept), len(records), path,
        )  # fmt: skip
    return kept
