"""Partial labels: a point, a scribble or a box on some objects, beside the image-level labels.

One object's partial label is a ``PartialLabel``: its class and one of three kinds, in pixels of the
image on disk (the proposals' 0-based coordinates, ``wsod.data.box_formats``):

    point      (x, y): a click on the object
    scribble   a path on the object, its points (S, 2) x y in drawing order (S >= 1)
    box        x1 y1 x2 y2 with x2 > x1, y2 > y1: a supervising box (not only for evaluation)

Where they come from:

- COCO json, per annotation (the reference code's field names, NVlabs/wetectron
  ``data/datasets/coco.py``): ``point: [x, y]``, ``scribble: [[x, ...], [y, ...]]`` and ``use_as``,
  one of ``tag`` (image label only), ``point``, ``scribble`` or ``box`` (the annotation's ``bbox``
  supervises). Without ``use_as`` an annotation supervises with every partial field it carries (a point
  and a scribble of one object both count) and its ``bbox`` is for evaluation only.
- VOC, the folder format and the toy set (and COCO too): a side file named by the train set's
  ``partial_labels`` key (``configs/data/*.yaml``), json keyed by image id (``data/README.md``)::

      {"images": {"000005": [{"class": "chair", "point": [x, y]},
                             {"class": "chair", "scribble": [[x, ...], [y, ...]]},
                             {"class": "person", "box": [x1, y1, x2, y2]}]}}

  Image ids of the file that the set does not hold are skipped with one logged count (a trainval file
  serves the train split too); a file that shares no id with the set, labels no object at all, or
  labels none of the set's images is an error (training would silently run on image labels alone).

``supervision_of`` turns an image's partial labels into the targets fields of ``wsod.data.targets``
(``points`` / ``point_labels``, ``scribble_points`` / ``scribble_labels`` / ``scribble_ids``, ``boxes`` /
``box_labels``), which the transforms move with the image and the methods read
(``wsod.modeling.partial_labels``). An image without partial labels has no such fields and trains
exactly as with image labels alone.

Errors name the file and the annotation (``where``): a file that is not json (``wsod.data.json_files``);
an unknown class, or one that is not a string; a class that is not among the image's labels (it would
teach a class the image-level loss calls absent); a point outside the image; a scribble with no point,
with x and y lists of different lengths, or leaving the image; a box with x2 <= x1 or y2 <= y1 (x y w h
read as x1 y1 x2 y2 looks like that) or outside the image; an object with none or two of point, scribble
and box in a side file.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from wsod.atomic import atomic_write
from wsod.data.json_files import read_json, require_keys

__all__ = [
    "KINDS",
    "PartialLabel",
    "parse_partial_label",
    "partial_labels_of_coco_annotation",
    "supervision_of",
    "read_partial_labels_file",
    "write_partial_labels_file",
    "attach_partial_labels",
    "count_partial_labels",
]

logger = logging.getLogger(__name__)

# What a side file is, for the errors about one that is not.
_EXPECTED = (
    'a partial labels side file, {"images": {image id: [{"class": name, "point" | "scribble" | "box":'
    " ...}, ...]}}"
)

Kind = Literal["point", "scribble", "box"]
KINDS: tuple[Kind, ...] = ("point", "scribble", "box")
# The COCO ``use_as`` values (the reference's): ``tag`` is an image label only.
USE_AS = ("tag", *KINDS)


@dataclass(frozen=True)
class PartialLabel:
    """One object's partial label: ``label`` its class index, ``kind``, and ``geometry`` float32 in
    pixels of the image on disk: (2,) x y for a point, (S, 2) for a scribble, (4,) x1 y1 x2 y2 for a box."""

    label: int
    kind: Kind
    geometry: np.ndarray


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _numbers(value: Any, count: int | None = None) -> bool:
    return (
        isinstance(value, (list, tuple))
        and (count is None or len(value) == count)
        and all(_is_number(v) for v in value)
    )


def parse_partial_label(
    kind: str, value: Any, label: int, image_size: tuple[int, int], where: str
) -> PartialLabel:
    """``value`` as given in a file (a point ``[x, y]``, a scribble ``[[x, ...], [y, ...]]``, a box
    ``[x1, y1, x2, y2]``) -> a checked ``PartialLabel``; ``ValueError`` naming ``where`` otherwise.
    ``image_size`` (H, W) on disk: coordinates must lie in [0, W] x [0, H]."""
    height, width = image_size
    if kind == "point":
        if not _numbers(value, 2):
            raise ValueError(f"{where}: point {value!r} is not [x, y], two finite numbers")
        geometry = np.asarray(value, dtype=np.float32)
        xs, ys = geometry[0:1], geometry[1:2]
    elif kind == "scribble":
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_numbers(v) for v in value)):
            raise ValueError(f"{where}: scribble is not [[x, ...], [y, ...]], two lists of finite numbers")
        if len(value[0]) != len(value[1]):
            raise ValueError(
                f"{where}: scribble has {len(value[0])} x and {len(value[1])} y coordinates;"
                " one of each per point"
            )
        if not value[0]:
            raise ValueError(f"{where}: scribble has no point; drop the field or give the path's points")
        geometry = np.stack([np.asarray(value[0], np.float32), np.asarray(value[1], np.float32)], axis=1)
        xs, ys = geometry[:, 0], geometry[:, 1]
    elif kind == "box":
        if not _numbers(value, 4):
            raise ValueError(f"{where}: box {value!r} is not [x1, y1, x2, y2], four finite numbers")
        geometry = np.asarray(value, dtype=np.float32)
        if geometry[2] <= geometry[0] or geometry[3] <= geometry[1]:
            raise ValueError(
                f"{where}: box {value!r} has x2 <= x1 or y2 <= y1; boxes are x1 y1 x2 y2 in pixels"
                " (a COCO bbox x y w h is converted for you with use_as: box)"
            )
        xs, ys = geometry[0::2], geometry[1::2]
    else:
        raise ValueError(f"{where}: unknown partial label kind {kind!r}; expected one of {', '.join(KINDS)}")
    if xs.min() < 0 or ys.min() < 0 or xs.max() > width or ys.max() > height:
        raise ValueError(
            f"{where}: {kind} reaches outside the {height}x{width} (HxW) image (x in"
            f" [{xs.min():g}, {xs.max():g}], y in [{ys.min():g}, {ys.max():g}]); coordinates are pixels"
            " of the image on disk"
        )
    return PartialLabel(int(label), kind, geometry)  # type: ignore[arg-type]


def partial_labels_of_coco_annotation(
    annotation: Mapping[str, Any],
    label: int,
    bbox_xyxy: np.ndarray | None,
    image_size: tuple[int, int],
    where: str,
) -> list[PartialLabel]:
    """The partial labels of one COCO annotation (module docstring: ``point``, ``scribble``,
    ``use_as``); ``bbox_xyxy`` (4,) its bbox in the dataset's xyxy convention, when it has one."""
    use_as = annotation.get("use_as")
    if use_as is not None and use_as not in USE_AS:
        raise ValueError(f"{where}: use_as is {use_as!r}; expected one of {', '.join(USE_AS)}")
    if use_as == "tag":
        return []
    if use_as == "box":
        if bbox_xyxy is None:
            raise ValueError(f"{where}: use_as is 'box' but the annotation has no bbox")
        return [parse_partial_label("box", [float(v) for v in bbox_xyxy], label, image_size, where)]
    kinds = [use_as] if use_as is not None else [k for k in ("point", "scribble") if k in annotation]
    labels = []
    for kind in kinds:
        if kind not in annotation:
            raise ValueError(f"{where}: use_as is {kind!r} but the annotation has no {kind!r} field")
        labels.append(parse_partial_label(kind, annotation[kind], label, image_size, where))
    return labels


