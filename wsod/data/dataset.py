"""The image-level dataset every format feeds: records (one per image) + a proposal file -> items.

A format reader (``voc.py``, ``coco.py``) turns its files into ``ImageRecord``s; ``WeakDetectionDataset``
loads the image, looks up and filters its proposals and applies the transform. Item (before transform):

    image          tv_tensors.Image uint8 (3, H, W), RGB
    image_id       the record's id (str for VOC, int for COCO)
    labels         (C,) float32 multi-hot over foreground classes 0..C-1
    targets        the image's supervision (``wsod.data.targets``): {"labels": the labels above, and the
                   record's ``supervision`` fields, geometry as tv_tensors in original pixels}
    proposals      tv_tensors.BoundingBoxes float32 (R, 4) xyxy, original pixels, R >= 1
    original_size  (H, W) of the decoded image
    gt_boxes (G, 4) float32, gt_labels (G,) int64, gt_difficult (G,) bool   (when the format has boxes)

Ground-truth boxes are for evaluation only and stay in original pixels through every transform; they
are not supervision and never enter ``targets`` (but for the first stage's training transform, which
copies them in as ``true_boxes`` / ``true_labels`` for the pseudo-label quality log, which no method
reads: ``wsod.data.targets``).

Bad input, and why each is an error or a skip:
- a listed image file that does not exist: ``FileNotFoundError`` at construction naming the first one and
  the count (``check_files``); a missing file is a broken download, and training must not start on it.
- an image that does not decode (corrupt or truncated): ``RuntimeError`` naming the file when the item is
  loaded; skipping it inside a worker would silently change batch composition and epoch length.
- a record's ``supervision`` that breaks the targets convention (a field named ``labels``, geometry of
  the wrong shape, outside the image, or a box with x2 < x1): ``ValueError`` at construction naming the
  image, its file and the field (``wsod.data.targets.check_supervision``); it would train on nonsense.
- an image id absent from the proposal file: ``MissingProposalsError`` at construction naming the id, the
  count and the file.
- an image whose size differs from the size the proposal file records for it (replaced or resized after
  its proposals were made): ``ProposalSizeError`` at construction naming the image, both sizes, the file
  and the command that remakes them; its boxes, clipped to the new picture, would train on nonsense.
- an image whose proposals are all filtered away: its whole-image box stands in, with a warning and a
  per-process counter (``num_whole_image_fallbacks``); one such image is no reason to stop a run.
- images without any image-level label (e.g. VOC xml without objects): kept, or dropped with one logged
  count when ``drop_unlabelled`` is set (docs/METHOD.md §9: COCO training drops them; evaluation must
  keep them).
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch.utils.data import ConcatDataset, Dataset
from torchvision import tv_tensors

from wsod.data.image_io import read_image_rgb, read_image_size
from wsod.data.partial_labels import attach_partial_labels, count_partial_labels
from wsod.data.proposals import ProposalSet, filter_proposals, load_proposals, whole_image_box
from wsod.data.targets import check_supervision, make_targets

__all__ = [
    "RESULT_FORMATS",
    "ImageRecord",
    "WeakDetectionDataset",
    "ConcatWeakDataset",
    "load_image",
    "image_size_from_header",
]

logger = logging.getLogger(__name__)

ImageId = Hashable
Transform = Callable[[dict], dict]

# How an evaluation writes a dataset's detections (``WeakDetectionDataset.result_format``; the writers are
# ``wsod.engine.evaluate``'s, which this package sits below):
# - "voc": VOC devkit result files, one per class (``voc_results/``), under ``str(image_id)``;
# - "coco": a COCO results json (``coco_results.json``) under the image ids and the dataset's
#   ``category_ids``; such a dataset also holds its ground truth as ``coco`` (a pycocotools index) and
#   its ``annotation_file``, so that the ``coco`` metric (COCOeval) can score it;
# - "named": ``predictions.json`` under the image file names (tools/predict.py's format).
RESULT_FORMATS = ("voc", "coco", "named")


@dataclass(frozen=True)
class ImageRecord:
    """One image of a dataset: where it is, its size on disk, its labels and (optionally) its boxes.

    ``labels`` (C,) float32 multi-hot; ``gt_boxes`` (G, 4) float32 0-based inclusive xyxy (COCO: xywh ->
    xyxy); ``gt_labels`` (G,) int64 in 0..C-1; ``gt_difficult`` (G,) bool. The three ``gt_`` fields are
    None for label-only data; they are for evaluation. ``supervision``: training supervision beyond the
    image labels, field name -> array in pixels of the image on disk (e.g. ``{"points": (P, 2) x y,
    "point_labels": (P,)}``; names and rules in ``wsod.data.targets``), None for image-label data.
    """

    image_id: ImageId
    path: str
    height: int
    width: int
    labels: np.ndarray
    gt_boxes: np.ndarray | None = None
    gt_labels: np.ndarray | None = None
    gt_difficult: np.ndarray | None = None
    supervision: Mapping[str, ArrayLike] | None = None

    @property
    def has_boxes(self) -> bool:
        return self.gt_boxes is not None


def load_image(path: str | os.PathLike) -> tv_tensors.Image:
    """Decode an image file to uint8 RGB (3, H, W) as a viewer shows it; errors name the file.

    The one decoding rule of ``wsod.data.image_io`` (Selective Search reads the same pixels): Pillow
    decodes (torchvision 0.29 deprecates its own decoders), 16-bit greyscale keeps its high byte, and
    the EXIF orientation is applied, so a phone photo is upright and matches annotations drawn in a
    viewer. VOC and COCO images carry no rotating EXIF tag in practice, so their stored pixel grid,
    which their boxes annotate, is what this returns. ``FileNotFoundError`` for a missing file,
    ``RuntimeError("cannot decode image <path>: ...")`` for a truncated, corrupt or unconvertible one.
    """
    return tv_tensors.Image(torch.from_numpy(read_image_rgb(path)).permute(2, 0, 1))


def image_size_from_header(path: str | os.PathLike) -> tuple[int, int]:
    """(H, W) of an image file as ``load_image`` decodes it (EXIF orientations 5-8 swap the sides),
    read from its header only (for formats that do not store sizes); errors as ``load_image``'s, with
    Pillow's exception as ``__cause__``."""
    return read_image_size(path)


