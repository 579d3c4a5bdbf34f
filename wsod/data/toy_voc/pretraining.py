"""The VOC-like set's "ImageNet": a base pretrained on object-centric images of its classes.

Every method the benchmark compares starts, in its paper, from an ImageNet classifier: the base has seen
its classes, centred and large, long before it meets a cluttered VOC scene with image-level labels. A toy
base trained from scratch has not, and on toy_voc it learns the classes so slowly within the recipe's
budget that every method sits near random (docs/RESULTS.md, the toy_voc calibration). This module draws
the missing step: single-label images of one object of toy_voc's 20 classes, centred and large on the
same cluttered backgrounds (``render_object_centric_image``), and trains the toy model's trunk (the
quarter-width ResNet-18, train-mode BatchNorm, GroupNorm res5) on them with a linear classifier
(``pretrain_toy_voc_base``). The file it writes has torchvision's ResNet keys, so ``model.weights`` loads
it the way it loads ImageNet's.

Like ImageNet, the pretraining images are not the benchmark's: they are drawn from their own seed stream
(``[generator_seed, number, 1]``; the scenes use ``[generator_seed, number]``), hold one object and no
occlusion, and carry no boxes. The folder follows ``wsod.data.generated``'s rules (a manifest, never a
silent reuse, an atomic rename into place).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchvision.transforms.v2 import functional as F

from wsod.atomic import atomic_write
from wsod.data.generated import ensure_generated
from wsod.data.toy_voc.generator import (
    FORMAT_VERSION,
    TOY_VOC_CLASSES,
    _background,
    _lay_out,
    _paint,
    _render_object,
    check_generator_seed,
)
from wsod.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from wsod.modeling.resnet import build_resnet_trunk
from wsod.progress import progress_bar

__all__ = [
    "BASE_FILE",
    "BASE_STEPS",
    "PRETRAIN_FORMAT",
    "ensure_toy_voc_base",
    "pretrain_toy_voc_base",
    "render_object_centric_image",
    "render_pretraining_images",
]

logger = logging.getLogger(__name__)

PRETRAIN_FORMAT = 2  # bump with any change to what is drawn or how the base is trained
BASE_FILE = "resnet18_w0.25.pth"
BASE_STEPS = 2000  # 20,000 images, 6.4 epochs of batch 64: 97.7% held-out top-1 on format 3 (RESULTS)
MANIFEST_NAME = "toy_voc_base.json"
NUM_IMAGES = 20_000  # the fixed training set, seen over several epochs (ImageNet's 1.28 M over 90)
NUM_VAL = 1000  # held-out images (drawn after the training ones) for the reported top-1 accuracy
IMAGE_SIZE = 128  # pixels, square: ImageNet's 224 over its objects' size, scaled to toy_voc's objects
OBJECT_SIDE = (0.5, 0.9)  # of the image side: ImageNet's objects fill most of the frame
# The toy model's trunk (configs/model/r18_c4.yaml): the base in train-mode BatchNorm, res5 in GroupNorm,
# and no max pooling in the stem. toy_voc's objects are small in pixels (median side about 117 px at the
# 288 px test scale), so with torchvision's stem res4 would see 211 px, twice an object, where VGG16's
# conv5_3 sees about one VOC object; a fragment's pooled features then carry its whole object and
# outscore it. Without the pooling res4 sees 107 px (docs/RESULTS.md, the toy_voc calibration: WSDDN's
# CorLoc 8.6 -> 26.4 from the frozen base).
ARCH = {"depth": 18, "width": 0.25, "norm": "bn", "neck_norm": "gn", "stem_pool": False}


def render_object_centric_image(
    generator_seed: int, number: int, size: int = IMAGE_SIZE
) -> tuple[np.ndarray, int]:
    """Pretraining image ``number``: (size, size, 3) uint8 RGB holding one object of class
    ``number % 20`` (every class equally often), centred within a tenth of the side, on a toy_voc
    background; and its class."""
    rng = np.random.default_rng([generator_seed, number, 1])
    cls = number % len(TOY_VOC_CLASSES)
    image = _background(rng, size, size)
    side = size * rng.uniform(*OBJECT_SIDE)
    centre = size / 2 + rng.uniform(-0.1, 0.1, 2) * size
    obj = _lay_out(cls, float(side), (float(centre[0]), float(centre[1])), rng)
    _render_object(obj)
    _paint(image, obj, rng)
    return np.clip(np.round(image), 0, 255).astype(np.uint8), cls


def render_pretraining_images(
    generator_seed: int, num_images: int, *, first: int = 0, progress: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pretraining images ``first`` .. ``first + num_images - 1``: (N, S, S, 3) uint8 RGB and (N,) int64
    classes. Drawn once and kept in memory (20,000 images: 1 GB, about 80 s on one core): like ImageNet, a
    fixed set seen over several epochs."""
    images = torch.empty(num_images, IMAGE_SIZE, IMAGE_SIZE, 3, dtype=torch.uint8)
    labels = torch.empty(num_images, dtype=torch.int64)
    for i in progress_bar(range(num_images), shown=progress, desc="toy_voc base images"):
        pixels, labels[i] = render_object_centric_image(generator_seed, first + i)
        images[i] = torch.from_numpy(pixels)
    return images, labels


def _normalised(images: torch.Tensor) -> torch.Tensor:
    """(N, S, S, 3) uint8 -> (N, 3, S, S) float32 in 0-1, normalised like the detector's inputs."""
    scaled = F.to_dtype(images.permute(0, 3, 1, 2), torch.float32, scale=True)
    return F.normalize(scaled, IMAGENET_MEAN, IMAGENET_STD)


