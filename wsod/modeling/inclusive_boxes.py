"""Boxes in inclusive pixels, as the VOC devkit and the Fast R-CNN lineage measure them: a box
``x1 y1 x2 y2`` spans columns x1..x2, so its width is ``x2 - x1 + 1``. wsod's boxes are in this
convention (wsod.data.box_formats); these are the IoU and the NMS the references compute on them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchvision.ops import box_iou, nms

__all__ = ["inclusive_box_iou", "inclusive_nms"]


def inclusive_box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU (N, M) of inclusive boxes (N, 4) and (M, 4), widths ``x2 - x1 + 1`` as in the VOC devkit."""
    # Shifting x2, y2 by one pixel turns inclusive boxes into the continuous ones box_iou measures.
    one = boxes1.new_tensor([0.0, 0.0, 1.0, 1.0])
    return box_iou(boxes1 + one, boxes2 + one.to(boxes2))


def inclusive_nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS as the Fast R-CNN lineage's ``cython_nms.nms`` (py-faster-rcnn, Detectron, pcl.pytorch,
    CBL-WSOD ``lib/utils/cython_nms.pyx``:44,80-84): IoU of inclusive boxes (widths ``x2 - x1 + 1``), and a
    box is dropped when its IoU with a kept one is *at least* ``iou_threshold``, where torchvision's ``nms``
    drops only above it. A 100-pixel-wide box and its left 40 columns (IoU 0.4 exactly) are one box at
    0.4 here, two in torchvision.

    boxes (N, 4) inclusive xyxy, scores (N,) -> indices (K,) of the kept boxes, by decreasing score.
    """
    one = boxes.new_tensor([0.0, 0.0, 1.0, 1.0])
    # torchvision compares IoU > threshold, the IoU in the boxes' dtype: the largest value of that dtype
    # below the threshold turns it into IoU >= threshold, exactly.
    threshold = torch.tensor(iou_threshold, dtype=boxes.dtype)
    below = float(torch.nextafter(threshold, threshold.new_tensor(float("-inf"))))
    return nms(boxes + one, scores, below)
