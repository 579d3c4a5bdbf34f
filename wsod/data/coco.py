"""COCO-format json: instances files (with boxes) and the same format with image-level labels only.

Accepted json (the COCO instances format; fields marked * are optional)::

    {"images":      [{"id": int | str, "file_name": str, "width"*: int, "height"*: int}, ...],
     "categories":  [{"id": int, "name": str}, ...],
     "annotations": [{"image_id": ..., "category_id": int, "bbox"*: [x, y, w, h], "iscrowd"*: 0 | 1,
                      "id"*: int}, ...]}

Label-only data (custom images with image-level labels) uses the same file with annotations that have
no ``bbox``: one annotation per (image, class present) is enough. Either every annotation has a ``bbox``
(the dataset then has ground truth for evaluation) or none has; a mix is an error. Sizes missing from
``images`` are read from the image file headers. ``file_name`` is relative to ``image_root``.

Classes: contiguous indices 0..C-1 in sorted category-id order over the file's ``categories`` (COCO's 80
ids 1..90 -> 0..79). ``CocoDataset.category_ids[i]`` is the category id of class ``i`` and
``category_index[id]`` the class of a category id, for writing results pycocotools can evaluate.

Crowd annotations (``iscrowd`` = 1) are neither labels nor ground-truth boxes. Boxes: COCO ``xywh`` ->
``(x, y, x + w, y + h)``. An annotation with a category id missing from ``categories``, or an image id
missing from ``images``, raises ``ValueError`` naming the file; images without labels are kept, or
dropped with a logged count by ``drop_unlabelled`` (docs/METHOD.md §9: training drops them).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Hashable
from pathlib import Path

import numpy as np
from pycocotools.coco import COCO

from wsod.data.box_formats import coco_xywh_to_xyxy
from wsod.data.dataset import ImageRecord, Transform, WeakDetectionDataset, image_size_from_header
from wsod.data.proposals import ProposalSet

__all__ = ["CocoDataset", "load_coco_records", "read_coco_json"]

logger = logging.getLogger(__name__)


def read_coco_json(path: str | os.PathLike) -> COCO:
    """Read and check a COCO-format json (see the module docstring) into a pycocotools ``COCO`` index."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"annotation file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid json ({e})") from e
    for key in ("images", "categories"):
        if not data.get(key):
            raise ValueError(f"{path}: no '{key}' list, or an empty one")
    annotations = data.setdefault("annotations", [])
    image_ids = {image["id"] for image in data["images"]}
    category_ids = {category["id"] for category in data["categories"]}
    with_bbox = sum("bbox" in a for a in annotations)
    if 0 < with_bbox < len(annotations):
        raise ValueError(
            f"{path}: {with_bbox} of {len(annotations)} annotations have a 'bbox'; either all or none must"
        )
    for i, ann in enumerate(annotations):
        if ann.get("category_id") not in category_ids:
            raise ValueError(
                f"{path}: annotation {i} (image {ann.get('image_id')!r}) has category id"
                f" {ann.get('category_id')!r}, which is not in 'categories' {sorted(category_ids)}"
            )
        if ann.get("image_id") not in image_ids:
            raise ValueError(
                f"{path}: annotation {i} refers to image id {ann.get('image_id')!r}, not in 'images'"
            )
        ann.setdefault("id", i + 1)  # pycocotools indexes annotations by id; label-only files may omit it
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
        coco.createIndex()
    return coco


def load_coco_records(
    annotation_file: str | os.PathLike, image_root: str | os.PathLike
) -> tuple[list[ImageRecord], tuple[int, ...], tuple[str, ...]]:
    """Records in ``images`` order, the category id of each class index, and the class names."""
    coco = read_coco_json(annotation_file)
    category_ids = tuple(sorted(coco.cats))
    class_names = tuple(coco.cats[c]["name"] for c in category_ids)
    index_of = {c: i for i, c in enumerate(category_ids)}
    has_boxes = bool(coco.dataset["annotations"]) and "bbox" in coco.dataset["annotations"][0]
    records = []
    for image in coco.dataset["images"]:
        path = Path(image_root) / image["file_name"]
        height, width = image.get("height", 0), image.get("width", 0)
        if not height or not width:
            height, width = image_size_from_header(path)
        anns = [a for a in coco.imgToAnns.get(image["id"], []) if not a.get("iscrowd", 0)]
        gt_labels = np.array([index_of[a["category_id"]] for a in anns], dtype=np.int64)
        labels = np.zeros(len(category_ids), dtype=np.float32)
        labels[gt_labels] = 1.0
        gt = {}
        if has_boxes:
            gt = {
                "gt_boxes": coco_xywh_to_xyxy(np.array([a["bbox"] for a in anns], dtype=np.float32)),
                "gt_labels": gt_labels,
                "gt_difficult": np.zeros(len(anns), dtype=bool),
            }
        records.append(ImageRecord(image["id"], str(path), int(height), int(width), labels, **gt))
    return records, category_ids, class_names


class CocoDataset(WeakDetectionDataset):
    """A COCO-format json with proposals, e.g. ``CocoDataset(ann_json, "data/coco/train2017", p)``.

    Attributes: ``category_ids`` (class index -> category id) and ``category_index`` (the reverse).
    See ``WeakDetectionDataset`` for the other arguments; pass ``drop_unlabelled=True`` for training.
    """

    def __init__(
        self,
        annotation_file: str | os.PathLike,
        image_root: str | os.PathLike,
        proposals: ProposalSet | str | os.PathLike,
        *,
        transform: Transform | None = None,
        min_proposal_size: float = 2.0,
        max_proposals: int | None = None,
        drop_unlabelled: bool = False,
        check_files: bool = True,
    ) -> None:
        records, self.category_ids, classes = load_coco_records(annotation_file, image_root)
        self.category_index: dict[Hashable, int] = {c: i for i, c in enumerate(self.category_ids)}
        self.annotation_file = Path(annotation_file)
        super().__init__(
            records,
            classes,
            proposals,
            transform=transform,
            min_proposal_size=min_proposal_size,
            max_proposals=max_proposals,
            drop_unlabelled=drop_unlabelled,
            check_files=check_files,
        )
