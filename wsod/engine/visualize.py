"""Detections drawn on their image (torchvision's ``draw_bounding_boxes``): for tools/predict.py's PNGs
and the tensorboard images of each evaluation during training."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms.v2 import functional as F
from torchvision.utils import draw_bounding_boxes

__all__ = ["PALETTE", "draw_detections", "save_png", "tag_safe"]

# One colour per class (cycled): distinct hues that stay visible on photographs.
PALETTE = (
    (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
    (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128), (170, 110, 40),
)  # fmt: skip
GROUND_TRUTH_COLOUR = (255, 255, 255)


def save_png(image: Tensor, path: str | os.PathLike) -> None:
    """Write a uint8 (3, H, W) RGB image as a PNG with Pillow (torchvision 0.29 deprecates its encoders)."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"save_png needs a uint8 (3, H, W) image, got {image.dtype} {tuple(image.shape)}")
    Image.fromarray(image.permute(1, 2, 0).cpu().numpy()).save(path, format="PNG")


def draw_detections(
    image: Tensor,
    detections: Mapping[str, Tensor],
    class_names: Sequence[str],
    *,
    top: int | None = None,
    ground_truth: Tensor | None = None,
    max_side: int | None = None,
) -> Tensor:
    """``image`` uint8 (3, H, W) with ``detections`` (``boxes`` (D, 4) xyxy in its pixels, ``scores``,
    ``labels`` in 0..C-1) drawn as boxes in their class's colour labelled "class score", highest score
    last (on top). ``top``: only the ``top`` highest-scoring; ``ground_truth``: (G, 4) boxes drawn
    first, in white; ``max_side``: the image is shrunk first so that its longer side is at most this
    (the boxes with it), e.g. to keep tensorboard files small. Returns a new uint8 (3, h, w) image."""
    boxes = torch.as_tensor(detections["boxes"]).detach().cpu().float().reshape(-1, 4)
    scores = torch.as_tensor(detections["scores"]).detach().cpu().float().reshape(-1)
    labels = torch.as_tensor(detections["labels"]).detach().cpu().long().reshape(-1)
    order = torch.sort(scores, descending=True, stable=True).indices
    if top is not None:
        order = order[:top]
    order = order.flip(0)  # the best box drawn last, over the others
    boxes, scores, labels = boxes[order], scores[order], labels[order]
    image = image.detach().cpu()
    height, width = image.shape[-2:]
    factor = 1.0
    if max_side is not None and max(height, width) > max_side:
        factor = max_side / max(height, width)
        size = [max(1, round(height * factor)), max(1, round(width * factor))]
        image = F.resize(image, size, antialias=True)
    if ground_truth is not None and len(ground_truth):
        gt = _valid(torch.as_tensor(ground_truth).detach().cpu().float().reshape(-1, 4) * factor)
        image = draw_bounding_boxes(image, gt, colors=GROUND_TRUTH_COLOUR, width=1)
    if len(boxes):
        boxes = _valid(boxes * factor)
        pairs = zip(labels.tolist(), scores.tolist(), strict=True)
        names = [f"{class_names[label]} {score:.2f}" for label, score in pairs]
        colours = [PALETTE[label % len(PALETTE)] for label in labels.tolist()]
        image = draw_bounding_boxes(image, boxes, labels=names, colors=colours, width=2)
    return image


def _valid(boxes: Tensor) -> Tensor:
    """Boxes that ``draw_bounding_boxes`` accepts: x2 >= x1 and y2 >= y1."""
    return torch.cat([boxes[:, :2], torch.maximum(boxes[:, 2:], boxes[:, :2])], dim=1)


def tag_safe(text: object) -> str:
    """``text`` with every character outside letters, digits, ``_ . -`` replaced by ``_`` (tensorboard
    tags, file names)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(text))
