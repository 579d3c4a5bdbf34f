"""Proposals from any tool: a COCO-style json of boxes, or a folder of per-image box arrays (issue 39;
``wsod.data.proposals.io.load_proposals`` dispatches here by suffix, and ``tools/make_proposals.py
convert`` turns them into a pickle or a store).

- **A json of boxes** (``.json``): a list of ``{"image_id", "bbox": [x, y, w, h], "score"}`` entries, the
  COCO results format a detector, or a SAM automatic-mask run once its masks' boxes are dumped, writes
  (data/README.md); an object whose ``"annotations"`` is such a list is read the same way, and when it
  also has COCO's ``"images"`` list every box's image_id must be one of its ids. ``score`` is
  optional, but then for every entry or none. Boxes are read as COCO's (``x, y, x + w, y + h``:
  ``wsod.data.box_formats.coco_xywh_to_xyxy``, the rule the pseudo-label json follows); an image's boxes
  keep the file's order.
- **A folder of arrays**: one file per image, ``<image id>.npy`` (a numeric array; pickled arrays are
  refused) or ``<image id>.txt`` (one box per line, numbers separated by spaces or commas, ``#`` lines
  skipped), each ``(R, 4)`` ``x1 y1 x2 y2`` in wsod's convention (0-based inclusive pixels) or ``(R, 5)``
  with a score last, for every file or none. The image id is the file's path under the folder less its
  suffix (``000005.npy`` -> ``000005``, which matches VOC's ``000005`` and COCO's ``5``;
  ``cats/001.jpg.txt`` -> ``cats/001.jpg``, a folder dataset's id).

Every problem is one line naming the file, the entry or image, and the field.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from wsod.data.box_formats import coco_xywh_to_xyxy
from wsod.data.json_files import read_json
from wsod.data.proposals.sets import ImageId, ProposalSet, _a

__all__ = ["BOX_JSON_LAYOUT", "BOX_FOLDER_SUFFIXES", "read_box_json", "read_box_folder"]

BOX_JSON_LAYOUT = (
    'a json list of {"image_id", "bbox": [x, y, w, h], "score" (optional)} entries (COCO results), or an'
    ' object whose "annotations" is such a list'
)
BOX_FOLDER_SUFFIXES = (".npy", ".txt")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _listed_image_ids(path: str | os.PathLike, content: object) -> set[ImageId] | None:
    """The ids of a COCO-style json's ``"images"`` list, which every box's image_id must name (a box of an
    image the file does not list is a broken file, not a new image); None when there is no such list (a
    results-format list of boxes)."""
    if not isinstance(content, dict) or "images" not in content:
        return None
    images = content["images"]
    if not isinstance(images, list) or not all(isinstance(i, dict) and "id" in i for i in images):
        raise ValueError(f'{path}: "images" is {_a(images)}; expected a list of {{"id", ...}} entries')
    return {image["id"] for image in images}


def read_box_json(path: str | os.PathLike) -> ProposalSet:
    """The boxes (and scores) of a json of boxes (the module docstring), per image in order of first
    appearance."""
    content = read_json(path, BOX_JSON_LAYOUT)
    entries = content.get("annotations") if isinstance(content, dict) else content
    if not isinstance(entries, list):
        raise ValueError(f"{path}: the json is {_a(content)}; expected {BOX_JSON_LAYOUT}")
    known = _listed_image_ids(path, content)
    boxes: dict[ImageId, list[list[float]]] = {}
    scores: dict[ImageId, list[float]] = {}
    scored = None  # whether entry 0 has a score: every other entry must agree
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict) or "image_id" not in entry or "bbox" not in entry:
            raise ValueError(
                f"{path}: entry {n} is {_a(entry)} without image_id and bbox; expected {BOX_JSON_LAYOUT}"
            )
        image_id, bbox = entry["image_id"], entry["bbox"]
        where = f"{path}: entry {n} (image_id {image_id!r})"
        if not isinstance(image_id, int | str) or isinstance(image_id, bool):
            raise ValueError(f"{where}: the image_id is neither an integer nor a string")
        if known is not None and image_id not in known:
            raise ValueError(
                f'{where}: the image_id is not in the file\'s "images" list; add the image there or drop'
                " its boxes"
            )
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(map(_number, bbox)) and min(bbox[2:]) >= 0):
            raise ValueError(
                f"{where}: bbox is {bbox!r}; expected [x, y, w, h], four finite numbers, w and h >= 0"
            )
        has_score = "score" in entry
        scored = has_score if scored is None else scored
        if has_score != scored:
            mine, theirs = ("has a", "has none") if has_score else ("has no", "has one")
            raise ValueError(f"{where} {mine} score, entry 0 {theirs}: give every box a score, or none")
        if has_score and not _number(entry["score"]):
            raise ValueError(f"{where}: score is {entry['score']!r}; expected a finite number")
        boxes.setdefault(image_id, []).append(bbox)
        if has_score:
            scores.setdefault(image_id, []).append(float(entry["score"]))
    if not boxes:
        raise ValueError(f"{path}: no box; expected {BOX_JSON_LAYOUT}")
    ids = list(boxes)
    arrays = [coco_xywh_to_xyxy(np.asarray(boxes[i], dtype=np.float64)).astype(np.float32) for i in ids]
    per_image = [np.asarray(scores[i], dtype=np.float32) for i in ids] if scores else None
    return ProposalSet(ids, arrays, per_image, source=str(path))


def _read_array(file: Path) -> np.ndarray:
    """One image's file as a float64 (R, C) array (its problems named with the file)."""
    if file.suffix.lower() == ".npy":
        try:
            array = np.load(file, allow_pickle=False)
        except ValueError as e:  # an object array: loading it would unpickle
            raise ValueError(f"{file}: not a numeric array ({e}); save the boxes as a float array") from None
        if array.dtype.kind not in "iuf":
            raise ValueError(f"{file}: an array of {array.dtype}; expected numbers")
        array = array.astype(np.float64)
    else:
        rows = []
        for number, line in enumerate(file.read_text().splitlines(), 1):
            words = line.replace(",", " ").split()
            if not words or words[0].startswith("#"):
                continue
            try:
                rows.append([float(w) for w in words])
            except ValueError:
                raise ValueError(
                    f"{file}: line {number} is {line.strip()!r}; expected x1 y1 x2 y2 [score]"
                ) from None
            if len(rows[-1]) != len(rows[0]):
                raise ValueError(
                    f"{file}: line {number} has {len(rows[-1])} numbers, the first box {len(rows[0])}"
                )
        array = np.asarray(rows, dtype=np.float64).reshape(len(rows), -1 if rows else 4)
    if array.size == 0:
        return np.zeros((0, 4))
    if array.ndim == 1 and array.shape[0] in (4, 5):
        array = array[None]
    if array.ndim != 2 or array.shape[1] not in (4, 5) or not np.isfinite(array).all():
        raise ValueError(
            f"{file}: boxes of shape {array.shape}; expected (R, 4) x1 y1 x2 y2, or (R, 5) with a score last,"
            " finite numbers"
        )
    return array


