"""The strong photometric augmentation of a teacher–student stage (SoS-WSOD's third stage, issue 38).

SoS-WSOD trains its student on a strong view of each image: the weak view's geometry (resize, flip) with
photometric noise on top, so that the weak view's boxes (the teacher's pseudo boxes) stay the strong
view's. Its ops and parameters are unbiased-teacher's (``ubteacher/data/detection_utils.py``
``build_strong_augmentation``, lines 22-43; suilin0432/SoS-WSOD's copy, ``unbias/ubteacher/data/
detection_utils.py`` lines 22-44), in this order:

- colour jitter, brightness / contrast / saturation 0.4, hue 0.1, with probability 0.8;
- grayscale with probability 0.2;
- Gaussian blur of sigma drawn from [0.1, 2.0], with probability 0.5;
- three random-erasing passes (probability; area share; aspect ratio), each filling its rectangle with
  standard-normal noise: (0.7; 0.05-0.2; 0.3-3.3), (0.5; 0.02-0.2; 0.1-6), (0.3; 0.02-0.2; 0.05-8).

``strong_augmentation()`` applies them, with torchvision's ``transforms.v2``, to a float RGB 0-1 image
(3, h, w) after the geometry and before normalisation (the reference erases after its ``ToTensor``, on
the same 0-1 scale). Randomness comes from torch's global generator, which the dataset seeds per item,
so a resumed run draws the same strong views. Two deliberate differences: the blur is a 13-tap Gaussian
kernel (covering 3 sigma at the largest sigma; the reference uses PIL's box-blur approximation of a
Gaussian of that radius); and the image is RGB, where the reference hands its BGR array to PIL as RGB,
so that its hue jitter and grayscale weights act on swapped channels.

``WeakStrongViews`` makes the pair a training item of the third stage is: the weak view (the training
transform: multi-scale resize, flip) and the strong view, which is the weak view with these ops on its
pixels, so that both share one geometry (proposals, targets, size and flip are the weak view's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torchvision.transforms import v2

from wsod.data.transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["BLUR_KERNEL", "ERASING", "strong_augmentation", "WeakStrongViews"]

# The blur's kernel: 2 * ceil(3 * 2.0) + 1 taps, 3 sigma either side at the largest sigma.
BLUR_KERNEL = 13
# The three erasing passes: (probability, area share range, aspect ratio range).
ERASING = (
    (0.7, (0.05, 0.2), (0.3, 3.3)),
    (0.5, (0.02, 0.2), (0.1, 6.0)),
    (0.3, (0.02, 0.2), (0.05, 8.0)),
)


def strong_augmentation() -> v2.Compose:
    """The strong view's photometric ops (the module docstring), on a float RGB 0-1 image (3, h, w)."""
    return v2.Compose(
        [
            v2.RandomApply([v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.RandomApply([v2.GaussianBlur(kernel_size=BLUR_KERNEL, sigma=(0.1, 2.0))], p=0.5),
            *(v2.RandomErasing(p=p, scale=scale, ratio=ratio, value="random") for p, scale, ratio in ERASING),
        ]
    )


class WeakStrongViews:
    """Item -> ``[weak, strong]``: ``weak`` is ``transform(item)`` (a normalised training view); ``strong``
    is the same dict with its image un-normalised (``mean``, ``std``), passed through ``strong`` (default
    ``strong_augmentation()``) and normalised again. Both views come from the item's seeded stream, the
    weak view's draws first, so a resumed run sees the same pair. ``collate`` stacks the pairs as two
    views per image (``wsod.data.loader``: row ``2 i`` weak, row ``2 i + 1`` strong)."""

    def __init__(
        self,
        transform: Callable[[dict], dict],
        strong: Callable[[Tensor], Tensor] | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        self.transform = transform
        self.strong = strong_augmentation() if strong is None else strong
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, item: dict) -> list[dict]:
        weak = self.transform(item)
        if not isinstance(weak, dict):
            raise TypeError("WeakStrongViews wraps a transform giving one view (data.train.views must be 1)")
        pixels = weak["image"] * self.std + self.mean  # the RGB 0-1 image the strong ops expect
        strong_image = (self.strong(pixels) - self.mean) / self.std
        return [weak, {**weak, "image": strong_image}]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transform!r}, {self.strong!r})"
