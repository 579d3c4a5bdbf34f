"""Score pseudo-labelled training images by a second-stage detector's loss on their pseudo boxes, and keep
the k lowest: SoS-WSOD's split of the third stage (issue 38; suilin0432/SoS-WSOD, no licence, read for
facts only: ``unbias/split_single.py`` and ``unbias/configs/code_release/voc_split.yaml``).

An image's score is the plain sum of Faster R-CNN's four training losses (RPN objectness and box, ROI
classification and box) against its pseudo boxes, with both samplers' positive fraction at 1.0 (the
reference's split config, lines 11 and 17: no cap on the positives; negatives still fill the rest of
each sampler's batch). The lower the loss, the more the detector agrees with the image's pseudo boxes,
and the more likely they are right.

Departures, for a split that is a function of its inputs: the reference scores each image once at a
random training view with unseeded samplers, its model in training mode (BatchNorm included); wsod
scores the view its caller gives (one per image), draws each image's samplers from ``seed + index`` on a
forked generator (the caller's stream is left as it was), and keeps normalisation layers in eval mode
(their running statistics are the trained model's, and scoring changes none). Ties in the loss keep the
images' order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsod.data.loader import model_inputs

__all__ = ["ImageLoss", "scoring_mode", "image_losses", "lowest_loss"]


@dataclass(frozen=True)
class ImageLoss:
    """One image's score: ``loss``, the plain sum of ``losses`` (the detector's named training losses)."""

    image_id: str
    loss: float
    losses: dict[str, float]


@contextmanager
def scoring_mode(model: nn.Module, positive_fraction: float = 1.0) -> Iterator[None]:
    """``model`` (a ``FasterRCNNDetector``) computing its training losses with both samplers' positive
    fraction at ``positive_fraction`` and its BatchNorm layers in eval mode; every mode and fraction is
    restored on exit."""
    detector = model.detector
    samplers = [detector.rpn.fg_bg_sampler, detector.roi_heads.fg_bg_sampler]
    fractions = [sampler.positive_fraction for sampler in samplers]
    modes = {module: module.training for module in model.modules()}
    try:
        model.train()
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        for sampler in samplers:
            sampler.positive_fraction = positive_fraction
        yield
    finally:
        for sampler, fraction in zip(samplers, fractions, strict=True):
            sampler.positive_fraction = fraction
        for module, mode in modes.items():
            module.training = mode


@torch.no_grad()
def image_losses(
    model: nn.Module,
    batches: Iterable[dict[str, Any]],
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    positive_fraction: float = 1.0,
) -> list[ImageLoss]:
    """Each image's ``ImageLoss`` under ``scoring_mode``: ``batches`` are ``wsod.data.loader.collate``
    batches of one image each (its pseudo boxes as ``boxes`` / ``box_labels`` targets); image i's
    samplers draw from ``seed + i``."""
    device = torch.device(device)
    results = []
    with scoring_mode(model, positive_fraction):
        for index, batch in enumerate(batches):
            if len(batch["image_ids"]) != 1:
                raise ValueError(f"image_losses scores one image per batch, got {len(batch['image_ids'])}")
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed + index)
                losses = model(**model_inputs(batch, device)).losses
            values = {name: float(value) for name, value in losses.items()}
            results.append(ImageLoss(str(batch["image_ids"][0]), sum(values.values()), values))
    return results


def lowest_loss(scores: Sequence[ImageLoss], k: int) -> list[str]:
    """The ids of the ``k`` images of lowest loss, lowest first (equal losses in the given order)."""
    if not 0 <= k <= len(scores):
        raise ValueError(f"k must be in 0..{len(scores)} (the scored images), got {k}")
    order = sorted(range(len(scores)), key=lambda i: (scores[i].loss, i))
    return [scores[i].image_id for i in order[:k]]
