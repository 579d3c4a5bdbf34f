"""Pseudo-labelling time per image of the refinement methods (MIST, OICR, PCL, CBL) on synthetic inputs.

What one student's labelling costs for one image: ``method.pseudo_labels`` on R proposals with C class
scores of which a few classes are present, timed on the device the scores live on (CUDA timings wait
for the device). A training step labels every image once per student. ``cbl_rcnn`` is CBL's other
labelling, once per image and step: its R-CNN head's multi-seeds (``CBLMethod.rcnn_pseudo_labels``
after the switch), from three students' and a teacher's scores (the synthetic scores, rolled along the
ROIs so that each branch ranks them differently).

Inputs are synthetic but shaped like training's: boxes of random position and size in a 600 x 1000
image, and source scores as the MIL teacher makes them (softmax over classes x softmax over the ROIs,
from random logits of the given ``sharpness``: larger means a few proposals stand out, as once trained).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from wsod.modeling.cbl import CBLMethod
from wsod.modeling.detector import METHODS
from wsod.modeling.method import TrainingProgress

__all__ = ["LabelingTime", "LABELINGS", "synthetic_image", "time_labeling", "format_table"]

# Labellings besides each method's per-student ``pseudo_labels``: name -> the labelling of one image.
LABELINGS: dict[str, Callable[[Tensor, Tensor, dict[str, Tensor]], object]] = {
    "cbl_rcnn": lambda proposals, scores, targets: CBLMethod().rcnn_pseudo_labels(
        proposals,
        [scores, scores.roll(1, dims=0), scores.roll(2, dims=0)],
        torch.cat([scores.new_zeros(len(scores), 1), scores.roll(3, dims=0)], dim=1),
        targets["labels"],
        TrainingProgress(1, 2),
    ),
}


@dataclass(frozen=True)
class LabelingTime:
    method: str
    device: str
    proposals: int
    positive_classes: int
    median_ms: float
    min_ms: float
    repeats: int


def synthetic_image(
    num_proposals: int,
    num_classes: int,
    positive_classes: int,
    *,
    sharpness: float = 3.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(proposals (R, 4) xyxy, source scores (R, C), targets {"labels": (C,)}) of one synthetic image."""
    generator = torch.Generator().manual_seed(seed)
    xy = torch.rand(num_proposals, 2, generator=generator) * torch.tensor([800.0, 450.0])
    wh = torch.rand(num_proposals, 2, generator=generator) * torch.tensor([200.0, 150.0]) + 8
    proposals = torch.cat([xy, (xy + wh).minimum(torch.tensor([1000.0, 600.0]))], dim=1)
    logits = torch.randn(num_proposals, num_classes, 2, generator=generator) * sharpness
    scores = torch.softmax(logits[..., 0], dim=1) * torch.softmax(logits[..., 1], dim=0)
    labels = torch.zeros(num_classes)
    labels[torch.randperm(num_classes, generator=generator)[:positive_classes]] = 1
    return proposals.to(device), scores.to(device), {"labels": labels.to(device)}


def time_labeling(
    method_name: str,
    num_proposals: int,
    *,
    num_classes: int = 20,
    positive_classes: int = 3,
    repeats: int = 20,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LabelingTime:
    """Median and least time of ``repeats`` calls of one student's ``pseudo_labels`` (student 2: its
    source is a student's softmax, as for every student after the first), after ``warmup`` calls."""
    if method_name in LABELINGS:
        labeling = LABELINGS[method_name]
    elif method_name in METHODS:
        method = METHODS[method_name]()
        if not method.trains_students:
            raise ValueError(f"method '{method_name}' trains no students: it makes no pseudo-labels")
        labeling = partial(method.pseudo_labels, 2)
    else:
        known = sorted([*METHODS, *LABELINGS])
        raise ValueError(f"unknown method '{method_name}': expected one of {known}")
    device = torch.device(device)
    proposals, scores, targets = synthetic_image(
        num_proposals, num_classes, positive_classes, seed=seed, device=device
    )
    times = []
    for call in range(warmup + repeats):
        _synchronize(device)
        start = time.perf_counter()
        labeling(proposals, scores, targets)
        _synchronize(device)
        if call >= warmup:
            times.append((time.perf_counter() - start) * 1000)
    return LabelingTime(
        method_name,
        str(device),
        num_proposals,
        positive_classes,
        statistics.median(times),
        min(times),
        repeats,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_table(results: Sequence[LabelingTime]) -> str:
    """A markdown table, one row per measurement, with the time relative to MIST's at the same size."""
    mist = {(r.device, r.proposals): r.median_ms for r in results if r.method == "mist"}
    lines = [
        "| method | device | proposals | positive classes | median ms per image | min ms | vs MIST |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = mist.get((r.device, r.proposals))
        ratio = f"{r.median_ms / base:.2f}" if base else "-"
        lines.append(
            f"| {r.method} | {r.device} | {r.proposals} | {r.positive_classes} | {r.median_ms:.2f} |"
            f" {r.min_ms:.2f} | {ratio} |"
        )
    return "\n".join(lines)
