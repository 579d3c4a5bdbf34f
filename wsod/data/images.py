"""Images named by the user, outside any dataset: what ``tools/predict.py`` reads
(``wsod.runs.predict.predict_from_config``).

``input=`` is an image file, a folder (its images with the extensions of ``IMAGE_EXTENSIONS``, sub-folders
included) or a glob pattern (``"input=photos/*.jpg"``; ``**`` reaches into sub-folders). Each image is
known by its ``file_name``: its path relative to the folder, to the file's own folder, or to the
pattern's folder part. Images are taken in sorted ``file_name`` order.

Proposals: Selective Search on each image as it is loaded (in the loader workers), or looked up by
``file_name`` in a proposal file or store, with the same loading rules as training
(``wsod.data.proposals.filter_proposals``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors

from wsod.data.dataset import image_size_from_header, load_image
from wsod.data.proposals import ProposalSet, filter_proposals, whole_image_box
from wsod.data.proposals.selective_search import selective_search

__all__ = ["IMAGE_EXTENSIONS", "ImageFiles", "find_images", "check_readable"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS


def find_images(spec: str | os.PathLike) -> tuple[list[Path], list[str]]:
    """The image files ``input=`` names and their file names (see the module docstring), sorted."""
    spec = str(spec)
    path = Path(spec)
    if glob.has_magic(spec):
        parts = Path(spec).parts
        fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        base = Path(*parts[:fixed]) if fixed else Path(".")
        files = [Path(p) for p in glob.glob(spec, recursive=True) if _is_image(Path(p))]
    elif path.is_dir():
        base = path
        files = [p for p in path.rglob("*") if _is_image(p)]
    elif path.is_file():
        base, files = path.parent, [path]
    else:
        raise FileNotFoundError(
            f"input={spec}: no such file or folder (give an image, a folder or a glob pattern)"
        )
    if not files:
        raise ValueError(
            f"input={spec}: no image found (read: {' '.join(IMAGE_EXTENSIONS)}, upper or lower case);"
            " give a folder holding images, an image file, or a pattern such as 'photos/*.jpg'"
        )
    names = [Path(os.path.relpath(f, base)).as_posix() for f in files]
    order = sorted(range(len(files)), key=lambda i: names[i])
    return [files[i] for i in order], [names[i] for i in order]


class ImageFiles(Dataset):
    """Images by path, as ``WeakDetectionDataset`` items without labels (what ``predict`` reads): the
    decoded image, its ``file_name`` as the id, and its proposals, from ``proposals`` (looked up by
    file name) or by Selective Search (``mode``) when it is None; ``mode=None``: none at all, the whole
    image stands in (a second-stage detector, which proposes its own boxes)."""

    transform = None  # predict applies the test views itself

    def __init__(
        self,
        files: Sequence[Path],
        names: Sequence[str],
        num_classes: int,
        proposals: ProposalSet | None = None,
        *,
        mode: str | None = "fast",
        max_proposals: int | None = None,
        min_size: float = 2.0,
    ) -> None:
        self.files, self.names = [str(f) for f in files], list(names)
        self.num_classes, self.proposals = num_classes, proposals
        self.mode, self.max_proposals, self.min_size = mode, max_proposals, min_size
        if proposals is not None:
            proposals.require(self.names)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = load_image(self.files[index])
        size = (image.shape[-2], image.shape[-1])
        scores = None  # Selective Search's own order is its ranking
        if self.proposals is None and self.mode is None:
            raw = whole_image_box(size).numpy()
        elif self.proposals is None:
            bgr = np.ascontiguousarray(image.permute(1, 2, 0).numpy()[..., ::-1])
            raw = selective_search(bgr, self.mode)
        else:
            raw = self.proposals[self.names[index]]
            scores = self.proposals.scores(self.names[index])
        boxes = filter_proposals(raw, size, min_size=self.min_size, top_k=self.max_proposals, scores=scores)
        if not len(boxes):
            boxes = whole_image_box(size)  # the detector needs one box; the whole image always exists
        return {
            "image": image,
            "image_id": self.names[index],
            "labels": torch.zeros(self.num_classes),
            "proposals": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size),
            "original_size": size,
        }


def check_readable(files: Sequence[Path]) -> None:
    """Read every image's header before any work: a file that is no image stops the run at once,
    named, instead of after minutes of Selective Search (and without a worker's traceback)."""
    for path in files:
        try:
            image_size_from_header(path)
        except RuntimeError as error:
            raise RuntimeError(
                f"cannot read image {path} ({error.__cause__ or error}): replace it with a readable image or"
                " leave it out of input="
            ) from error
