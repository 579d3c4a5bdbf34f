"""Proposal files: read, write and convert by suffix; open a memory-mapped store (docs/METHOD.md §9).

Boxes are float32 ``(R, 4)`` ``x1 y1 x2 y2``, 0-based inclusive pixels of the image on disk (see
``wsod.data.box_formats``); every file is read into a ``ProposalSet`` (``wsod.data.proposals.sets``).

Formats:

- Reference pickle (``.pkl`` / ``.pickle``): a dict with ``'boxes'`` (list of float ``(R_i, 4)`` arrays,
  0-based ``x1 y1 x2 y2``), ``'scores'`` (list of ``(R_i,)`` arrays: ``data.*.max_proposals`` keeps the
  best-scored) and ``'indexes'`` (image ids). detectron2's proposal pickle is read too: ``'ids'`` for
  the ids, ``'objectness_logits'`` for the scores (the logits as they are: their order is the
  probabilities'), and ``'bbox_mode'`` 0 (``XYXY_ABS``, taken as it is) or 1 (``XYWH_ABS``: ``x2 = x + w``,
  as COCO's boxes are read). Files written by Python 2 are read with latin1 decoding. They are read
  with ``wsod.data.proposals.safe_pickle``'s restricted unpickler, which builds numpy arrays, dicts,
  lists and plain values only: a file that asks for anything else (a function to call, another class)
  is refused with ``UnsafePickleError``, naming the file and what it asked for, before that runs.
- MATLAB ``.mat`` releases (the common Selective Search VOC release): ``'boxes'``, a cell of ``(R_i, 4)``
  arrays, and ``'images'``, a cell of image ids; optional ``'scores'``. Their boxes are ``y1 x1 y2 x2``,
  1-based inclusive by default (``box_order="yxyx", one_based=True``): the stored row
  ``[11, 21, 51, 81]`` is the wsod box ``[20, 10, 80, 50]``. Both are arguments, for releases that differ.
  MATLAB v7.3 (HDF5) files cannot be read by scipy; re-save them with ``save(..., '-v7')``.
- Proposal stores (a ``<name>.proposals`` directory): memory-mapped, for sets too large to hold in every
  process's RAM; see ``wsod.data.proposals.store``. ``load_proposals`` opens them as a ``ProposalStore``,
  a ``ProposalSet`` whose boxes stay on disk (in the page cache, shared by all processes).

- Boxes from any tool: a ``.json`` of COCO-style boxes, or a folder of per-image ``.npy`` / ``.txt`` arrays
  (``wsod.data.proposals.box_lists``).

Image sizes (``ProposalSet.image_size``, see ``wsod.data.proposals.sets``): wsod's pickles carry them as
one extra key, ``'image_sizes'``, an ``(N, 2)`` int32 array in file order with ``(0, 0)`` where a size is
unknown; readers of the reference format look up the keys they know by name and ignore it. Stores keep
them in ``sizes.npy``; .mat files do not carry them.

Errors on a file that is not a proposal file, or one of the wrong structure, are one line naming the
file and the field (pickle) or variable (.mat), with what is expected there.

This module is the one that knows both plain sets and stores, so that neither imports the other.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import numpy as np
import scipy.io

from wsod.atomic import atomic_write
from wsod.data.box_formats import coco_xywh_to_xyxy, from_one_based, to_one_based, xyxy_to_yxyx, yxyx_to_xyxy
from wsod.data.proposals.box_lists import read_box_folder, read_box_json
from wsod.data.proposals.safe_pickle import RestrictedUnpickler, UnsafePickleError
from wsod.data.proposals.sets import ImageId, ProposalSet, _a, _as_boxes, _as_scores, _as_sizes
from wsod.data.proposals.store import ProposalStore, is_store_path, write_proposal_store

__all__ = [
    "PICKLE_SUFFIXES",
    "MAT_SUFFIXES",
    "JSON_SUFFIXES",
    "load_proposals",
    "save_proposals",
    "convert_proposals",
    "read_proposal_pickle",
    "write_proposal_pickle",
    "read_proposal_mat",
    "write_proposal_mat",
]

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".pkl", ".pickle")
MAT_SUFFIXES = (".mat",)
JSON_SUFFIXES = (".json",)


PICKLE_LAYOUT = (
    "a dict with fields 'boxes', a list of (R, 4) arrays, and 'indexes' (or 'ids'), the image ids, one per"
    " box array"
)


def _is_list(value: object) -> bool:
    """Whether a pickle field holds one entry per image (a list, tuple or array; not a str or dict)."""
    return isinstance(value, list | tuple) or (isinstance(value, np.ndarray) and value.ndim >= 1)


def _keys(data: dict) -> str:
    """A dict's keys for a message, the first few of a long one (a pickle of 120k ids -> boxes)."""
    keys = list(data)
    return repr(keys) if len(keys) <= 6 else f"{keys[:5]!r}"[:-1] + f", ... {len(keys)} keys]"