class WeakDetectionDataset(Dataset):
    """Images with image-level labels and proposals (see the module docstring for items and errors).

    A format's subclass (``VOCDataset``, ``CocoDataset``, ``FolderDataset``) reads its files into
    ``records`` and ``classes`` and passes the keyword arguments below (its ``**options``) on unchanged.
    ``result_format`` (a class attribute, one of ``RESULT_FORMATS``): how an evaluation writes this
    dataset's detections, "voc" unless a subclass says otherwise.

    Args:
        records: one ``ImageRecord`` per image.
        classes: the C class names, index = class index.
        proposals: a ``ProposalSet`` or the path of a proposal file; must hold every record's id, and
            where it records an image's size, the record's (H, W).
        transform: item dict -> item dict, e.g. ``wsod.data.transforms.train_transform()``.
        min_proposal_size: proposals whose inclusive pixel width ``x2 - x1 + 1`` or height is below
            this are dropped (``wsod.data.proposals.filter_proposals``).
        max_proposals: keep at most this many proposals per image: the best-scored when the file has
            scores (a stable sort: ties in file order), else the first in file order; None keeps all.
        drop_unlabelled: drop images without any positive image-level label (training).
        check_files: check at construction that every image file exists.
        partial_labels: a side file of points, scribbles and boxes on some objects
            (``wsod.data.partial_labels``), attached to the records it names as their ``supervision``.
    """

    result_format: str = "voc"

    def __init__(
        self,
        records: Sequence[ImageRecord],
        classes: Sequence[str],
        proposals: ProposalSet | str | os.PathLike,
        *,
        transform: Transform | None = None,
        min_proposal_size: float = 2.0,
        max_proposals: int | None = None,
        drop_unlabelled: bool = False,
        check_files: bool = True,
        partial_labels: str | os.PathLike | None = None,
    ) -> None:
        self.classes = tuple(classes)
        records = list(records)
        if not records:
            raise ValueError("the dataset has no images")  # the format readers name the empty file
        if drop_unlabelled:
            kept = [r for r in records if r.labels.any()]
            if not kept:
                raise ValueError(f"none of the {len(records)} images has an image-level label")
            if len(kept) < len(records):
                logger.warning(
                    "dropped %d of %d images that have no image-level label",
                    len(records) - len(kept),
                    len(records),
                )
            records = kept
        # Kept to name the file in errors about its labels (e.g. a method that cannot read them).
        self.partial_labels_file = None if partial_labels is None else Path(partial_labels)
        if partial_labels is not None:
            records = attach_partial_labels(records, self.classes, partial_labels)
        counts = count_partial_labels(records)
        if counts["images"]:
            logger.info(
                "partial labels on %d of %d images: %d points, %d scribbles, %d boxes",
                counts["images"],
                len(records),
                counts["point"],
                counts["scribble"],
                counts["box"],
            )
        for r in records:
            if r.supervision:
                check_supervision(r.supervision, (r.height, r.width), f"image {r.image_id!r} ({r.path})")
        if check_files:
            missing = [r.path for r in records if not os.path.isfile(r.path)]
            if missing:
                raise FileNotFoundError(
                    f"{len(missing)} of {len(records)} image files are missing; the first is {missing[0]}"
                )
        self.proposals = proposals if isinstance(proposals, ProposalSet) else load_proposals(proposals)
        image_ids = [r.image_id for r in records]
        self.proposals.require(image_ids)
        # Array compares, no file read: cheap for COCO's 120k images (proposals without sizes pass).
        self.proposals.check_image_sizes(image_ids, [(r.height, r.width) for r in records])
        self.records = records
        self.transform = transform
        self.min_proposal_size = min_proposal_size
        self.max_proposals = max_proposals
        self.num_whole_image_fallbacks = 0  # per process: each data-loader worker counts its own

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_ids(self) -> list[ImageId]:
        return [r.image_id for r in self.records]

    @property
    def image_sizes(self) -> list[tuple[int, int]]:
        """(H, W) of every image as its annotation states it (for aspect-ratio grouping)."""
        return [(r.height, r.width) for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    @property
    def has_ground_truth(self) -> bool:
        """Whether every image has ground-truth boxes (detection AP and CorLoc can be computed)."""
        return all(r.has_boxes for r in self.records)

    def ground_truth(self) -> list[dict[str, torch.Tensor]]:
        """Per image, in dataset order, ``{"boxes" (G, 4) float32 original pixels, "labels" (G,) int64,
        "difficult" (G,) bool}``: what ``wsod.evaluation.voc`` scores detections against."""
        missing = [r.image_id for r in self.records if not r.has_boxes]
        if missing:
            raise ValueError(
                f"{len(missing)} of {len(self)} images have no ground-truth boxes (the first is"
                f" {missing[0]!r}): detections cannot be scored on this dataset"
            )
        return [
            {
                "boxes": torch.as_tensor(r.gt_boxes, dtype=torch.float32).reshape(-1, 4),
                "labels": torch.as_tensor(r.gt_labels, dtype=torch.int64),
                "difficult": torch.as_tensor(r.gt_difficult, dtype=torch.bool),
            }
            for r in self.records
        ]

    def proposals_of(self, index: int, image_size: tuple[int, int] | None = None) -> torch.Tensor:
        """Image ``index``'s proposals after the loading rules (clipped, small and duplicate boxes
        dropped, at most ``max_proposals``), float32 (R, 4) in original pixels, R >= 1: the whole-image
        box stands in when nothing is left (logged and counted). ``image_size`` (H, W) defaults to the
        annotated size."""
        record = self.records[index]
        size = image_size or (record.height, record.width)
        boxes = filter_proposals(
            self.proposals[record.image_id], size, min_size=self.min_proposal_size, top_k=self.max_proposals,
            scores=self.proposals.scores(record.image_id),
        )  # fmt: skip
        if len(boxes):
            return boxes
        # The detector needs at least one ROI; the whole image is the one box that is always valid.
        self.num_whole_image_fallbacks += 1
        logger.warning(
            "image %r: no proposal left after filtering %s; using the whole-image box (%d such images"
            " so far in this process)",
            record.image_id,
            self.proposals.source,
            self.num_whole_image_fallbacks,
        )
        return whole_image_box(size)

    def __getitem__(self, index: int | tuple[int, int]) -> dict:
        """``index``, or ``(index, seed)`` to draw this item's random transform from ``seed`` (see
        ``wsod.data.loader.GroupedBatchSampler``) without touching the process's random stream."""
        index, seed = index if isinstance(index, tuple) else (index, None)
        record = self.records[index]
        image = load_image(record.path)
        size = (image.shape[-2], image.shape[-1])
        boxes = self.proposals_of(index, size)
        labels = torch.tensor(record.labels, dtype=torch.float32)
        item = {
            "image": image,
            "image_id": record.image_id,
            "labels": labels,
            "targets": make_targets(labels, record.supervision, size),
            "proposals": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size),
            "original_size": size,
        }
        if record.has_boxes:
            item["gt_boxes"] = torch.tensor(record.gt_boxes, dtype=torch.float32).reshape(-1, 4)
            item["gt_labels"] = torch.tensor(record.gt_labels, dtype=torch.int64)
            item["gt_difficult"] = torch.tensor(record.gt_difficult, dtype=torch.bool)
        if self.transform is None:
            return item
        if seed is None:
            return self.transform(item)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(item)


class ConcatWeakDataset(ConcatDataset):
    """Several datasets of the same classes as one (e.g. VOC 2007 + 2012 trainval), keeping what the
    loader needs of a ``WeakDetectionDataset``: ``classes``, ``image_sizes``, ``image_ids`` and
    ``(index, seed)`` indexing."""

    def __init__(self, datasets: Sequence[WeakDetectionDataset]) -> None:
        classes = {tuple(d.classes) for d in datasets}
        if len(classes) != 1:
            raise ValueError(f"datasets to concatenate must share their classes, got {sorted(classes)}")
        super().__init__(datasets)
        self.classes = tuple(datasets[0].classes)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_sizes(self) -> list[tuple[int, int]]:
        return [size for d in self.datasets for size in d.image_sizes]

    @property
    def image_ids(self) -> list[ImageId]:
        return [image_id for d in self.datasets for image_id in d.image_ids]

    def __getitem__(self, index: int | tuple[int, int]) -> dict:
        index, seed = index if isinstance(index, tuple) else (index, None)
        which = bisect.bisect_right(self.cumulative_sizes, index)
        local = index - (self.cumulative_sizes[which - 1] if which else 0)
        return self.datasets[which][local if seed is None else (local, seed)]
