"""COCO-format json: instances files (with boxes) and the same format with image-level labels only.

Accepted json (the COCO instances format; fields marked * are optional)::

    {"images":      [{"id": int | str, "file_name": str, "width"*: int, "height"*: int}, ...],
     "categories":  [{"id": int, "name": str}, ...],
     "annotations": [{"image_id": ..., "category_id": int, "bbox"*: [x, y, w, h], "iscrowd"*: 0 | 1,
                      "id"*: int, "area"*: float}, ...]}

Label-only data (custom images with image-level labels) uses the same file with annotations that have
no ``bbox``: one annotation per (image, class present) is enough. Either every annotation has a ``bbox``
(the dataset then has ground truth for evaluation) or none has; a mix is an error. Sizes missing from
``images`` are read from the image file headers; a stated size is a whole number of pixels (``640``,
``640.0`` or ``"640"``), anything else an error naming the entry. ``file_name`` is relative to
``image_root``. A file that is not json at all (a checkpoint given by mistake) is one error line naming
it (``wsod.data.json_files``).

One normalisation (``normalise_coco``) serves training and evaluation alike: the optional annotation
fields pycocotools indexes get their defaults (``id`` i + 1, ``iscrowd`` 0, ``area`` the box's w * h; a
given ``area``, COCO's segmentation area, is kept for the small/medium/large split), so a file that
trains also evaluates (``CocoDataset.coco``; ``wsod.evaluation.coco.evaluate_coco`` for a path).

Classes: contiguous indices 0..C-1 in sorted category-id order over the file's ``categories`` (COCO's 80
ids 1..90 -> 0..79). ``CocoDataset.category_ids[i]`` is the category id of class ``i`` and
``category_index[id]`` the class of a category id, for writing results pycocotools can evaluate.

Crowd annotations (``iscrowd`` = 1) are neither labels nor ground-truth boxes. Boxes: COCO ``xywh`` ->
``(x, y, x + w, y + h)``. A bad entry raises ``ValueError`` naming the file and the entry (e.g.
``images[3] has no 'id'``; the cases: ``normalise_coco``): a missing required field, a category or image
id the file lacks, a ``bbox`` that is not 4 numbers, a duplicate id. Images without labels are kept, or
dropped with a logged count by ``drop_unlabelled`` (docs/METHOD.md §9: training drops them).

Partial labels (``wsod.data.partial_labels``): an annotation may carry ``point: [x, y]``, ``scribble:
[[x, ...], [y, ...]]`` and ``use_as`` (``tag``, ``point``, ``scribble`` or ``box``: its ``bbox``
supervises); they become the image record's ``supervision``, checked and named by annotation id.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import numbers
import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
from pycocotools.coco import COCO

from wsod.data.box_formats import coco_xywh_to_xyxy
from wsod.data.dataset import ImageRecord, WeakDetectionDataset, image_size_from_header
from wsod.data.json_files import read_json, whole_number
from wsod.data.partial_labels import partial_labels_of_coco_annotation, supervision_of
from wsod.data.proposals import ProposalSet

# What a COCO annotation file is, for the errors about one that is not.
_EXPECTED = "a COCO json with non-empty 'images' and 'categories' lists and an 'annotations' list"
# Annotation fields that make partial labels (wsod.data.partial_labels).
_PARTIAL_FIELDS = frozenset({"point", "scribble", "use_as"})

__all__ = ["CocoDataset", "coco_index", "load_coco_records", "normalise_coco", "read_coco_json"]

logger = logging.getLogger(__name__)


def read_coco_json(path: str | os.PathLike) -> COCO:
    """Read a COCO-format json, check and normalise it (``normalise_coco``) into a pycocotools ``COCO``
    index: the ground truth both training's records and the COCO evaluation are built from."""
    if not Path(path).exists():
        raise FileNotFoundError(f"annotation file not found: {path}")
    return coco_index(normalise_coco(read_json(path, _EXPECTED), path))


def coco_index(data: dict[str, Any]) -> COCO:
    """A pycocotools ``COCO`` over an already normalised json dict (no copy), without its chatter."""
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
        coco.createIndex()
    return coco


