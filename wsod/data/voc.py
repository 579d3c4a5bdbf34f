"""PASCAL VOC: a VOCdevkit folder read as an image-level dataset.

Layout: ``{devkit}/VOC{year}/JPEGImages/{id}.jpg``, ``Annotations/{id}.xml`` and
``ImageSets/Main/{image_set}.txt`` (one image id per line). Image ids are strings (``"000005"``).

Image labels come from the non-difficult objects (docs/METHOD.md §9). All objects, difficult ones included,
are kept as ground truth with their difficult flag, for evaluation only. ``<bndbox>`` is 1-based
inclusive; ``wsod.data.box_formats.from_one_based`` makes it 0-based (``x1 = xmin - 1``, ...), the one
place this happens. Fractional coordinates (some VOC 2012 files have them) are kept as floats.

Errors: a missing or malformed xml and an object whose class is not in ``classes`` raise ``ValueError``
naming the file (an unknown name is usually a typo or a wrong class list, which would silently drop
labels). An xml without objects is a background image: it has no label and is kept, or dropped with a
logged count by ``drop_unlabelled`` (see ``wsod.data.dataset``).
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wsod.data.box_formats import from_one_based
from wsod.data.dataset import ImageRecord, WeakDetectionDataset, image_size_from_header
from wsod.data.proposals import ProposalSet

__all__ = ["VOC_CLASSES", "VOCDataset", "parse_voc_xml", "read_image_set", "load_voc_records"]

logger = logging.getLogger(__name__)

VOC_CLASSES = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)


def read_image_set(path: str | os.PathLike) -> list[str]:
    """Image ids of an ``ImageSets/Main/*.txt`` file (the first column, blank lines skipped); an empty
    file is an error naming it (a dataset of no image is a broken download or a wrong split name)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"image set file not found: {path}")
    ids = [line.split()[0] for line in Path(path).read_text().splitlines() if line.strip()]
    if not ids:
        raise ValueError(f"image set file {path} lists no image")
    return ids


def _text(element: ET.Element, tag: str, path: str | os.PathLike) -> str:
    child = element.find(tag)
    if child is None or child.text is None:
        raise ValueError(f"{path}: <{element.tag}> has no <{tag}>")
    return child.text.strip()


def _number(element: ET.Element, tag: str, path: str | os.PathLike) -> float:
    text = _text(element, tag, path)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{path}: <{element.tag}><{tag}> is {text!r}, not a number") from None


def parse_voc_xml(
    path: str | os.PathLike, class_to_index: dict[str, int]
) -> tuple[tuple[int, int], np.ndarray, np.ndarray, np.ndarray]:
    """One annotation file -> ((H, W), boxes (G, 4) float32 0-based, labels (G,) int64, difficult (G,) bool).

    H and W are 0 when the file does not state a size.
    """
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        raise FileNotFoundError(f"annotation file not found: {path}") from None
    except ET.ParseError as e:
        raise ValueError(f"{path}: not a valid xml file ({e})") from e
    size = root.find("size")
    height = int(_number(size, "height", path)) if size is not None else 0
    width = int(_number(size, "width", path)) if size is not None else 0
    boxes, labels, difficult = [], [], []
    for obj in root.iter("object"):
        name = _text(obj, "name", path)
        if name not in class_to_index:
            raise ValueError(f"{path}: unknown class name {name!r}; known classes: {sorted(class_to_index)}")
        bndbox = obj.find("bndbox")
        if bndbox is None:
            raise ValueError(f"{path}: object {name!r} has no <bndbox>")
        boxes.append([_number(bndbox, tag, path) for tag in ("xmin", "ymin", "xmax", "ymax")])
        labels.append(class_to_index[name])
        flag = obj.find("difficult")
        difficult.append(flag is not None and flag.text is not None and _number(obj, "difficult", path) == 1)
    return (
        (height, width),
        from_one_based(np.array(boxes, dtype=np.float32).reshape(-1, 4)),
        np.array(labels, dtype=np.int64),
        np.array(difficult, dtype=bool),
    )


def load_voc_records(
    devkit: str | os.PathLike, year: str, image_set: str, classes: Sequence[str] = VOC_CLASSES
) -> list[ImageRecord]:
    """``ImageRecord``s of ``{devkit}/VOC{year}`` for ``ImageSets/Main/{image_set}.txt``, in file order."""
    base = Path(devkit) / f"VOC{year}"
    class_to_index = {name: i for i, name in enumerate(classes)}
    records = []
    without_objects = 0
    for image_id in read_image_set(base / "ImageSets" / "Main" / f"{image_set}.txt"):
        xml = base / "Annotations" / f"{image_id}.xml"
        (height, width), boxes, gt_labels, difficult = parse_voc_xml(xml, class_to_index)
        image_path = base / "JPEGImages" / f"{image_id}.jpg"
        if height <= 0 or width <= 0:
            height, width = image_size_from_header(image_path)
        labels = np.zeros(len(classes), dtype=np.float32)
        labels[gt_labels[~difficult]] = 1.0
        without_objects += len(gt_labels) == 0
        records.append(
            ImageRecord(image_id, str(image_path), height, width, labels, boxes, gt_labels, difficult)
        )
    if without_objects:
        logger.warning("%s %s: %d annotation files have no object", base, image_set, without_objects)
    return records


class VOCDataset(WeakDetectionDataset):
    """A VOCdevkit image set with proposals, e.g. ``VOCDataset("data/VOCdevkit", "2007", "trainval", p)``.

    ``proposals`` is a ``ProposalSet`` or a proposal file path; ``classes`` the class names the xml files
    use. ``options``: ``WeakDetectionDataset``'s keyword arguments (transform, max_proposals, ...).
    Detections are written as VOC devkit files (``result_format`` "voc").
    """

    result_format = "voc"

    def __init__(
        self,
        devkit: str | os.PathLike,
        year: str,
        image_set: str,
        proposals: ProposalSet | str | os.PathLike,
        *,
        classes: Sequence[str] = VOC_CLASSES,
        **options: Any,
    ) -> None:
        self.devkit, self.year, self.image_set = Path(devkit), str(year), image_set
        records = load_voc_records(devkit, self.year, image_set, classes)
        super().__init__(records, classes, proposals, **options)
