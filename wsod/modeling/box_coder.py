"""Box regression encoding: torchvision's ``BoxCoder`` with the (10, 10, 5, 5) weights of Fast R-CNN.

Deltas are (dx, dy, dw, dh) = (10 (x_t - x_p) / w_p, 10 (y_t - y_p) / h_p, 5 log(w_t / w_p),
5 log(h_t / h_p)) with centres x, y and sizes w = x2 - x1, h = y2 - y1 (no +1: torchvision's
convention, used everywhere in the model; only VOC evaluation uses the devkit's inclusive pixels).
"""

from __future__ import annotations

from torch import Tensor
from torchvision.models.detection._utils import BoxCoder

__all__ = ["BOX_CODER_WEIGHTS", "encode_boxes", "decode_boxes"]

BOX_CODER_WEIGHTS = (10.0, 10.0, 5.0, 5.0)
_BOX_CODER = BoxCoder(BOX_CODER_WEIGHTS)


def encode_boxes(targets: Tensor, proposals: Tensor) -> Tensor:
    """targets (N, 4), proposals (N, 4) xyxy -> deltas (N, 4) of each target relative to its proposal."""
    return _BOX_CODER.encode_single(targets, proposals)


def decode_boxes(deltas: Tensor, proposals: Tensor) -> Tensor:
    """deltas (N, 4 K) (K boxes per proposal, 4 numbers each), proposals (N, 4) -> boxes (N, K, 4).

    dw and dh are clamped at log(1000 / 16) before exponentiation, as torchvision does.
    """
    boxes = _BOX_CODER.decode_single(deltas, proposals.to(deltas.dtype))
    return boxes.view(deltas.shape[0], -1, 4)