def normalise_coco(data: Any, source: str | os.PathLike) -> dict[str, Any]:
    """Check a loaded COCO-format json and fill in, in place, the optional fields pycocotools reads.

    Every annotation gets the fields ``COCO.createIndex`` and ``COCOeval`` index: ``id`` (i + 1 for
    ``annotations[i]`` when absent), ``iscrowd`` (0) and, with a ``bbox``, ``area`` (the box's w * h
    when absent). COCO's own ``area`` is the segmentation's, smaller than the box's: when given it is
    kept, and it decides the small/medium/large split of the evaluation. ``annotations`` defaults to [].

    Errors (``ValueError``, one line naming ``source`` and the entry, e.g. ``images[3] has no 'id'``):
    an entry that is not an object; an image or category without ``id`` (or with one that is neither
    an integer nor a string); an annotation without ``image_id`` or ``category_id``, or naming an image
    or category the file lacks; a ``bbox`` that is not 4 finite numbers with w, h >= 0, or an ``area``
    that is not a number >= 0; some annotations with a ``bbox`` and others without; an annotation
    ``id`` that is not an integer. Duplicate ids of images, categories or annotations are errors too,
    not renumbered: pycocotools' index keeps the last entry of an id, so a duplicate annotation id
    silently loses one ground-truth box and counts another twice (a duplicate image id gives two
    records that share both images' boxes; a duplicate category id, one class for two). The loader's
    own fields (``file_name``, a category's ``name``) are checked by ``load_coco_records``: evaluation
    needs neither. Returns ``data``.
    """
    if not isinstance(data, dict):
        raise ValueError(
            f"{source}: expected a json object with 'images', 'categories' and 'annotations',"
            f" not a {type(data).__name__}"
        )
    for key in ("images", "categories"):
        if not data.get(key):
            raise ValueError(f"{source}: no '{key}' list, or an empty one; expected {_EXPECTED}")
    annotations = data.setdefault("annotations", [])
    for key in ("images", "categories", "annotations"):
        if not isinstance(data[key], list):
            raise ValueError(f"{source}: '{key}' is not a list but a {type(data[key]).__name__}")
    image_ids = _unique_ids(data["images"], "images", "image", source)
    category_ids = _unique_ids(data["categories"], "categories", "category", source)
    with_bbox = sum(isinstance(a, dict) and "bbox" in a for a in annotations)
    if 0 < with_bbox < len(annotations):
        raise ValueError(
            f"{source}: {with_bbox} of {len(annotations)} annotations have a 'bbox'; either all or none must"
        )
    given_ids: dict[int, int] = {}  # annotation id -> index of the first annotation that gives it
    unnumbered = []
    for i, ann in enumerate(annotations):
        problem = _annotation_problem(ann, image_ids, category_ids)
        if problem:
            raise ValueError(f"{source}: annotations[{i}]{problem}")
        if "bbox" in ann and "area" not in ann:
            ann["area"] = ann["bbox"][2] * ann["bbox"][3]
        ann.setdefault("iscrowd", 0)
        if "id" not in ann:
            unnumbered.append(i)
            continue
        ann_id = ann["id"]
        if not isinstance(ann_id, int) or isinstance(ann_id, bool):  # COCOeval stores ids in float arrays
            raise ValueError(f"{source}: annotations[{i}] has id {ann_id!r}: annotation ids must be integers")
        if ann_id in given_ids:
            raise ValueError(
                f"{source}: annotations[{i}] has id {ann_id}, as annotations[{given_ids[ann_id]}] does:"
                " annotation ids must be unique (pycocotools keeps one box per id); renumber them"
            )
        given_ids[ann_id] = i
    for i in unnumbered:  # after the loop: an id given further down the file must not be taken
        if i + 1 in given_ids:
            raise ValueError(
                f"{source}: annotations[{i}] has no 'id' and would be numbered {i + 1}, the id of"
                f" annotations[{given_ids[i + 1]}]: give every annotation a unique 'id', or none"
            )
        annotations[i]["id"] = i + 1  # pycocotools indexes annotations by id; label-only files omit it
    return data