def read_box_folder(path: str | os.PathLike) -> ProposalSet:
    """The boxes (and scores) of a folder of per-image ``.npy`` / ``.txt`` files (the module docstring)."""
    folder = Path(path)
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in BOX_FOLDER_SUFFIXES)
    if not files:
        raise ValueError(
            f"{folder}: no .npy or .txt file; expected one box file per image, named by its image id"
            " (000005.npy, 000005.txt)"
        )
    ids, arrays, scores, scored = [], [], [], None
    for file in files:
        array = _read_array(file)
        has_score = array.shape[1] == 5 and len(array) > 0
        if len(array):
            if scored is None:
                scored = (file, has_score)
            elif scored[1] != has_score:
                raise ValueError(
                    f"{file} {'has' if has_score else 'has no'} score column, {scored[0]}"
                    f" {'has none' if has_score else 'has one'}: give every file a score column, or none"
                )
        ids.append(file.relative_to(folder).with_suffix("").as_posix())
        arrays.append(array[:, :4].astype(np.float32))
        scores.append(
            array[:, 4].astype(np.float32) if array.shape[1] == 5 else np.zeros(len(array), np.float32)
        )
    with_scores = scored is not None and scored[1]
    return ProposalSet(ids, arrays, scores if with_scores else None, source=str(folder))
