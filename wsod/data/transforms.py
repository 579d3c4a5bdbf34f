"""Training and test transforms of a dataset item: resize the shorter side, flip, normalise.

The geometry is torchvision's (``transforms.v2`` on ``tv_tensors``), so proposals follow the image
through every step: resize scales x by ``w / W`` and y by ``h / H``; a horizontal flip maps
``x -> w - x`` (``x1' = w - x2``, ``x2' = w - x1``), which is its own inverse, so flipping detections back
for test-time augmentation is the same call (``torchvision.transforms.v2.functional.horizontal_flip``).
torchvision treats coordinates as continuous, while wsod's are 0-based inclusive (see
``wsod.data.box_formats``); on flipped images this places boxes one resized pixel to the right of the
exact pixel mirror, well below what a stride-16 feature map resolves, and it cancels when flipping back.

Item keys added or replaced (the rest pass through; ``gt_*`` stay in original pixels for evaluation):

    image       float32 (3, h, w), RGB scaled to 0-1 then normalised with ``mean`` / ``std``
    proposals   float32 (R, 4) in resized (and possibly flipped) pixels
    image_size  (h, w) of the resized, unpadded image
    flipped     bool
    scale       h / H, the resize factor (the width factor differs only by rounding)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "DetectionTransform", "train_transform", "test_transform"]

# torchvision's ImageNet weights expect RGB in 0-1 normalised with these.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# docs/METHOD.md §8 (reference code, VOC 2007).
TRAIN_SCALES = (480, 576, 688, 864, 1000, 1200)
MAX_SIZE = 2000


class DetectionTransform:
    """Resize the shorter side to a scale drawn uniformly from ``scales`` (longer side at most
    ``max_size``), flip horizontally with probability ``flip_prob``, convert to normalised float.

    With one scale and ``flip_prob`` 0 or 1 the transform is deterministic (``test_transform``).
    Randomness comes from torch's global generator, which data-loader workers seed per worker.
    """

    def __init__(
        self,
        scales: Sequence[int],
        max_size: int | None = MAX_SIZE,
        *,
        flip_prob: float = 0.0,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        scales = [int(s) for s in scales]
        if not scales or min(scales) <= 0:
            raise ValueError(f"scales must be positive sizes, got {scales}")
        if max_size is not None and max(scales) >= max_size:
            # torchvision's Resize requires it: otherwise the cap would make the scale meaningless.
            raise ValueError(f"max_size ({max_size}) must be larger than every scale ({scales})")
        if not 0.0 <= flip_prob <= 1.0:
            raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
        self.scales, self.max_size, self.flip_prob = tuple(scales), max_size, flip_prob
        # Resize(int) sets the shorter side exactly (RandomShortestSize truncates it to scale - 1 at times).
        resizes = [v2.Resize(s, max_size=max_size, antialias=True) for s in scales]
        self.resize = resizes[0] if len(resizes) == 1 else v2.RandomChoice(resizes)
        self.to_float = v2.Compose(
            [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
        )

    def __call__(self, item: dict) -> dict:
        original_height = item["image"].shape[-2]
        image, proposals = self.resize(item["image"], item["proposals"])
        # The flip is drawn here rather than by RandomHorizontalFlip because evaluation needs to know it.
        flipped = self.flip_prob > 0 and bool(torch.rand(()) < self.flip_prob)
        if flipped:
            image, proposals = F.horizontal_flip(image), F.horizontal_flip(proposals)
        image = self.to_float(image)
        height, width = image.shape[-2:]
        out = dict(item)
        out.update(
            image=image.as_subclass(Tensor),
            proposals=proposals.as_subclass(Tensor),
            image_size=(int(height), int(width)),
            flipped=flipped,
            scale=height / original_height,
        )
        return out

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(scales={self.scales}, max_size={self.max_size}, flip_prob={self.flip_prob})"


def train_transform(
    scales: Sequence[int] = TRAIN_SCALES, max_size: int | None = MAX_SIZE, flip_prob: float = 0.5, **normalize
) -> DetectionTransform:
    """Multi-scale training: random shorter side from ``scales``, random flip (docs/METHOD.md §8 defaults)."""
    return DetectionTransform(scales, max_size, flip_prob=flip_prob, **normalize)


def test_transform(
    scale: int, max_size: int | None = MAX_SIZE, flip: bool = False, **normalize
) -> DetectionTransform:
    """Deterministic: shorter side ``scale``, flipped iff ``flip`` (one pass of test-time augmentation)."""
    return DetectionTransform([scale], max_size, flip_prob=1.0 if flip else 0.0, **normalize)


# pytest would otherwise try to collect ``test_transform`` from modules that import it.
test_transform.__test__ = False