def _unique_ids(entries: list[Any], key: str, kind: str, source: str | os.PathLike) -> set[Hashable]:
    """The ``id``s of ``data[key]``, each present and given once (``kind``: "image" or "category")."""
    first: dict[Hashable, int] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: {key}[{i}] is not a json object but {entry!r}")
        if "id" not in entry:
            raise ValueError(f"{source}: {key}[{i}] has no 'id'")
        entry_id = entry["id"]
        if not isinstance(entry_id, (int, str)) or isinstance(entry_id, bool):
            raise ValueError(f"{source}: {key}[{i}] has id {entry_id!r}: expected an integer or a string")
        if entry_id in first:
            raise ValueError(
                f"{source}: {key}[{i}] has id {entry_id!r}, as {key}[{first[entry_id]}] does:"
                f" {kind} ids must be unique (pycocotools keeps one entry per id)"
            )
        first[entry_id] = i
    return set(first)


def _annotation_problem(ann: Any, image_ids: set[Hashable], category_ids: set[Hashable]) -> str | None:
    """What is wrong with one annotation, as the rest of a sentence after ``annotations[i]``, or None.
    Messages are built on failure only: ~860k f-strings would cost more than the checks themselves."""
    if not isinstance(ann, dict):
        return f" is not a json object but {ann!r}"
    if "image_id" not in ann:
        return " has no 'image_id'"
    if not _is_one_of(ann["image_id"], image_ids):
        return f" refers to image id {ann['image_id']!r}, not in 'images'"
    if "category_id" not in ann:
        problem = "has no 'category_id'"
    elif not _is_one_of(ann["category_id"], category_ids):
        problem = (
            f"has category id {ann['category_id']!r}, which is not in 'categories' {sorted(category_ids)}"
        )
    elif "bbox" in ann and not _is_xywh(ann["bbox"]):
        problem = f"has bbox {ann['bbox']!r}: expected [x, y, w, h], 4 finite numbers, w, h >= 0"
    elif "area" in ann and not (_is_finite_number(ann["area"]) and ann["area"] >= 0):
        problem = f"has area {ann['area']!r}: expected a finite number >= 0"
    else:
        return None
    return f" (image {ann['image_id']!r}) {problem}"


def _is_one_of(value: Any, ids: set[Hashable]) -> bool:
    try:
        return value in ids
    except TypeError:  # an unhashable value (a list): no id
        return False


def _is_xywh(bbox: Any) -> bool:
    return (
        isinstance(bbox, (list, tuple))
        and len(bbox) == 4
        and all(_is_finite_number(v) for v in bbox)
        and bbox[2] >= 0
        and bbox[3] >= 0
    )


def _is_finite_number(value: Any) -> bool:
    if type(value) is float or type(value) is int:  # what json gives: the fast path over ~3.4M numbers
        return math.isfinite(value)
    # numbers.Real takes numpy scalars too; bool is an int, and "5" would pass np.array(..., float32).
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def load_coco_records(
    annotation_file: str | os.PathLike, image_root: str | os.PathLike
) -> tuple[list[ImageRecord], tuple[int, ...], tuple[str, ...]]:
    """Records in ``images`` order, the category id of each class index, and the class names."""
    coco = read_coco_json(annotation_file)
    for i, category in enumerate(coco.dataset["categories"]):
        if "name" not in category:
            raise ValueError(f"{annotation_file}: categories[{i}] (id {category['id']!r}) has no 'name'")
        if not isinstance(category["name"], str) or not category["name"].strip():
            raise ValueError(
                f"{annotation_file}: categories[{i}] (id {category['id']!r}) has name {category['name']!r};"
                ' a class name is one non-empty string, e.g. "cat"'
            )
    category_ids = tuple(sorted(coco.cats))
    class_names = tuple(coco.cats[c]["name"] for c in category_ids)
    index_of = {c: i for i, c in enumerate(category_ids)}
    has_boxes = bool(coco.dataset["annotations"]) and "bbox" in coco.dataset["annotations"][0]
    records = []
    for i, image in enumerate(coco.dataset["images"]):
        if "file_name" not in image:
            raise ValueError(f"{annotation_file}: images[{i}] (id {image['id']!r}) has no 'file_name'")
        if not isinstance(image["file_name"], str) or not image["file_name"]:
            raise ValueError(
                f"{annotation_file}: images[{i}] (id {image['id']!r}) has file_name {image['file_name']!r};"
                " expected the image's path under the image folder, one string"
            )
        path = Path(image_root) / image["file_name"]
        height, width = _stated_size(image, annotation_file, i)
        if not height or not width:
            height, width = image_size_from_header(path)
        anns = [a for a in coco.imgToAnns.get(image["id"], []) if not a.get("iscrowd", 0)]
        gt_labels = np.array([index_of[a["category_id"]] for a in anns], dtype=np.int64)
        labels = np.zeros(len(category_ids), dtype=np.float32)
        labels[gt_labels] = 1.0
        gt = {}
        boxes = None
        if has_boxes:
            boxes = coco_xywh_to_xyxy(np.array([a["bbox"] for a in anns], dtype=np.float32)).reshape(-1, 4)
            gt = {"gt_boxes": boxes, "gt_labels": gt_labels, "gt_difficult": np.zeros(len(anns), dtype=bool)}
        partial = [
            label
            for j, a in enumerate(anns)
            if _PARTIAL_FIELDS.intersection(a)
            for label in partial_labels_of_coco_annotation(
                a,
                int(gt_labels[j]),
                None if boxes is None else boxes[j],
                (int(height), int(width)),
                f"{annotation_file}: annotation id {a['id']} (image {image['id']!r})",
            )
        ]
        supervision = supervision_of(
            partial, labels, class_names, f"{annotation_file}: image {image['id']!r}"
        )
        records.append(
            ImageRecord(
                image["id"], str(path), int(height), int(width), labels, **gt, supervision=supervision
            )
        )
    return records, category_ids, class_names