def read_proposal_pickle(path: str | os.PathLike) -> ProposalSet:
    """Read the reference pickle format (see the module docstring) with the restricted unpickler. A file
    that asks for more than a proposal pickle holds is an ``UnsafePickleError``; one that does not
    unpickle, or holds another structure, a ``ValueError``; both name the file, and what is expected."""
    try:
        with open(path, "rb") as f:
            data = RestrictedUnpickler(f, source=str(path), encoding="latin1").load()
    except (OSError, UnsafePickleError):
        raise  # not found, no permission, refused: the message names the file already
    except Exception as e:  # a text file, an image, a truncated pickle: unpickling raises nearly any type
        raise ValueError(
            f"{path}: not a readable pickle ({type(e).__name__}: {e}); expected a proposal pickle,"
            f" {PICKLE_LAYOUT}"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected {PICKLE_LAYOUT}, got {_a(data)}")
    if "boxes" not in data:
        raise ValueError(f"{path}: no field 'boxes' (it has {_keys(data)}); expected {PICKLE_LAYOUT}")
    ids_field = "indexes" if "indexes" in data else "ids"
    if ids_field not in data:
        raise ValueError(
            f"{path}: no field 'indexes' (or 'ids') (it has {_keys(data)}); expected {PICKLE_LAYOUT}"
        )
    boxes, ids = data["boxes"], data[ids_field]
    for field, value in (("boxes", boxes), (ids_field, ids)):
        if not _is_list(value):
            raise ValueError(f"{path}: field {field!r} is {_a(value)}; expected a list, one entry per image")
    if len(boxes) != len(ids):
        raise ValueError(
            f"{path}: field 'boxes' has {len(boxes)} entries and field {ids_field!r} {len(ids)}; expected"
            " one box array per image id"
        )
    ids, source = list(ids), str(path)
    arrays = [
        _as_boxes(b, i, source, "field 'boxes', entry", n)
        for n, (b, i) in enumerate(zip(boxes, ids, strict=True))
    ]
    mode = data.get("bbox_mode", 0)
    if mode not in (0, 1) or isinstance(mode, bool):
        raise ValueError(
            f"{path}: field 'bbox_mode' is {mode!r}; expected 0 (detectron2's XYXY_ABS) or 1 (XYWH_ABS)"
        )
    if mode == 1:
        arrays = [coco_xywh_to_xyxy(b).astype(np.float32) for b in arrays]
    scores_field = "scores" if "scores" in data else "objectness_logits"
    scores = data.get(scores_field)
    if (
        scores_field == "scores"
        and scores is not None
        and (not _is_list(scores) or len(scores) != len(arrays))
    ):
        # Some reference releases ship an empty or placeholder 'scores': read as none (file order ranks).
        logger.warning(
            "%s: field 'scores' holds no score per image (%s); reading the file without scores",
            path,
            _a(scores),
        )
        scores = None
    if scores is not None:
        if not _is_list(scores) or len(scores) != len(arrays):
            raise ValueError(
                f"{path}: field {scores_field!r} is {_a(scores)}; expected a list of one score array per"
                " image"
            )
        scores = [
            _as_scores(s, len(b), i, source, f"field {scores_field!r}, entry", n)
            for n, (s, b, i) in enumerate(zip(scores, arrays, ids, strict=True))
        ]
    sizes = _as_sizes(data.get("image_sizes"), len(ids), ids.__getitem__, f"{path}: field 'image_sizes'")
    return ProposalSet(ids, arrays, scores, image_sizes=sizes, source=source)


def write_proposal_pickle(proposals: ProposalSet, path: str | os.PathLike) -> None:
    """Write the reference pickle format atomically; missing scores are written as zeros, and known image
    sizes as the extra key ``'image_sizes'`` (see the module docstring)."""
    boxes = [np.array(b) for _, b in proposals.items()]
    scores = [
        np.zeros(len(b), np.float32) if s is None else np.array(s)
        for b, s in zip(boxes, map(proposals.scores, proposals.image_ids), strict=True)
    ]
    data = {"boxes": boxes, "scores": scores, "indexes": list(proposals.image_ids)}
    if proposals.image_sizes is not None:
        data["image_sizes"] = np.asarray(proposals.image_sizes, dtype=np.int32)
    with atomic_write(path) as f:
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)


