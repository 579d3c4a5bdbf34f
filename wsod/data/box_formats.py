"""Box conventions: every conversion between on-disk box formats and wsod's own happens here.

wsod boxes are float32 ``(N, 4)`` arrays/tensors ``x1 y1 x2 y2`` in pixels of the image on disk,
0-based, with ``x2, y2`` the last column and row the box covers (inclusive). This is the convention of
the PASCAL VOC devkit once its 1-based coordinates are shifted by one, and of the reference proposal
pickles (which were made from the 1-based Selective Search releases by subtracting one). VOC evaluation
measures these boxes with the devkit's inclusive width ``x2 - x1 + 1`` (``wsod.modeling.inclusive_boxes``).

On-disk formats and their conversions:

- VOC xml ``<bndbox>``: 1-based inclusive ``xmin ymin xmax ymax`` -> subtract 1 from each coordinate
  (``from_one_based``); the toy dataset writes its xml with ``to_one_based``.
- MATLAB Selective Search releases: 1-based inclusive ``y1 x1 y2 x2`` -> ``yxyx_to_xyxy`` then
  ``from_one_based``.
- COCO ``bbox``: ``x y w h`` -> ``(x, y, x + w, y + h)`` (``coco_xywh_to_xyxy``). COCO boxes are
  continuous, not inclusive; they are kept as COCO defines them so that pycocotools sees the same boxes.
- OpenCV rectangles ``x y w h`` covering pixels ``x .. x + w - 1`` -> ``(x, y, x + w - 1, y + h - 1)``
  (``opencv_rects_to_xyxy``).
"""

from __future__ import annotations

import numpy as np
import torch
from torchvision.ops import box_convert

__all__ = [
    "from_one_based",
    "to_one_based",
    "yxyx_to_xyxy",
    "xyxy_to_yxyx",
    "coco_xywh_to_xyxy",
    "opencv_rects_to_xyxy",
]

_SWAP_XY = [1, 0, 3, 2]


def from_one_based(boxes: np.ndarray) -> np.ndarray:
    """1-based inclusive boxes (N, 4) (VOC xml, MATLAB) -> 0-based inclusive float32 (N, 4)."""
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4) - 1.0


def to_one_based(boxes: np.ndarray) -> np.ndarray:
    """0-based inclusive boxes (N, 4) -> 1-based inclusive float32 (N, 4), for writing xml and .mat."""
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4) + 1.0


def yxyx_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    """(N, 4) ``y1 x1 y2 x2`` -> ``x1 y1 x2 y2`` (the order of the MATLAB Selective Search releases)."""
    return np.asarray(boxes).reshape(-1, 4)[:, _SWAP_XY]


def xyxy_to_yxyx(boxes: np.ndarray) -> np.ndarray:
    """(N, 4) ``x1 y1 x2 y2`` -> ``y1 x1 y2 x2``; the same swap, named for the direction it is used in."""
    return np.asarray(boxes).reshape(-1, 4)[:, _SWAP_XY]


def coco_xywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    """COCO ``[x, y, w, h]`` (N, 4) -> float32 ``(x, y, x + w, y + h)`` (N, 4)."""
    xywh = torch.as_tensor(np.asarray(boxes, dtype=np.float32).reshape(-1, 4))
    return box_convert(xywh, in_fmt="xywh", out_fmt="xyxy").numpy()


def opencv_rects_to_xyxy(rects: np.ndarray) -> np.ndarray:
    """OpenCV ``(x, y, w, h)`` integer rectangles (N, 4) -> 0-based inclusive float32 (N, 4)."""
    xyxy = coco_xywh_to_xyxy(rects)
    xyxy[:, 2:] -= 1.0  # a w-pixel-wide rectangle starting at x ends on column x + w - 1
    return xyxy
