"""Tensorboard images of what each student learns from, during training.

Every ``period`` optimizer steps a few fixed training images are drawn once per student k, each with
that student's pseudo ground truth at that moment (``WeaklySupervisedDetector.pseudo_labels``), under
``pseudo_labels/<index>_<image id>/student_<k>``. What a refinement method does while it trains shows
there: a pseudo box on part of an object (part domination), boxes that drift between students, a class
whose pseudo box never settles.

Drawn on each image, bottom to top: the foreground ROIs (labels > 0: the ROIs assigned to a pseudo box,
PCL's cluster members) thin in their class colour, the ground-truth boxes in white when the dataset has
them, and the pseudo boxes (MIST's picks, OICR's top boxes, PCL's cluster centres) thick in their class
colour, labelled "class score". A method whose records carry no pseudo boxes gets its foreground ROIs
only; an image without a positive class (no pseudo box) is drawn alone.

The images are the first ones of the training set, loaded without its random transform and resized
deterministically at the first training scale, so each image looks the same at every iteration and only
the pseudo-labels change. A preview never changes the run it watches: the model is put in eval mode for
the call (no dropout or DropBlock sample, no BatchNorm statistic updated) and each module's mode is put
back after it, gradients are off, and the random generators a checkpoint keeps are restored afterwards,
so that even a method that samples inside ``pseudo_labels`` leaves the run's random stream as it was.
"""

from __future__ import annotations

import bisect
import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.data import ConcatDataset, Dataset
from torchvision.transforms.v2 import functional as F
from torchvision.utils import draw_bounding_boxes, draw_keypoints

from wsod.data.loader import collate, model_inputs
from wsod.data.transforms import IMAGENET_MEAN, IMAGENET_STD, MAX_SIZE, test_transform
from wsod.engine.checkpoint import rng_state, set_rng_state
from wsod.engine.evaluate import PREVIEW_MAX_SIDE
from wsod.engine.visualize import GROUND_TRUTH_COLOUR, PALETTE, draw_detections, tag_safe
from wsod.modeling.method import PseudoLabels

__all__ = ["PseudoLabelPreview", "draw_pseudo_labels", "TAG"]

logger = logging.getLogger(__name__)

TAG = "pseudo_labels"  # the tensorboard tag prefix of every preview image
# Foreground ROIs are thin, so that hundreds of them still leave the image visible; the pseudo boxes over
# them take draw_detections' width (2) and its labels.
MEMBER_WIDTH = 1
POINT_RADIUS = 3  # pixels of a drawn point (partial labels)


class _ImageLog(Protocol):
    """What a preview needs of a ``wsod.engine.run_log.RunLog``."""

    def image(self, tag: str, image: Tensor, iteration: int) -> None: ...


@dataclass(frozen=True)
class _PreviewImage:
    """One fixed image: the detector's inputs for it alone and what is drawn under its records.

    tag: ``pseudo_labels/<index>_<image id>``;
    inputs: ``model_inputs`` of a one-image batch, on the device;
    canvas: uint8 (3, h', w'), the resized training image de-normalised, shrunk to ``max_side``;
    proposals: (R, 4) xyxy in the resized image's pixels (the ROIs the records label, in their order);
    ground_truth: (G, 4) xyxy in the resized image's pixels, or None when the dataset has no boxes;
    scale: (x, y) canvas pixels per resized-image pixel.
    """

    tag: str
    inputs: dict[str, Any]
    canvas: Tensor
    proposals: Tensor
    ground_truth: Tensor | None
    scale: tuple[float, float]