MAT_LAYOUT = (
    "a .mat release with variables 'boxes', a cell array of (R, 4) matrices, and 'images', the image ids"
)


def _mat_id(cell: object, path: str | os.PathLike, index: int) -> ImageId:
    """One entry of a MATLAB cell of image ids (a string or a number, often wrapped in 1-element arrays)."""
    value = np.asarray(cell).ravel()
    if value.dtype.kind in "US":
        return "".join(str(v) for v in value).strip()
    if value.size == 0:
        raise ValueError(f"{path}: variable 'images' cell {index} is empty; expected an image id")
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
    except OSError:
        raise  # not found, no permission: the message names the file already
    except Exception as e:  # not a MATLAB file, or a damaged one: scipy raises nearly any type
        raise ValueError(
            f"{path}: not a readable MATLAB file ({type(e).__name__}: {e}); expected {MAT_LAYOUT}"
        ) from e
    for variable in ("boxes", "images"):
        if variable not in data:
            found = sorted(k for k in data if not k.startswith("__"))
            raise ValueError(f"{path}: no variable {variable!r} (found {found}); expected {MAT_LAYOUT}")
    if data["boxes"].dtype != object:
        raise ValueError(
            f"{path}: variable 'boxes' is a {data['boxes'].dtype} {data['boxes'].shape} matrix; expected a"
            " cell array of (R, 4) matrices, one per image"
        )
    cells = data["boxes"].ravel()
    # A cell arrives as an object array, a char matrix (one id per row) as an array of strings, numbers
    # as a numeric array: all three ravel to one entry per image.
    ids = [_mat_id(c, path, n) for n, c in enumerate(data["images"].ravel())]
    if len(cells) != len(ids):
        raise ValueError(
            f"{path}: variable 'boxes' has {len(cells)} cells and variable 'images' {len(ids)}; expected one"
            " box array per image id"
        )
    source, boxes = str(path), []
    for n, (cell, image_id) in enumerate(zip(cells, ids, strict=True)):
        # Checked, not reshaped: a (4, 5) cell reshaped to (-1, 4) would be five wrong boxes.
        b = _as_boxes(cell, image_id, source, "variable 'boxes', cell", n)
        b = yxyx_to_xyxy(b) if box_order == "yxyx" else b
        boxes.append(from_one_based(b) if one_based else b)
    scores = data["scores"].ravel() if "scores" in data else None
    if scores is not None and len(scores) != len(boxes):
        scores = None  # a placeholder, as in pickles; unused anyway
    if scores is not None:
        scores = [
            _as_scores(s, len(b), i, source, "variable 'scores', cell", n)
            for n, (s, b, i) in enumerate(zip(scores, boxes, ids, strict=True))
        ]
    return ProposalSet(ids, boxes, scores, source=source)


