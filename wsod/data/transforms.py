"""Training and test transforms of a dataset item: resize the shorter side, flip, normalise.

The geometry is torchvision's (``transforms.v2`` on ``tv_tensors``), so proposals follow the image
through every step: resize scales x by ``w / W`` and y by ``h / H``; a horizontal flip maps
``x -> w - x`` (``x1' = w - x2``, ``x2' = w - x1``), which is its own inverse, so flipping detections back
for test-time augmentation is the same call (``horizontal_flip``: torchvision's kernel for boxes).
torchvision treats coordinates as continuous, while wsod's are 0-based inclusive (see
``wsod.data.box_formats``); on flipped images this places boxes one resized pixel to the right of the
exact pixel mirror, well below what a stride-16 feature map resolves, and it cancels when flipping back.

Every geometric field of the item's ``targets`` (``wsod.data.targets``: ``points``, ``*_points``,
``boxes``, ``*_boxes``) moves with the image and the proposals, in ``DetectionTransform.__call__`` alone:
one resize call takes (image, proposals, geometry) at once, and ``horizontal_flip`` flips each. Points
keep the boxes' rule ``x -> w - x`` too: torchvision 0.29's keypoint kernel (``horizontal_flip_keypoints``
in ``torchvision/transforms/v2/functional/_geometry.py``) mirrors pixel indices instead, ``x -> w - 1 - x``,
one pixel left of the boxes, while its keypoint resize is the boxes' one. With the boxes' flip, points,
boxes and proposals follow one affine map, so a point on a proposal's edge stays on it (a method matching
points to proposals sees the same matches in a flipped image). A geometric step added later goes in the
same place and keeps that rule (check torchvision's kernel for each kind, as for the flip).

Training images may also get AlexNet-style PCA lighting noise (``Lighting``): a random colour offset
added to the RGB 0-1 image before normalisation, where the reference code adds it (after ``ToTensor``,
before its ``Normalize``), with the same ImageNet eigenvalues and RGB eigenvectors.

Item keys added or replaced (the rest pass through; ``gt_*`` stay in original pixels for evaluation):

    image       float32 (3, h, w), RGB scaled to 0-1, lighting noise added (training), then normalised
                with ``mean`` / ``std``
    proposals   float32 (R, 4) in resized (and possibly flipped) pixels
    targets     when the item has them: the same dict with plain tensors, geometry in resized (and
                possibly flipped) pixels, the other fields unchanged
    image_size  (h, w) of the resized, unpadded image
    flipped     bool
    scale       h / H, the resize factor (the width factor differs only by rounding)
    proposal_ids int64 (R,), each proposal's index in the image's proposal list as the dataset gave it:
                ``arange(R)`` when the item has none, else the item's own, passed through (a later step
                that drops proposals, ``PartialLabelRoiSampler``, drops their ids with them)

With ``true_boxes=True`` (the first stage's training set, ``wsod.build.build_train_dataset``) an item that
has ground truth also gets copies of its ``gt_boxes`` and ``gt_labels`` in its targets as ``true_boxes``
and ``true_labels`` (``wsod.data.targets.TRUE_BOXES``), moved by the same resize and flip as the
proposals, so that the training log can score the pseudo boxes in the batch's pixels
(``wsod.engine.pseudo_label_quality``). No method reads them; ``gt_*`` themselves stay in original pixels.

Several views of one image (``MultiViewTransform``, ``data.train.views``): the random transform called
once per view on the same untransformed item, so each view draws its own scale, flip and lighting, in
turn, from the item's seeded stream (``WeakDetectionDataset`` seeds it once per item: a resumed run draws
the same views). ``proposal_ids`` says which ROI of one view is which ROI of another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from wsod.data.targets import TRUE_BOXES, TRUE_LABELS, geometry_of, plain_targets

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGENET_PCA_EIGVAL",
    "IMAGENET_PCA_EIGVEC",
    "Lighting",
    "DetectionTransform",
    "MultiViewTransform",
    "horizontal_flip",
    "train_transform",
    "test_transform",
]

# torchvision's ImageNet weights expect RGB in 0-1 normalised with these.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# docs/METHOD.md §8 (reference code, VOC 2007).
TRAIN_SCALES = (480, 576, 688, 864, 1000, 1200)
MAX_SIZE = 2000

# PCA of the ImageNet RGB pixel colours on the 0-1 scale (AlexNet's lighting augmentation; the constants the
# reference code uses, in data/transforms/build.py): eigenvalues, and eigenvectors as the columns of the
# matrix, rows in R, G, B order. The reference's noise standard deviation is 0.1.
IMAGENET_PCA_EIGVAL = (0.2175, 0.0188, 0.0045)
IMAGENET_PCA_EIGVEC = (
    (-0.5675, 0.7192, 0.4009),
    (-0.5808, -0.0045, -0.8140),
    (-0.5836, -0.6948, 0.4203),
)
LIGHTING_STD = 0.1


class Lighting(torch.nn.Module):
    """AlexNet-style PCA lighting noise on a float RGB image (3, H, W) on the 0-1 scale.

    Draws ``alpha ~ N(0, std^2)`` per eigenvector (three draws from torch's global generator) and adds
    the same colour offset ``eigvec @ (alpha * eigval)`` to every pixel; no clamping, as in the
    reference. ``std`` 0 returns the image unchanged and draws nothing. A torchvision v2 style image
    transform: use it inside ``v2.Compose`` between ``ToDtype(scale=True)`` and ``Normalize``.
    """

    def __init__(
        self,
        std: float = LIGHTING_STD,
        eigval: Sequence[float] = IMAGENET_PCA_EIGVAL,
        eigvec: Sequence[Sequence[float]] = IMAGENET_PCA_EIGVEC,
    ) -> None:
        super().__init__()
        if std < 0:
            raise ValueError(f"the lighting noise std must be >= 0, got {std}")
        self.std = float(std)
        self.register_buffer("eigval", torch.tensor(eigval, dtype=torch.float32), persistent=False)
        self.register_buffer("eigvec", torch.tensor(eigvec, dtype=torch.float32), persistent=False)

    def forward(self, image: Tensor) -> Tensor:
        if self.std == 0:
            return image
        alpha = torch.randn(3) * self.std
        offset = self.eigvec @ (alpha * self.eigval)
        noisy = image.as_subclass(Tensor) + offset.to(image.dtype).view(3, 1, 1)
        return tv_tensors.wrap(noisy, like=image) if isinstance(image, tv_tensors.TVTensor) else noisy

    def extra_repr(self) -> str:
        return f"std={self.std}"


class DetectionTransform:
    """Resize the shorter side to a scale drawn uniformly from ``scales`` (longer side at most
    ``max_size``), flip horizontally with probability ``flip_prob``, convert to float RGB 0-1, add PCA
    lighting noise of standard deviation ``lighting_std`` (``Lighting``; 0: none), normalise. The
    proposals and every geometric field of ``targets`` move with the image (the module docstring).

    With one scale, ``flip_prob`` 0 or 1 and ``lighting_std`` 0 the transform is deterministic
    (``test_transform``). Randomness comes from torch's global generator, drawn in a fixed order (scale,
    flip, lighting), which ``WeakDetectionDataset`` seeds per image for ``(index, seed)`` items.
    ``true_boxes``: also carry an item's ground truth into its targets as ``true_boxes`` /
    ``true_labels`` (the module docstring); it draws no random number, so the augmentation is the same.
    """

    def __init__(
        self,
        scales: Sequence[int],
        max_size: int | None = MAX_SIZE,
        *,
        flip_prob: float = 0.0,
        lighting_std: float = 0.0,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        true_boxes: bool = False,
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
        self.lighting_std = float(lighting_std)
        self.true_boxes = bool(true_boxes)
        # Resize(int) sets the shorter side exactly (RandomShortestSize truncates it to scale - 1 at times).
        resizes = [v2.Resize(s, max_size=max_size, antialias=True) for s in scales]
        self.resize = resizes[0] if len(resizes) == 1 else v2.RandomChoice(resizes)
        self.to_float = v2.Compose(
            [
                v2.ToDtype(torch.float32, scale=True),
                Lighting(lighting_std),
                v2.Normalize(list(mean), list(std)),
            ]
        )

    def __call__(self, item: dict) -> dict:
        """The transformed item (a new dict; ``item`` and its ``targets`` are left as they were, so
        test-time augmentation can transform one item once per view)."""
        original_height = item["image"].shape[-2]
        targets = item.get("targets")
        if self.true_boxes and item.get("gt_boxes") is not None:
            targets = _with_true_boxes(item, targets)
        # Plain geometric fields (hand-built items) are taken to be on the image's canvas.
        geometry = {} if targets is None else geometry_of(targets, tuple(item["image"].shape[-2:]))
        # One call moves the image, the proposals and every geometric field (and draws one scale).
        image, proposals, geometry = self.resize(item["image"], item["proposals"], geometry)
        # The flip is drawn here rather than by RandomHorizontalFlip because evaluation needs to know it.
        flipped = self.flip_prob > 0 and bool(torch.rand(()) < self.flip_prob)
        if flipped:
            image, proposals = horizontal_flip(image), horizontal_flip(proposals)
            geometry = {name: horizontal_flip(value) for name, value in geometry.items()}
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
        if targets is not None:
            out["targets"] = plain_targets({**targets, **geometry})
        ids = item.get("proposal_ids")
        if ids is not None and len(ids) != len(proposals):
            raise ValueError(
                f"item {item.get('image_id')!r}: proposal_ids has {len(ids)} values for {len(proposals)}"
                " proposals; give one id per proposal, or none (ids 0..R-1 are made)"
            )
        out["proposal_ids"] = torch.arange(len(proposals)) if ids is None else ids
        return out

    def __repr__(self) -> str:
        name = type(self).__name__
        carried = ", true_boxes=True" if self.true_boxes else ""
        return (
            f"{name}(scales={self.scales}, max_size={self.max_size}, flip_prob={self.flip_prob},"
            f" lighting_std={self.lighting_std}{carried})"
        )


def _with_true_boxes(item: dict, targets: dict | None) -> dict:
    """A new targets dict: ``targets`` (the item's labels alone when it has none) plus copies of the
    item's ground truth, ``true_boxes`` (G, 4) on the untransformed image's canvas (so that the resize
    and the flip move them with the proposals) and ``true_labels`` (G,) int64."""
    canvas = tuple(item["image"].shape[-2:])
    boxes = torch.as_tensor(item["gt_boxes"], dtype=torch.float32).reshape(-1, 4).clone()
    labels = torch.as_tensor(item["gt_labels"], dtype=torch.int64).reshape(-1).clone()
    return {
        **(targets if targets is not None else {"labels": item["labels"]}),
        TRUE_BOXES: tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=canvas),
        TRUE_LABELS: labels,
    }


class MultiViewTransform:
    """Item -> list of ``views`` items, each ``transform`` applied to the same untransformed item (the
    module docstring). ``transform`` must leave its input as it was (``DetectionTransform`` does, and so
    does ``PartialLabelRoiSampler`` after it): every view starts from the item the dataset loaded.

    The views are drawn in order from torch's global generator, which ``WeakDetectionDataset`` seeds
    once per ``(index, seed)`` item, so view v of an item is the same in every run. ``collate`` stacks
    the lists image-major (``wsod.data.loader``); training wraps its transform only when
    ``data.train.views`` > 1, so one view stays a plain dict item.
    """

    def __init__(self, transform: Callable[[dict], dict], views: int) -> None:
        if isinstance(views, bool) or not isinstance(views, int) or views < 1:
            raise ValueError(f"views must be an integer >= 1 (data.train.views), got {views!r}")
        self.transform, self.views = transform, views

    def __call__(self, item: dict) -> list[dict]:
        return [self.transform(item) for _ in range(self.views)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transform!r}, views={self.views})"


def horizontal_flip(value: Tensor) -> Tensor:
    """``value`` (a tv_tensor: image, boxes or points) mirrored left-right, every coordinate by the
    boxes' rule ``x -> w - x`` (the module docstring says why points do not use torchvision's kernel).
    Its own inverse, so test-time augmentation flips detections back with the same rule."""
    if isinstance(value, tv_tensors.KeyPoints):
        points = value.as_subclass(Tensor).clone()
        points[..., 0] = value.canvas_size[1] - points[..., 0]
        return tv_tensors.wrap(points, like=value)
    return F.horizontal_flip(value)


def train_transform(
    scales: Sequence[int] = TRAIN_SCALES,
    max_size: int | None = MAX_SIZE,
    flip_prob: float = 0.5,
    lighting_std: float = LIGHTING_STD,
    *,
    true_boxes: bool = False,
    **normalize,
) -> DetectionTransform:
    """Multi-scale training: random shorter side from ``scales``, random flip, PCA lighting noise
    (docs/METHOD.md §8 defaults: the reference's, lighting std 0.1; 0 turns it off). ``true_boxes``:
    carry the ground truth into the targets for the pseudo-label quality log (``DetectionTransform``)."""
    return DetectionTransform(
        scales, max_size, flip_prob=flip_prob, lighting_std=lighting_std, true_boxes=true_boxes, **normalize
    )


def test_transform(
    scale: int, max_size: int | None = MAX_SIZE, flip: bool = False, **normalize
) -> DetectionTransform:
    """Deterministic: shorter side ``scale``, flipped iff ``flip`` (one pass of test-time augmentation)."""
    return DetectionTransform([scale], max_size, flip_prob=1.0 if flip else 0.0, **normalize)


# pytest would otherwise try to collect ``test_transform`` from modules that import it.
test_transform.__test__ = False