class _Classifier(nn.Module):
    """The trunk, global average pooling and a linear layer: torchvision's ResNet classifier."""

    def __init__(self, trunk: nn.Module, channels: int, num_classes: int):
        super().__init__()
        self.trunk = trunk
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        t = self.trunk
        x = t.maxpool(t.relu(t.bn1(t.conv1(images))))
        x = t.layer4(t.layer3(t.layer2(t.layer1(x))))
        return self.fc(x.mean((2, 3)))


def _accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` (eval mode) on uint8 ``images`` (N, S, S, 3) with classes ``labels``."""
    model.eval()
    with torch.no_grad():
        right = sum(
            int((model(_normalised(images[i : i + 100])).argmax(1) == labels[i : i + 100]).sum())
            for i in range(0, len(labels), 100)
        )
    model.train()
    return right / max(len(labels), 1)


def pretrain_toy_voc_base(
    path: str | os.PathLike,
    *,
    generator_seed: int = 0,
    steps: int = BASE_STEPS,
    batch_size: int = 64,
    lr: float = 0.1,
    weight_decay: float = 1e-4,
    num_images: int | None = None,
    num_val: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Train the toy trunk on object-centric images and write its state dict (torchvision's keys, the
    classifier as ``fc.*``) to ``path``, from ``num_images`` drawn images (None: ``NUM_IMAGES``, or
    ``steps * batch_size`` when fewer). Returns what was measured: the held-out top-1 accuracy (on
    ``num_val`` images after the training ones; None: ``NUM_VAL``, fewer for a short run), the final
    loss, the seconds taken.

    The recipe is torchvision's ImageNet classification reference (references/classification/train.py's
    defaults: SGD, momentum 0.9, weight decay 1e-4, lr 0.1 for 8 GPUs x 32 images) with the lr scaled
    linearly to ``batch_size`` (Goyal et al., 2017), a cosine decay after a 5% linear warm-up, and
    horizontal flips.
    """
    generator_seed = check_generator_seed(generator_seed)
    if num_images is None:  # a short (test) run draws only what it sees
        num_images = min(NUM_IMAGES, steps * batch_size)
    if num_val is None:  # 1,000 held-out images, or a twentieth of a short run's (at least 100)
        num_val = min(NUM_VAL, max(100, num_images // 20))
    start = time.perf_counter()
    images, labels = render_pretraining_images(generator_seed, num_images, progress=progress)
    val_images, val_labels = render_pretraining_images(generator_seed, num_val, first=num_images)
    torch.manual_seed(seed)
    trunk = build_resnet_trunk(
        ARCH["depth"],
        width=ARCH["width"],
        norm=ARCH["norm"],
        neck_norm=ARCH["neck_norm"],
        stem_pool=ARCH["stem_pool"],
    )
    model = _Classifier(trunk, trunk.layer4[-1].conv2.out_channels, len(TOY_VOC_CLASSES))
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr * batch_size / 256, momentum=0.9, weight_decay=weight_decay
    )
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    order = torch.randperm(num_images)
    cursor, losses = 0, []
    model.train()
    for step in progress_bar(range(steps), shown=progress, desc="toy_voc base"):
        if cursor + batch_size > num_images:  # a new epoch: a new order
            order, cursor = torch.randperm(num_images), 0
        index = order[cursor : cursor + batch_size]
        cursor += batch_size
        batch = _normalised(images[index])
        flip = torch.rand(batch_size) < 0.5
        batch[flip] = batch[flip].flip(-1)
        loss = nn.functional.cross_entropy(model(batch), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % 250 == 0:
            logger.info("toy_voc base: step %d/%d, loss %.3f", step + 1, steps, np.mean(losses[-250:]))
    report = {
        "steps": steps,
        "batch_size": batch_size,
        "num_images": num_images,
        "val_top1": _accuracy(model, val_images, val_labels),
        "final_loss": float(np.mean(losses[-100:])),
        "seconds": round(time.perf_counter() - start, 1),
    }
    state = dict(trunk.state_dict())
    state.update({f"fc.{k}": v for k, v in model.fc.state_dict().items()})
    with atomic_write(path) as f:
        torch.save(state, f)
    return report


def base_manifest(generator_seed: int, steps: int) -> dict:
    """What a base folder's manifest holds for these settings."""
    return {
        "generator": "toy_voc_base",
        "format": PRETRAIN_FORMAT,
        "scenes_format": FORMAT_VERSION,
        "generator_seed": generator_seed,
        "steps": steps,
        "arch": dict(ARCH),
    }


def ensure_toy_voc_base(
    folder: str | os.PathLike, *, generator_seed: int = 0, steps: int = BASE_STEPS, progress: bool = False
) -> Path:
    """The pretrained base's file in ``folder`` ({data.root}/base), trained first if absent (about 12
    minutes on 2 CPU cores at the default ``steps``); the training's report is written beside it
    (``report.json``). A folder made with other settings or half-written is an error, never reused
    (``wsod.data.generated``)."""
    folder = Path(folder)
    generator_seed = check_generator_seed(generator_seed, "data.generator_seed")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"data.base_steps={steps!r}: expected a positive number of pretraining steps")

    def write(staging: Path) -> None:
        logger.info("pretraining the toy_voc base in %s (%d steps)", folder, steps)
        report = pretrain_toy_voc_base(
            staging / BASE_FILE, generator_seed=generator_seed, steps=steps, progress=progress
        )
        logger.info("toy_voc base: held-out top-1 %.3f", report["val_top1"])
        with atomic_write(staging / "report.json", "w") as f:
            json.dump(report, f, indent=1)

    ensure_generated(
        folder,
        base_manifest(generator_seed, steps),
        write,
        manifest_name=MANIFEST_NAME,
        what="a pretrained toy_voc base",
    )
    return folder / BASE_FILE