class PseudoLabelPreview:
    """Every ``period`` optimizer steps, each fixed image drawn once per student with its pseudo-labels.

    Args:
        items: the fixed images as transformed dataset items (``wsod.data.transforms.test_transform``
            output: ``image`` float32 (3, h, w) normalised, ``proposals`` (R, 4) in its pixels,
            ``targets`` with ``labels`` (C,), ``image_size``, ``original_size``, ``image_id``, and
            ``gt_boxes`` (G, 4) in original pixels where the dataset has boxes).
        class_names: the C class names (the labels of the pseudo boxes).
        period: optimizer steps between previews (>= 1; the training loop calls at multiples of it).
        device: where the model is; the inputs are prepared there once.
        max_side: longer side of the drawn images (the evaluation previews' size by default), which
            keeps the tensorboard file small.
        mean, std: the normalisation the transform applied, undone to draw on the image.
    """

    def __init__(
        self,
        items: Sequence[Mapping[str, Any]],
        class_names: Sequence[str],
        *,
        period: int,
        device: torch.device | str = "cpu",
        max_side: int = PREVIEW_MAX_SIDE,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        if period < 1:
            raise ValueError(f"the pseudo-label preview period must be >= 1 optimizer steps, got {period}")
        if not items:
            raise ValueError("a pseudo-label preview needs at least one image")
        self.period = int(period)
        self.class_names = tuple(class_names)
        self.device = torch.device(device)
        self.images = [
            _prepare(index, item, self.device, max_side, mean, std) for index, item in enumerate(items)
        ]
        self._no_students = False  # set at the first call for a method without students

    @classmethod
    def from_dataset(
        cls,
        dataset: Dataset,
        class_names: Sequence[str],
        *,
        num_images: int,
        scale: int,
        max_size: int | None = MAX_SIZE,
        period: int,
        device: torch.device | str = "cpu",
        max_side: int = PREVIEW_MAX_SIDE,
    ) -> PseudoLabelPreview:
        """The first ``num_images`` images of ``dataset`` (the training set, built with its random
        transform), loaded without that transform and resized by ``test_transform(scale, max_size)``:
        the same pixels at every preview, and no random number drawn to make them."""
        if num_images < 1:
            raise ValueError(f"a pseudo-label preview needs at least one image, got num_images={num_images}")
        transform = test_transform(scale, max_size)
        count = min(num_images, len(dataset))
        items = [transform(_untransformed_item(dataset, index)) for index in range(count)]
        return cls(items, class_names, period=period, device=device, max_side=max_side)

    def __call__(self, model: nn.Module, iteration: int, run_log: _ImageLog) -> None:
        """Log one image per (fixed image, student) at ``iteration`` under
        ``pseudo_labels/<index>_<image id>/student_<k>``; nothing for a method without students (said
        once in the log). ``model``: the detector, possibly DDP-wrapped (its module is called directly:
        no collective runs, so the main process alone may call this). Runs in the caller's autocast, so
        that the ROI features are those training computes its pseudo-labels from."""
        if self._no_students:
            return
        per_image = self._records(model)
        if not per_image[0]:
            self._no_students = True
            detector = _unwrap(model)
            method = type(getattr(detector, "method", detector)).__name__
            logger.info("pseudo-label previews: %s trains no students, so there is nothing to draw", method)
            return
        for image, students in zip(self.images, per_image, strict=True):
            for k, records in enumerate(students, start=1):
                picture = draw_pseudo_labels(
                    image.canvas, records[0], image.proposals, self.class_names,
                    ground_truth=image.ground_truth, scale=image.scale,
                    partial_labels=image.inputs["targets"][0],
                )  # fmt: skip
                run_log.image(f"{image.tag}/student_{k}", picture, iteration)

    def _records(self, model: nn.Module) -> list[list[list[PseudoLabels]]]:
        """``[image i][student k - 1]`` the one-image record list of each fixed image, computed in eval
        mode without gradients; every module's mode and the random generators restored after."""
        detector = _unwrap(model)
        modes = [(module, module.training) for module in model.modules()]
        generators = rng_state()
        model.eval()
        try:
            with torch.no_grad():
                # One image at a time: the memory of a one-image step, whatever the number of images.
                return [_per_image(detector, image.inputs) for image in self.images]
        finally:
            # Module by module: a submodule the caller keeps in eval mode stays so.
            for module, training in modes:
                module.training = training
            set_rng_state(generators)


def _per_image(detector: nn.Module, inputs: Mapping[str, Any]) -> list[list[PseudoLabels]]:
    """``[student k - 1]`` of ``[record]`` for a one-image batch (``[]`` without students)."""
    return detector.pseudo_labels(inputs["images"], inputs["proposals"], inputs["targets"])


def draw_pseudo_labels(
    canvas: Tensor,
    record: PseudoLabels,
    proposals: Tensor,
    class_names: Sequence[str],
    *,
    ground_truth: Tensor | None = None,
    scale: tuple[float, float] = (1.0, 1.0),
    partial_labels: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """One student's record of one image drawn on ``canvas`` uint8 (3, H, W).

    ``proposals`` (R, 4) xyxy are the ROIs ``record.labels`` (R,) labels, in the detector's pixels, as
    are ``record.pseudo_boxes`` (G, 4) and ``ground_truth`` (G', 4); ``scale`` (x, y) is the canvas's
    pixels per detector pixel (the canvas may be shrunk). Drawn bottom to top: the foreground ROIs
    (label c + 1) thin in class c's colour, the ground truth in white, the pseudo boxes thick in their
    class's colour labelled "class score" (``record.pseudo_classes``, ``record.pseudo_scores``), the
    best on top, and on top of all the image's partial labels when ``partial_labels`` (its targets
    dict) has them: points as dots and scribbles as paths in their class's colour (supervising boxes
    are pseudo boxes of score 1). Returns a new uint8 (3, H, W) image; ``canvas`` is left as it was.
    """
    factor = torch.tensor([scale[0], scale[1], scale[0], scale[1]])
    image = canvas.detach().cpu().clone()
    labels = record.labels.detach().cpu()
    foreground = labels > 0
    if foreground.any():  # draw_bounding_boxes warns on an empty box list
        colours = [PALETTE[c % len(PALETTE)] for c in (labels[foreground] - 1).tolist()]
        boxes = _drawable(proposals.detach().cpu().float()[foreground] * factor)
        image = draw_bounding_boxes(image, boxes, colors=colours, width=MEMBER_WIDTH)
    if ground_truth is not None and len(ground_truth):
        boxes = _drawable(ground_truth.detach().cpu().float().reshape(-1, 4) * factor)
        image = draw_bounding_boxes(image, boxes, colors=GROUND_TRUTH_COLOUR, width=1)
    if record.pseudo_boxes is not None and len(record.pseudo_boxes):
        detections = {
            "boxes": record.pseudo_boxes.detach().cpu().float() * factor,
            "scores": record.pseudo_scores,
            "labels": record.pseudo_classes,
        }
        image = draw_detections(image, detections, class_names)
    if partial_labels is not None:
        image = _draw_points_and_scribbles(image, partial_labels, factor[:2])
    return image


def _draw_points_and_scribbles(image: Tensor, targets: Mapping[str, Tensor], factor: Tensor) -> Tensor:
    """Points (``points``, ``point_labels``) as dots and scribbles (``scribble_points`` by
    ``scribble_ids``) as paths of small dots, in their class's colour (torchvision's ``draw_keypoints``)."""
    points = targets.get("points")
    if points is not None and len(points):
        for point, label in zip(
            points.detach().cpu().float() * factor, targets["point_labels"].tolist(), strict=True
        ):
            colour = PALETTE[label % len(PALETTE)]
            image = draw_keypoints(image, point.view(1, 1, 2), colors=colour, radius=POINT_RADIUS)
    strokes = targets.get("scribble_points")
    if strokes is not None and len(strokes):
        strokes = strokes.detach().cpu().float() * factor
        ids, labels = targets["scribble_ids"].cpu(), targets["scribble_labels"].cpu()
        for stroke in torch.unique(ids).tolist():
            path = strokes[ids == stroke]
            colour = PALETTE[int(labels[ids == stroke][0]) % len(PALETTE)]
            # The points themselves (a simulated scribble has one per pixel of its length): torchvision
            # draws connecting lines in white only.
            image = draw_keypoints(image, path[None], colors=colour, radius=1)
    return image


def _drawable(boxes: Tensor) -> Tensor:
    """Boxes that ``draw_bounding_boxes`` accepts: x2 >= x1 and y2 >= y1 (a degenerate box stays a line)."""
    return torch.cat([boxes[:, :2], torch.maximum(boxes[:, 2:], boxes[:, :2])], dim=1)


def _unwrap(model: nn.Module) -> nn.Module:
    """The detector inside a DistributedDataParallel wrapper (its ``pseudo_labels`` is not a forward)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _prepare(
    index: int,
    item: Mapping[str, Any],
    device: torch.device,
    max_side: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> _PreviewImage:
    """A transformed item as a ``_PreviewImage``: its inputs moved to ``device`` once, its canvas the
    de-normalised image shrunk so that its longer side is at most ``max_side``."""
    image = item["image"].detach().cpu().float()  # (3, h, w) normalised
    pixels = image * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
    canvas = (pixels * 255).round().clamp(0, 255).to(torch.uint8)
    height, width = canvas.shape[-2:]
    if max(height, width) > max_side:
        factor = max_side / max(height, width)
        size = [max(1, round(height * factor)), max(1, round(width * factor))]
        canvas = F.resize(canvas, size, antialias=True)
    # Per axis: the rounded sides make the two ratios differ slightly.
    scale = (canvas.shape[-1] / width, canvas.shape[-2] / height)
    ground_truth = None
    if item.get("gt_boxes") is not None:
        # Original pixels -> the resized image's (the transform leaves gt_boxes where they were).
        (h, w), (original_h, original_w) = item["image_size"], item["original_size"]
        to_resized = torch.tensor([w / original_w, h / original_h, w / original_w, h / original_h])
        ground_truth = torch.as_tensor(item["gt_boxes"]).float().reshape(-1, 4) * to_resized
    return _PreviewImage(
        tag=f"{TAG}/{index}_{tag_safe(item['image_id'])}",
        inputs=model_inputs(collate([dict(item)]), device),
        canvas=canvas,
        proposals=torch.as_tensor(item["proposals"]).detach().cpu().float(),
        ground_truth=ground_truth,
        scale=scale,
    )


def _untransformed_item(dataset: Dataset, index: int) -> dict[str, Any]:
    """Item ``index`` of ``dataset`` as loaded, before the dataset's own transform.

    Read through a shallow copy whose ``transform`` is None: the records and proposals are shared, so
    nothing is opened again (a COCO training set's annotations and proposal file take minutes and
    gigabytes to open), and the dataset the loader uses is untouched. A concatenation is resolved to
    the set holding the index.
    """
    if isinstance(dataset, ConcatDataset):
        which = bisect.bisect_right(dataset.cumulative_sizes, index)
        local = index - (dataset.cumulative_sizes[which - 1] if which else 0)
        return _untransformed_item(dataset.datasets[which], local)
    if not hasattr(dataset, "transform"):
        raise TypeError(
            "pseudo-label previews read the training images without their transform:"
            f" {type(dataset).__name__} has no transform attribute to leave out"
        )
    plain = copy.copy(dataset)
    plain.transform = None
    return plain[index]