def _stated_size(image: dict[str, Any], source: str | os.PathLike, index: int) -> tuple[int, int]:
    """``images[index]``'s (height, width) as whole pixel counts; 0 for one it leaves out (or gives as 0
    or null), which the caller reads from the image file's header. Errors name ``source`` and the entry."""
    size = []
    for key in ("height", "width"):
        value = image.get(key)
        pixels = 0 if value is None else whole_number(value)
        if pixels is None or pixels < 0:
            raise ValueError(
                f"{source}: images[{index}] (id {image['id']!r}) has {key} {value!r}; expected a whole number"
                f" of pixels (e.g. 640), or leave '{key}' out to read the size from the image file"
            )
        size.append(pixels)
    return size[0], size[1]


class CocoDataset(WeakDetectionDataset):
    """A COCO-format json with proposals, e.g. ``CocoDataset(ann_json, "data/coco/train2017", p)``.

    Attributes: ``category_ids`` (class index -> category id) and ``category_index`` (the reverse);
    ``coco``, the normalised ground truth COCO evaluation scores against. ``options``:
    ``WeakDetectionDataset``'s keyword arguments (transform, max_proposals, ...); pass
    ``drop_unlabelled=True`` for training. Detections are written as a COCO results json
    (``result_format`` "coco"), which the ``coco`` metric scores.
    """

    result_format = "coco"

    def __init__(
        self,
        annotation_file: str | os.PathLike,
        image_root: str | os.PathLike,
        proposals: ProposalSet | str | os.PathLike,
        **options: Any,
    ) -> None:
        self.annotation_file = Path(annotation_file)
        if self.annotation_file.is_file():  # before the read: a rewrite during it is seen later too
            self._file_state = _file_state(self.annotation_file)
        records, self.category_ids, classes = load_coco_records(annotation_file, image_root)
        if options.get("drop_unlabelled") and not any(r.labels.any() for r in records):
            # Said here, where the file is known: the base class would refuse it without naming it.
            raise ValueError(
                f"{annotation_file}: none of its {len(records)} images has a label (no annotation names a"
                " category on them, crowd regions aside); training needs image-level labels: give the"
                " annotations, one per image and class present is enough"
            )
        self.category_index: dict[Hashable, int] = {c: i for i, c in enumerate(self.category_ids)}
        super().__init__(records, classes, proposals, **options)

    @functools.cached_property
    def coco(self) -> COCO:
        """The annotation file as ``read_coco_json`` reads it for the records (defaults filled in), on
        first use: read again rather than kept from construction, so that a training set, never
        evaluated, does not hold its ~860k COCO annotations for the whole run in every loader worker.
        A file changed since construction is an error: its boxes would not be those of the records."""
        if _file_state(self.annotation_file) != self._file_state:
            raise ValueError(
                f"{self.annotation_file}: changed since the dataset was built from it; build the dataset"
                " again (restart) to evaluate against the new file"
            )
        return read_coco_json(self.annotation_file)


def _file_state(path: Path) -> tuple[int, int]:
    """Size and modification time: what tells a rewritten annotation file from the one read."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