def write_proposal_mat(
    proposals: ProposalSet, path: str | os.PathLike, *, box_order: str = "yxyx", one_based: bool = True
) -> None:
    """Write a MATLAB release in the layout ``read_proposal_mat`` reads (default: 1-based ``yxyx``);
    like the releases, it carries no image sizes."""
    boxes = np.empty((1, len(proposals)), dtype=object)
    images = np.empty((len(proposals), 1), dtype=object)
    for i, (image_id, b) in enumerate(proposals.items()):
        b = to_one_based(b) if one_based else np.array(b)
        boxes[0, i] = (xyxy_to_yxyx(b) if box_order == "yxyx" else b).astype(np.float64)
        images[i, 0] = str(image_id) if isinstance(image_id, str) else float(image_id)
    with atomic_write(path) as f:
        scipy.io.savemat(f, {"boxes": boxes, "images": images})


def _unknown_type(path: str | os.PathLike, *, reading: bool = True) -> ValueError:
    readable = PICKLE_SUFFIXES + MAT_SUFFIXES + (JSON_SUFFIXES if reading else ())
    folder = ", a folder of per-image .npy / .txt boxes" if reading else ""
    return ValueError(
        f"{path}: unknown proposal file type; expected one of {readable}{folder} or a '.proposals' store"
    )


def load_proposals(path: str | os.PathLike, **mat_options) -> ProposalSet:
    """Read a proposal file by its suffix, or open a ``.proposals`` store (memory-mapped);
    ``mat_options`` go to ``read_proposal_mat``."""
    if is_store_path(path):
        store = ProposalStore(path)
        logger.info("opened proposal store %s: %d boxes for %d images", path, store.num_boxes, len(store))
        return store
    suffix = Path(path).suffix.lower()
    if Path(path).is_dir():
        proposals = read_box_folder(path)
    elif not Path(path).is_file():
        raise FileNotFoundError(f"proposal file not found: {path}")
    elif suffix in PICKLE_SUFFIXES:
        proposals = read_proposal_pickle(path)
    elif suffix in MAT_SUFFIXES:
        proposals = read_proposal_mat(path, **mat_options)
    elif suffix in JSON_SUFFIXES:
        proposals = read_box_json(path)
    else:
        raise _unknown_type(path)
    logger.info("read %d boxes for %d images from %s", proposals.num_boxes, len(proposals), path)
    return proposals


def save_proposals(
    proposals: ProposalSet, path: str | os.PathLike, *, dtype: str = "float32", **mat_options
) -> None:
    """Write a proposal file in the format its suffix names (``.proposals``: a store with boxes of
    ``dtype``, float32 or float16); ``mat_options`` go to ``write_proposal_mat``."""
    suffix = Path(path).suffix.lower()
    if is_store_path(path):
        write_proposal_store(proposals, path, dtype=dtype)
    elif suffix in PICKLE_SUFFIXES:
        write_proposal_pickle(proposals, path)
    elif suffix in MAT_SUFFIXES:
        write_proposal_mat(proposals, path, **mat_options)
    else:
        raise _unknown_type(path, reading=False)


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
    float16) the boxes of a ``.proposals`` destination. Image sizes are kept where both sides carry them
    (pickles and stores). A destination of unknown type is refused before the source is read.
    """
    if (
        not is_store_path(destination)
        and Path(destination).suffix.lower() not in PICKLE_SUFFIXES + MAT_SUFFIXES
    ):
        raise _unknown_type(destination, reading=False)
    proposals = load_proposals(source, box_order=box_order, one_based=one_based)
    save_proposals(proposals, destination, dtype=dtype, box_order=box_order, one_based=one_based)
    return proposals
