"""Proposal files: read, write, convert, look up by image id, and filter (docs/METHOD.md §9).

Boxes are float32 ``(R, 4)`` ``x1 y1 x2 y2``, 0-based inclusive pixels of the image on disk (see
``wsod.data.box_formats``).

Formats:

- Reference pickle (``.pkl`` / ``.pickle``): a dict with ``'boxes'`` (list of float ``(R_i, 4)`` arrays,
  0-based ``x1 y1 x2 y2``), ``'scores'`` (list of ``(R_i,)`` arrays; read but unused) and ``'indexes'``
  (image ids; detectron2's ``'ids'`` is accepted too). Files written by Python 2 are read with latin1
  decoding. Only load pickles you trust: unpickling can run code.
- MATLAB ``.mat`` releases (the common Selective Search VOC release): ``'boxes'``, a cell of ``(R_i, 4)``
  arrays, and ``'images'``, a cell of image ids; optional ``'scores'``. Their boxes are ``y1 x1 y2 x2``,
  1-based inclusive by default (``box_order="yxyx", one_based=True``): the stored row
  ``[11, 21, 51, 81]`` is the wsod box ``[20, 10, 80, 50]``. Both are arguments, for releases that differ.
  MATLAB v7.3 (HDF5) files cannot be read by scipy; re-save them with ``save(..., '-v7')``.
- Proposal stores (a ``<name>.proposals`` directory): memory-mapped, for sets too large to hold in every
  process's RAM; see ``wsod.data.proposal_store``. ``load_proposals`` opens them as a ``ProposalStore``,
  a ``ProposalSet`` whose boxes stay on disk (in the page cache, shared by all processes).

Image ids are matched after ``proposal_key``: a numeric id, or a string of digits and underscores, is
compared as an integer. Reference VOC pickles store ``000005`` as ``5`` and ``2008_000008`` as
``2008000008``; with this rule the VOC ids from ImageSets files find them, and so do COCO's integer ids.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path

import numpy as np
import scipy.io
import torch
from torch import Tensor
from torchvision.ops import clip_boxes_to_image

from wsod.atomic import atomic_write
from wsod.data.box_formats import from_one_based, to_one_based, xyxy_to_yxyx, yxyx_to_xyxy

__all__ = [
    "MissingProposalsError",
    "ProposalSet",
    "proposal_key",
    "filter_proposals",
    "whole_image_box",
    "load_proposals",
    "save_proposals",
    "read_proposal_pickle",
    "write_proposal_pickle",
    "read_proposal_mat",
    "write_proposal_mat",
    "convert_proposals",
]

logger = logging.getLogger(__name__)

ImageId = Hashable
PICKLE_SUFFIXES = (".pkl", ".pickle")
MAT_SUFFIXES = (".mat",)


class MissingProposalsError(LookupError):
    """An image id is not in the proposal file (the message names both)."""


def proposal_key(image_id: ImageId) -> ImageId:
    """The key under which an image id is looked up: numeric ids and digit strings become ``int``."""
    if isinstance(image_id, np.generic):
        image_id = image_id.item()
    if isinstance(image_id, bytes):
        image_id = image_id.decode()
    if isinstance(image_id, str):
        digits = image_id.strip().replace("_", "")
        return int(digits) if digits.isdigit() else image_id.strip()
    return image_id


def _as_boxes(boxes: np.ndarray, image_id: ImageId, source: str) -> np.ndarray:
    """Check one image's boxes: (R, 4), a single (4,) box, or empty; anything else (e.g. (R, 5) with a
    score column) is an error rather than silently reshaped into wrong boxes."""
    boxes = np.asarray(boxes, dtype=np.float32)
    if boxes.size == 0 or boxes.shape == (4,):
        return boxes.reshape(-1, 4)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(f"{source}: image {image_id!r} has boxes of shape {boxes.shape}; expected (R, 4)")
    return boxes


class ProposalSet:
    """The proposals of many images with O(1) lookup by image id.

    All boxes live in one float32 ``(sum R_i, 4)`` array with per-image offsets: one buffer instead of
    thousands of small arrays, so that forked data-loader workers share it without copying.

    Args:
        image_ids: N image ids, in file order.
        boxes: N float arrays (R_i, 4), 0-based inclusive ``x1 y1 x2 y2``.
        scores: optional N arrays (R_i,); kept for round trips, unused by training.
        source: where the proposals came from (a file name), quoted in error messages.
    """

    def __init__(
        self,
        image_ids: Sequence[ImageId],
        boxes: Sequence[np.ndarray],
        scores: Sequence[np.ndarray] | None = None,
        *,
        source: str = "<memory>",
    ) -> None:
        if len(image_ids) != len(boxes) or (scores is not None and len(scores) != len(boxes)):
            raise ValueError(
                f"{source}: {len(image_ids)} image ids, {len(boxes)} box arrays and"
                f" {None if scores is None else len(scores)} score arrays; they must match"
            )
        arrays = [_as_boxes(b, image_id, source) for b, image_id in zip(boxes, image_ids, strict=True)]
        counts = np.array([len(b) for b in arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = np.concatenate(arrays) if arrays else np.zeros((0, 4), np.float32)
        flat_scores = None
        if scores is not None:
            score_arrays = [np.asarray(s, dtype=np.float32).reshape(-1) for s in scores]
            if any(len(s) != n for s, n in zip(score_arrays, counts, strict=True)):
                raise ValueError(f"{source}: some images have a different number of scores and boxes")
            flat_scores = np.concatenate(score_arrays) if score_arrays else np.zeros(0, np.float32)
        self._set_flat(image_ids, flat, offsets, flat_scores, source)

    @classmethod
    def from_flat(
        cls,
        image_ids: Sequence[ImageId],
        boxes: np.ndarray,
        offsets: np.ndarray,
        scores: np.ndarray | None = None,
        *,
        source: str = "<memory>",
    ) -> ProposalSet:
        """The proposals of N images from one float32 ``(M, 4)`` box array, without copying it: image
        ``i`` owns rows ``offsets[i]:offsets[i + 1]`` (``offsets``: N + 1 non-decreasing, 0 to M)."""
        boxes, offsets = np.asarray(boxes), np.asarray(offsets, dtype=np.int64)
        if boxes.dtype != np.float32 or boxes.ndim != 2 or boxes.shape[1] != 4:
            raise ValueError(f"{source}: boxes must be float32 (M, 4), got {boxes.dtype} {boxes.shape}")
        if (
            offsets.shape != (len(image_ids) + 1,)
            or offsets[0] != 0
            or offsets[-1] != len(boxes)
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(
                f"{source}: offsets must be {len(image_ids) + 1} non-decreasing values from 0 to {len(boxes)}"
            )
        if scores is not None and np.shape(scores) != (len(boxes),):
            raise ValueError(f"{source}: scores of shape {np.shape(scores)}; expected ({len(boxes)},)")
        proposals = cls.__new__(cls)
        proposals._set_flat(image_ids, boxes, offsets, scores, source)
        return proposals

    def _set_flat(
        self,
        image_ids: Sequence[ImageId],
        boxes: np.ndarray,
        offsets: np.ndarray,
        scores: np.ndarray | None,
        source: str,
    ) -> None:
        self.source = str(source)
        self.image_ids = list(image_ids)
        self._boxes, self._offsets, self._scores = boxes, offsets, scores
        self._index: dict[ImageId, int] = {}
        for i, image_id in enumerate(self.image_ids):
            key = proposal_key(image_id)
            if key in self._index:
                raise ValueError(f"{source}: image id {image_id!r} appears more than once")
            self._index[key] = i

    def __len__(self) -> int:
        return len(self.image_ids)

    def __contains__(self, image_id: ImageId) -> bool:
        return proposal_key(image_id) in self._index

    def _position(self, image_id: ImageId) -> int:
        try:
            return self._index[proposal_key(image_id)]
        except KeyError:
            raise MissingProposalsError(
                f"image id {image_id!r} is not in the proposal file {self.source} ({len(self)} images)"
            ) from None

    def __getitem__(self, image_id: ImageId) -> np.ndarray:
        """Boxes (R, 4) float32 of one image (a read-only view; filtering makes a new array)."""
        i = self._position(image_id)
        view = self._boxes[self._offsets[i] : self._offsets[i + 1]]
        view.flags.writeable = False
        return view

    def scores(self, image_id: ImageId) -> np.ndarray | None:
        """Scores (R,) of one image, or None when the source had none."""
        if self._scores is None:
            return None
        i = self._position(image_id)
        return self._scores[self._offsets[i] : self._offsets[i + 1]]

    def items(self) -> Iterator[tuple[ImageId, np.ndarray]]:
        """(image id, boxes (R, 4)) in file order."""
        for image_id in self.image_ids:
            yield image_id, self[image_id]

    def missing(self, image_ids: Sequence[ImageId]) -> list[ImageId]:
        """The ids among ``image_ids`` that have no entry here."""
        return [i for i in image_ids if i not in self]

    def require(self, image_ids: Sequence[ImageId]) -> None:
        """Raise ``MissingProposalsError`` naming the first missing id, the count and the file."""
        missing = self.missing(image_ids)
        if missing:
            raise MissingProposalsError(
                f"{len(missing)} of {len(image_ids)} images have no proposals in {self.source}; the first"
                f" is image id {missing[0]!r}. Was the file made for another image set?"
            )

    @property
    def num_boxes(self) -> int:
        return len(self._boxes)


# ----------------------------------------------------------------------------------------------------
# Filtering


def filter_proposals(
    boxes: np.ndarray | Tensor,
    image_size: tuple[int, int],
    *,
    min_size: float = 2.0,
    top_k: int | None = None,
) -> Tensor:
    """docs/METHOD.md §9 loading rules on one image's boxes (R, 4) -> float32 (R', 4), R' <= R.

    In order: clip to the image (0-based inclusive, so to ``[0, W - 1] x [0, H - 1]``); drop boxes whose
    inclusive pixel width ``x2 - x1 + 1`` or height ``y2 - y1 + 1`` is below ``min_size`` (the reference
    code's rule: with the default 2, a box spanning pixels 5 and 6, ``[5, ., 6, .]``, is kept) and boxes
    with ``x2 <= x1`` or ``y2 <= y1`` whatever ``min_size`` (they have no area in the continuous
    convention of IoU and box encoding; the reference's clipping drops them too); drop exact duplicates,
    keeping the first; keep the first ``top_k`` (file order is the proposal method's ranking).
    Deduplication comes after clipping because clipping turns boxes that overhang an edge into duplicates.
    """
    height, width = image_size
    boxes = torch.tensor(np.asarray(boxes, dtype=np.float32)).reshape(-1, 4)
    # The last pixel of an image of width W is W - 1 in the inclusive convention.
    boxes = clip_boxes_to_image(boxes, (height - 1, width - 1))
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    keep = (widths + 1 >= min_size) & (heights + 1 >= min_size) & (widths > 0) & (heights > 0)
    boxes = boxes[keep]
    if len(boxes):
        _, first = np.unique(boxes.numpy(), axis=0, return_index=True)
        boxes = boxes[torch.from_numpy(np.sort(first))]
    if top_k is not None:
        boxes = boxes[:top_k]
    return boxes


def whole_image_box(image_size: tuple[int, int]) -> Tensor:
    """The box (1, 4) covering the whole image: the stand-in for an image left without proposals."""
    height, width = image_size
    return torch.tensor([[0.0, 0.0, width - 1.0, height - 1.0]])


# ----------------------------------------------------------------------------------------------------
# Files


def read_proposal_pickle(path: str | os.PathLike) -> ProposalSet:
    """Read the reference pickle format (see the module docstring)."""
    with open(path, "rb") as f:
        data = pickle.load(f, encoding="latin1")
    if not isinstance(data, dict) or "boxes" not in data or not ({"indexes", "ids"} & data.keys()):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: expected a dict with keys 'boxes' and 'indexes' (or 'ids'), got {found}")
    ids = data["indexes"] if "indexes" in data else data["ids"]
    scores = data.get("scores")
    if scores is not None and len(scores) != len(data["boxes"]):
        scores = None  # some releases ship an empty or placeholder 'scores'; they are unused anyway
    return ProposalSet(list(ids), list(data["boxes"]), scores, source=str(path))


def write_proposal_pickle(proposals: ProposalSet, path: str | os.PathLike) -> None:
    """Write the reference pickle format atomically; missing scores are written as zeros."""
    boxes = [np.array(b) for _, b in proposals.items()]
    scores = [
        np.zeros(len(b), np.float32) if s is None else np.array(s)
        for b, s in zip(boxes, map(proposals.scores, proposals.image_ids), strict=True)
    ]
    data = {"boxes": boxes, "scores": scores, "indexes": list(proposals.image_ids)}
    with atomic_write(path) as f:
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)


def _mat_id(cell: object) -> ImageId:
    """One entry of a MATLAB cell of image ids (a string or a number, often wrapped in 1-element arrays)."""
    value = np.asarray(cell).ravel()
    if value.dtype.kind in "US":
        return "".join(str(v) for v in value).strip()
    return int(value[0]) if value.dtype.kind in "iuf" else str(value[0])


def read_proposal_mat(
    path: str | os.PathLike, *, box_order: str = "yxyx", one_based: bool = True
) -> ProposalSet:
    """Read a MATLAB proposal release (see the module docstring for ``box_order`` and ``one_based``)."""
    if box_order not in ("yxyx", "xyxy"):
        raise ValueError(f"box_order must be 'yxyx' or 'xyxy', got {box_order!r}")
    try:
        data = scipy.io.loadmat(path)
    except NotImplementedError as e:  # scipy's answer to HDF5-based v7.3 files
        raise ValueError(f"{path}: MATLAB v7.3 files are not supported; re-save with '-v7' ({e})") from e
    if "boxes" not in data or "images" not in data:
        found = sorted(k for k in data if not k.startswith("__"))
        raise ValueError(f"{path}: expected variables 'boxes' and 'images', found {found}")
    cells = data["boxes"].ravel()
    # A cell arrives as an object array, a char matrix (one id per row) as an array of strings, numbers
    # as a numeric array: all three ravel to one entry per image.
    ids = [_mat_id(c) for c in data["images"].ravel()]
    boxes = []
    for cell in cells:
        b = np.asarray(cell, dtype=np.float32).reshape(-1, 4)
        b = yxyx_to_xyxy(b) if box_order == "yxyx" else b
        boxes.append(from_one_based(b) if one_based else b)
    scores = [np.asarray(s, np.float32).ravel() for s in data["scores"].ravel()] if "scores" in data else None
    return ProposalSet(ids, boxes, scores, source=str(path))


def write_proposal_mat(
    proposals: ProposalSet, path: str | os.PathLike, *, box_order: str = "yxyx", one_based: bool = True
) -> None:
    """Write a MATLAB release in the layout ``read_proposal_mat`` reads (default: 1-based ``yxyx``)."""
    boxes = np.empty((1, len(proposals)), dtype=object)
    images = np.empty((len(proposals), 1), dtype=object)
    for i, (image_id, b) in enumerate(proposals.items()):
        b = to_one_based(b) if one_based else np.array(b)
        boxes[0, i] = (xyxy_to_yxyx(b) if box_order == "yxyx" else b).astype(np.float64)
        images[i, 0] = str(image_id) if isinstance(image_id, str) else float(image_id)
    with atomic_write(path) as f:
        scipy.io.savemat(f, {"boxes": boxes, "images": images})


def _unknown_type(path: str | os.PathLike) -> ValueError:
    return ValueError(
        f"{path}: unknown proposal file type; expected one of {PICKLE_SUFFIXES + MAT_SUFFIXES}"
        " or a '.proposals' store"
    )


def load_proposals(path: str | os.PathLike, **mat_options) -> ProposalSet:
    """Read a proposal file by its suffix, or open a ``.proposals`` store (memory-mapped);
    ``mat_options`` go to ``read_proposal_mat``."""
    from wsod.data.proposal_store import ProposalStore, is_store_path  # it imports this module

    if is_store_path(path):
        store = ProposalStore(path)
        logger.info("opened proposal store %s: %d boxes for %d images", path, store.num_boxes, len(store))
        return store
    suffix = Path(path).suffix.lower()
    if not Path(path).is_file():
        raise FileNotFoundError(f"proposal file not found: {path}")
    if suffix in PICKLE_SUFFIXES:
        proposals = read_proposal_pickle(path)
    elif suffix in MAT_SUFFIXES:
        proposals = read_proposal_mat(path, **mat_options)
    else:
        raise _unknown_type(path)
    logger.info("read %d boxes for %d images from %s", proposals.num_boxes, len(proposals), path)
    return proposals


def save_proposals(
    proposals: ProposalSet, path: str | os.PathLike, *, dtype: str = "float32", **mat_options
) -> None:
    """Write a proposal file in the format its suffix names (``.proposals``: a store with boxes of
    ``dtype``, float32 or float16); ``mat_options`` go to ``write_proposal_mat``."""
    from wsod.data.proposal_store import is_store_path, write_proposal_store

    suffix = Path(path).suffix.lower()
    if is_store_path(path):
        write_proposal_store(proposals, path, dtype=dtype)
    elif suffix in PICKLE_SUFFIXES:
        write_proposal_pickle(proposals, path)
    elif suffix in MAT_SUFFIXES:
        write_proposal_mat(proposals, path, **mat_options)
    else:
        raise _unknown_type(path)


def convert_proposals(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    box_order: str = "yxyx",
    one_based: bool = True,
    dtype: str = "float32",
) -> ProposalSet:
    """Convert between proposal formats by file suffix (e.g. a ``.mat`` release -> reference ``.pkl``,
    or a ``.pkl`` -> a memory-mapped ``.proposals`` store).

    ``box_order`` and ``one_based`` describe whichever side is a ``.mat`` file; ``dtype`` (float32 or
    float16) the boxes of a ``.proposals`` destination.
    """
    proposals = load_proposals(source, box_order=box_order, one_based=one_based)
    save_proposals(proposals, destination, dtype=dtype, box_order=box_order, one_based=one_based)
    return proposals