def supervision_of(
    partial: Sequence[PartialLabel], image_labels: np.ndarray, classes: Sequence[str], where: str
) -> dict[str, np.ndarray] | None:
    """An image's partial labels as targets fields (``wsod.data.targets``), only the kinds it has; None
    when it has none. ``image_labels`` (C,) multi-hot: a partial label of another class is an error
    naming ``where`` (the image and its file) and the class."""
    if not partial:
        return None
    for i, item in enumerate(partial):
        if not 0 <= item.label < len(image_labels) or not image_labels[item.label]:
            name = classes[item.label] if 0 <= item.label < len(classes) else item.label
            present = [classes[c] for c in np.flatnonzero(image_labels)]
            raise ValueError(
                f"{where}: partial label {i} ({item.kind}) is of class {name!r}, which is not among the"
                f" image's labels {present}; a partial label marks an object of a labelled class"
            )
    fields: dict[str, np.ndarray] = {}
    points = [p for p in partial if p.kind == "point"]
    if points:
        fields["points"] = np.stack([p.geometry for p in points]).astype(np.float32)
        fields["point_labels"] = np.array([p.label for p in points], dtype=np.int64)
    scribbles = [p for p in partial if p.kind == "scribble"]
    if scribbles:
        fields["scribble_points"] = np.concatenate([p.geometry for p in scribbles]).astype(np.float32)
        fields["scribble_labels"] = np.concatenate(
            [np.full(len(p.geometry), p.label, np.int64) for p in scribbles]
        )
        fields["scribble_ids"] = np.concatenate(
            [np.full(len(p.geometry), i, np.int64) for i, p in enumerate(scribbles)]
        )
    boxes = [p for p in partial if p.kind == "box"]
    if boxes:
        fields["boxes"] = np.stack([p.geometry for p in boxes]).astype(np.float32)
        fields["box_labels"] = np.array([p.label for p in boxes], dtype=np.int64)
    return fields


