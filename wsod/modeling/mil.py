"""WSDDN two-stream MIL teacher (Bilen & Vedaldi, 2016) as used by the MIST reference code.

Class-index convention of every (C+1)-way output in wsod: column 0 is background, column c + 1 is
foreground class c (image labels index the foreground classes 0..C-1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MILHead", "mil_loss", "binary_cross_entropy", "init_linear"]

# Image scores are clamped before the binary cross-entropy so that log() stays finite.
SCORE_EPS = 1e-10


def init_linear(layer: nn.Linear, std: float = 0.001) -> nn.Linear:
    """A head layer's reference initialisation: weights N(0, std), bias 0. The std is each method's
    (``RefinementMethod.mil_std``, ``student_cls_std``, ``student_box_std``): wetectron's 0.001 by default."""
    nn.init.normal_(layer.weight, std=std)
    nn.init.zeros_(layer.bias)
    return layer


class MILHead(nn.Module):
    """Two streams on ROI features: a classification softmax over classes and a detection softmax over
    the ROIs of each image; their product scores every ROI for every class. Both layers start at weights
    N(0, ``std``), bias 0 (the method's ``mil_std``)."""

    def __init__(self, in_features: int, num_classes: int, *, std: float = 0.001) -> None:
        super().__init__()
        self.cls_score = init_linear(nn.Linear(in_features, num_classes + 1), std)
        self.det_score = init_linear(nn.Linear(in_features, num_classes + 1), std)

    def forward(self, roi_features: Tensor, rois_per_image: list[int]) -> Tensor:
        """roi_features (R, D) of all images, concatenated in image order; rois_per_image sums to R.

        Returns the per-ROI scores s = softmax_classes(cls) * softmax_rois(det), (R, C+1); summing an
        image's rows gives its image-level class scores.
        """
        cls = F.softmax(self.cls_score(roi_features), dim=1)
        det_logits = self.det_score(roi_features)
        det = torch.cat([F.softmax(d, dim=0) for d in det_logits.split(rois_per_image)])
        return cls * det


def mil_loss(roi_scores: Tensor, rois_per_image: list[int], image_labels: Tensor) -> Tensor:
    """Binary cross-entropy of the image scores against the image labels.

    roi_scores (R, C+1) from ``MILHead``; image_labels (B, C) multi-hot over foreground classes.
    Per image: phi = sum of its ROI scores, clamped to [1e-10, 1 - 1e-10]; target = [0, labels]
    (background never present at image level). Averaged over the C+1 entries and over images.
    """
    image_scores = torch.stack([s.sum(dim=0) for s in roi_scores.split(rois_per_image)])
    # In at least float32 (BCE of reduced-precision scores loses the small ones).
    image_scores = image_scores.to(torch.promote_types(image_scores.dtype, torch.float32))
    image_scores = image_scores.clamp(SCORE_EPS, 1 - SCORE_EPS)
    background = image_labels.new_zeros(image_labels.shape[0], 1)
    targets = torch.cat([background, image_labels], dim=1).to(image_scores.dtype)
    return binary_cross_entropy(image_scores, targets)


def binary_cross_entropy(probabilities: Tensor, targets: Tensor) -> Tensor:
    """``F.binary_cross_entropy`` (mean reduction, logs clamped at -100) written out, with one difference:
    a NaN probability gives a NaN loss instead of an error. A diverging run produces NaN scores; the
    training loop must see a non-finite loss to skip the step and count it, not an exception from inside
    the loss ("all elements of input should be between 0 and 1"). Equal to torch's within a few ulps for
    valid inputs (tested; torch's loss takes each log from the C library, these from torch's vectorised
    kernels, which can differ in the last bit), and exactly at the -100 clamps. Autocast never applies:
    log and log1p are float32-or-wider ops here."""
    log_p = torch.log(probabilities).clamp_min(-100)
    log_not_p = torch.log1p(-probabilities).clamp_min(-100)
    return -(targets * log_p + (1 - targets) * log_not_p).mean()
