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
entry: a file that is not json (a checkpoint given by mistake; ``wsod.data.json_files``) or lacks one of
the three lists; no image or no annotation at all (training would see only background); categories that
are not the dataset's classes; two image entries with one id or one file name (naming both: the second
would take the first's boxes or leave it none); a size that is not a whole number of pixels; an
annotation of an unknown image or category; a bbox that is not four finite numbers with w, h >= 0; an
image whose size differs from the dataset's; a file matching none of the dataset's images. Dataset
images the file does not hold (no labels, or another split) are dropped from training with one logged
count.
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
from wsod.data.json_files import read_json, require_keys, whole_number

__all__ = [
    "images_root",
    "relative_file_names",
    "coco_image_ids",
    "pseudo_boxes_json",
    "write_pseudo_boxes",
    "read_pseudo_boxes",
    "check_pseudo_boxes_file",
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


# What a pseudo boxes file is, for the errors about one that is not.
_EXPECTED = (
    "a COCO instances json of tools/export_pseudo_labels.py (pseudo_labels/pseudo_labels.json in the"
    " run folder) with images, annotations and categories lists"
)


def _fail(path: str | os.PathLike, problem: str) -> ValueError:
    return ValueError(f"pseudo boxes file {path}: {problem}")


def _is_id(value: Any) -> bool:
    """A json id the reader can look up: an integer or a string (a list or an object is no id)."""
    return isinstance(value, int | str) and not isinstance(value, bool)


def _read_categories(path: Path, categories: list[Any], classes: Sequence[str]) -> dict[Any, int]:
    """category id -> class index, each category an object ``{"id", "name"}`` naming a dataset class."""
    label_of: dict[Any, int] = {}
    first: dict[Any, int] = {}  # category id -> index of the entry that gives it
    unknown = []
    for i, category in enumerate(categories):
        if not isinstance(category, dict) or not _is_id(category.get("id")):
            raise _fail(path, f'categories[{i}] is {category!r}; expected {{"id": integer, "name": string}}')
        if category["id"] in first:
            raise _fail(
                path,
                f"categories[{i}] has id {category['id']!r}, as categories[{first[category['id']]}] does:"
                " category ids must be unique",
            )
        first[category["id"]] = i
        name = category.get("name")
        if not isinstance(name, str) or name not in classes:
            unknown.append(str(name))
            continue
        label_of[category["id"]] = classes.index(name)
    if unknown:
        raise _fail(path, f"categories {sorted(unknown)} are not among the dataset's classes {list(classes)}")
    return label_of


def _read_images(path: Path, entries: list[Any]) -> dict[Any, dict[str, Any]]:
    """image id -> its size, file name and (empty) box lists; an id or a file name given twice is an
    error naming both entries (the second would silently take the first's boxes, or leave it none)."""
    images: dict[Any, dict[str, Any]] = {}
    by_name: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not {"id", "file_name", "width", "height"} <= set(entry):
            raise _fail(path, f"images[{i}] {entry!r} lacks id, file_name, width or height")
        image_id, name = entry["id"], entry["file_name"]
        where = f"images[{i}] (id {image_id!r}, file_name {name!r})"
        if not _is_id(image_id):
            raise _fail(path, f"{where}: the id is neither an integer nor a string")
        if not isinstance(name, str) or not name:
            raise _fail(path, f"{where}: file_name is not the image's path under info.images_root")
        size = [whole_number(entry[key]) for key in ("height", "width")]
        for key, pixels in zip(("height", "width"), size, strict=True):
            if pixels is None or pixels < 1:
                raise _fail(path, f"{where}: {key} is {entry[key]!r}; expected a whole number of pixels >= 1")
        if image_id in images:
            first = images[image_id]
            raise _fail(
                path,
                f"{where} has the id of images[{first['index']}] (file_name {first['file_name']!r}):"
                " image ids must be unique (annotations name their image by id); export the file again",
            )
        if name in by_name:
            first = by_name[name]
            raise _fail(
                path,
                f"{where} has the file_name of images[{first['index']}] (id {first['id']!r}): one entry per"
                " image (the second would replace the first's boxes); export the file again",
            )
        by_name[name] = images[image_id] = {
            "id": image_id,
            "index": i,
            "size": (size[0], size[1]),
            "file_name": name,
            "boxes": [],
            "labels": [],
        }
    return images


def _checked_layout(path: Path) -> dict[str, Any]:
    """The parsed json of ``path`` if it is a pseudo boxes file's layout: non-empty ``images``,
    ``annotations`` and ``categories`` lists; else one error naming the file."""
    if not path.is_file():
        raise FileNotFoundError(
            f"pseudo boxes file not found: {path} (write it with tools/export_pseudo_labels.py)"
        )
    content = read_json(path, _EXPECTED)
    lists = {"images": list, "annotations": list, "categories": list}
    require_keys(content, f"pseudo boxes file {path}", lists, _EXPECTED)
    for key in lists:
        if not content[key]:
            # No annotation: every image would train as background alone, and the run would end with a
            # detector of nothing, silently (an export whose score threshold kept no box, say).
            raise _fail(path, f"'{key}' is empty: there is nothing to train on; expected {_EXPECTED}")
    return content


def check_pseudo_boxes_file(path: str | os.PathLike) -> None:
    """What can be checked of a pseudo boxes file without the dataset: its layout, and one entry per
    image id and file name. tools/train_stage2.py calls it before it makes its run folder, so that a
    wrong file is refused before anything is written; ``read_pseudo_boxes`` checks the rest."""
    path = Path(path)
    _read_images(path, _checked_layout(path)["images"])


def read_pseudo_boxes(
    path: str | os.PathLike, classes: Sequence[str]
) -> dict[str, tuple[tuple[int, int], np.ndarray, np.ndarray]]:
    """``file_name -> ((height, width), boxes (G, 4) float32 wsod boxes, labels (G,) int64)`` of a pseudo
    boxes json, checked (module docstring); categories are matched to ``classes`` by name."""
    path = Path(path)
    content = _checked_layout(path)
    label_of = _read_categories(path, content["categories"], classes)
    images = _read_images(path, content["images"])
    for entry in content["annotations"]:
        if not isinstance(entry, dict):
            raise _fail(path, f"annotation {entry!r} is not an object")
        where = f"annotation {entry.get('id')!r}"
        image_id, category_id = entry.get("image_id"), entry.get("category_id")
        if not _is_id(image_id) or image_id not in images:
            raise _fail(path, f"{where}: image_id {image_id!r} is none of its images")
        if not _is_id(category_id) or category_id not in label_of:
            raise _fail(path, f"{where}: category_id {category_id!r} is none of its categories")
        bbox = entry.get("bbox")
        if (
            not isinstance(bbox, list)
            or len(bbox) != 4
            or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in bbox
            )
            or bbox[2] < 0
            or bbox[3] < 0
        ):
            raise _fail(path, f"{where}: bbox {bbox!r} is not [x, y, w, h] of finite numbers with w, h >= 0")
        image = images[image_id]
        image["boxes"].append(bbox)
        image["labels"].append(label_of[category_id])
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