def read_partial_labels_file(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """A side file's ``images`` mapping, image id (a string) -> its objects, checked for layout only
    (``attach_partial_labels`` checks each object against its image)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"partial labels file not found: {path}")
    data = read_json(path, _EXPECTED)
    require_keys(data, path, {"images": dict}, _EXPECTED)
    images = data["images"]
    for image_id, objects in images.items():
        if not isinstance(objects, list):
            raise ValueError(f"{path}: images[{image_id!r}] is not a list of objects")
    if not any(images.values()):
        # A fraction that rounds to no image, or a file of another kind: training would run on image
        # labels alone while the command says partial labels.
        raise ValueError(
            f"{path}: labels no object ({len(images)} images, none with a point, scribble or box); give a"
            " file that does (tools/make_partial_labels.py with a larger fraction), or drop the train"
            " set's partial_labels"
        )
    return images


def write_partial_labels_file(
    path: str | os.PathLike, images: Mapping[str, Sequence[Mapping[str, Any]]]
) -> None:
    """Write a side file (the module docstring's layout) atomically."""
    with atomic_write(path, "w") as f:
        json.dump({"images": images}, f, separators=(",", ":"))
        f.write("\n")


def attach_partial_labels(
    records: Sequence[Any], classes: Sequence[str], path: str | os.PathLike
) -> list[Any]:
    """``records`` (``wsod.data.dataset.ImageRecord``) with the partial labels of side file ``path``
    as their ``supervision``; records the file does not name are returned unchanged."""
    images = read_partial_labels_file(path)
    class_index = {name: i for i, name in enumerate(classes)}
    by_id: dict[str, int] = {str(r.image_id): i for i, r in enumerate(records)}
    unknown = [image_id for image_id in images if image_id not in by_id]
    if images and len(unknown) == len(images):
        raise ValueError(
            f"{path}: none of its {len(images)} image ids is in this dataset (the first is {unknown[0]!r});"
            " is it the file of another dataset?"
        )
    if unknown:
        logger.warning(
            "%s: %d of %d image ids are not in this dataset: skipped", path, len(unknown), len(images)
        )
    out = list(records)
    attached = 0
    for image_id, objects in images.items():
        if image_id not in by_id:
            continue
        record = out[by_id[image_id]]
        where = f"{path}: image {image_id!r} ({record.path})"
        partial = []
        for j, obj in enumerate(objects):
            at = f"{where}, object {j}"
            if not isinstance(obj, dict):
                raise ValueError(f"{at}: not a json object")
            name = obj.get("class")
            if not isinstance(name, str):  # a list would not even be looked up (unhashable)
                raise ValueError(
                    f"{at}: class is {name!r}; expected one class name, a string, e.g. {classes[0]!r}"
                )
            if name not in class_index:
                raise ValueError(f"{at}: class {name!r} is not one of the dataset's classes {list(classes)}")
            kinds = [k for k in KINDS if k in obj]
            if len(kinds) != 1:
                raise ValueError(f"{at}: give exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
            partial.append(
                parse_partial_label(
                    kinds[0], obj[kinds[0]], class_index[name], (record.height, record.width), at
                )
            )
        supervision = supervision_of(partial, record.labels, classes, where)
        if supervision is None:
            continue
        if record.supervision:
            raise ValueError(
                f"{where}: has supervision from its annotation file already ({sorted(record.supervision)});"
                " give partial labels in one place: the annotations or the side file"
            )
        out[by_id[image_id]] = replace(record, supervision=supervision)
        attached += 1
    if not attached:  # e.g. a trainval file whose few labelled images are all in the other split
        labelled = sum(1 for objects in images.values() if objects)
        raise ValueError(
            f"{path}: labels none of this set's {len(records)} images (the images it labels, {labelled},"
            " are all outside the set); give the set a file that labels some of its images, or drop its"
            " partial_labels"
        )
    return out


def count_partial_labels(records: Sequence[Any]) -> dict[str, int]:
    """Objects per kind and images with any partial label, over ``records`` (for the training log)."""
    counts = {"images": 0, "point": 0, "scribble": 0, "box": 0}
    for record in records:
        supervision: Mapping[str, Any] | None = record.supervision
        if not supervision:
            continue
        counts["images"] += 1
        counts["point"] += len(supervision.get("point_labels", ()))
        counts["scribble"] += len(set(np.asarray(supervision.get("scribble_ids", ())).tolist()))
        counts["box"] += len(supervision.get("box_labels", ()))
    return counts
