"""The embedded toy dataset: coloured shapes on textured backgrounds, in the exact VOC layout.

Five classes, each a distinct shape in a distinct colour (``TOY_CLASSES``); 1-3 objects per 160x160
image, each side drawn from ``object_size`` (``OBJECT_SIZE``, 30-60 px; ``PART_PRONE_OBJECT_SIZE``,
25-70 px, for the set on which part domination shows), never overlapping; backgrounds of soft
blotches, stripes and grain in muted colours.
Written as ``{root}/VOCdevkit/VOC2007/{JPEGImages, Annotations, ImageSets/Main}`` (trainval, train, val,
test and per-class files) plus Selective Search proposals for trainval and test in the reference pickle
format (``{root}/proposals/selective_search_{split}.pkl``, made by ``wsod.data.proposals.selective_search``).

``ensure_toy_dataset()`` generates it on first use and returns the paths afterwards. Every image is drawn
from its own seeded generator (``seed``, image number), so the files are the same whatever the order or
number of processes. Generation writes into a temporary folder renamed into place at the end, so an
interrupted run leaves no half dataset and concurrent callers (e.g. several ranks) do not collide; an
interrupted (Ctrl-C) or killed (SIGTERM) one removes that folder, and one killed outright (kill -9) has
it removed by the next call.
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from wsod.data.box_formats import to_one_based
from wsod.data.generated import ensure_generated
from wsod.data.proposals.selective_search import generate_proposals
from wsod.data.voc import VOCDataset
from wsod.progress import progress_bar

__all__ = [
    "OBJECT_SIZE",
    "PART_PRONE_OBJECT_SIZE",
    "TOY_CLASSES",
    "ToyDataset",
    "ensure_toy_dataset",
    "render_toy_image",
    "toy_object_masks",
]

logger = logging.getLogger(__name__)

TOY_CLASSES = ("red_circle", "green_square", "blue_triangle", "yellow_cross", "magenta_diamond")
_COLOURS = np.array(
    [(220, 35, 35), (35, 170, 55), (40, 75, 225), (235, 205, 35), (205, 50, 205)], dtype=np.float32
)
IMAGE_SIZE = 160
# Object sides in pixels. 30-60 (the default): every part proposal Selective Search makes inside an object
# (a circle's quadrant, a triangle's apex, a cross's arm: about 0.45 of the object's side) is narrower than
# 28 px, the toy configs' data.*.min_proposal_size, while every whole object's box is wider, so MIL has no
# pure-colour part to settle on and the run's outcome does not hinge on rounding. 25-70 (the toy set
# before): parts of large objects survive any minimum size that keeps the small objects, and whether MIST
# learns the triangle whole or by a part flips with the seed, the thread count and the CPU (measured:
# docs/RESULTS.md, "the quick start's range"); configs/data/toy_parts.yaml keeps that set.
OBJECT_SIZE = (30, 60)
PART_PRONE_OBJECT_SIZE = (25, 70)
YEAR = "2007"
FORMAT_VERSION = 1
_SUPERSAMPLE = 4  # shapes are drawn at 4x and averaged down: anti-aliased edges, like a photograph's


@dataclass(frozen=True)
class ToyDataset:
    """Where the toy dataset lives. ``dataset(split, ...)`` opens a split as a ``VOCDataset``."""

    root: Path
    devkit: Path
    year: str
    classes: tuple[str, ...]
    proposal_files: dict[str, Path] = field(default_factory=dict)

    def dataset(self, split: str, proposals: str | os.PathLike | None = None, **kwargs) -> VOCDataset:
        """``split`` in trainval / test (train / val use the trainval proposals), with ``proposals`` (a
        proposal file or store; None: the split's generated Selective Search); kwargs go to VOCDataset."""
        if proposals is None:
            proposals = self.proposal_files["test" if split == "test" else "trainval"]
        return VOCDataset(self.devkit, self.year, split, proposals, classes=self.classes, **kwargs)


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Muted textured background (size, size, 3) float32 in 0-255."""
    base = rng.uniform(70, 180) + rng.uniform(-18, 18, 3)
    cells = int(rng.integers(3, 9))
    # Blotches vary mostly in brightness, little in hue, so that no patch looks like an object colour.
    low = rng.normal(0, 22, (cells, cells, 1)) + rng.normal(0, 7, (cells, cells, 3))
    blotches = cv2.resize(low.astype(np.float32), (size, size), interpolation=cv2.INTER_CUBIC)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    angle, frequency = rng.uniform(0, np.pi), rng.uniform(0.08, 0.5)
    stripes = rng.uniform(0, 16) * np.sin(
        frequency * (xx * np.cos(angle) + yy * np.sin(angle)) + rng.uniform(0, 6)
    )
    grain = rng.normal(0, 6, (size, size, 3))
    return (base + blotches + stripes[..., None] + grain).astype(np.float32)


def _shape_mask(cls: int, box: tuple[float, float, float, float], size: int) -> np.ndarray:
    """Coverage (size, size) float32 in 0-1 of the shape of class ``cls`` filling ``box`` (x0, y0, w, h)."""
    s = _SUPERSAMPLE
    x0, y0, w, h = (v * s for v in box)
    canvas = np.zeros((size * s, size * s), np.uint8)
    cx, cy = x0 + w / 2, y0 + h / 2

    def poly(points: Sequence[tuple[float, float]]) -> None:
        cv2.fillPoly(canvas, [np.round(np.array(points)).astype(np.int32)], 255)

    if cls == 0:  # circle (slightly elliptic)
        cv2.ellipse(canvas, (round(cx), round(cy)), (round(w / 2), round(h / 2)), 0, 0, 360, 255, -1)
    elif cls == 1:  # square
        poly([(x0, y0), (x0 + w, y0), (x0 + w, y0 + h), (x0, y0 + h)])
    elif cls == 2:  # triangle, apex up
        poly([(cx, y0), (x0 + w, y0 + h), (x0, y0 + h)])
    elif cls == 3:  # cross: a horizontal and a vertical bar a third of the box thick
        poly([(x0, cy - h / 6), (x0 + w, cy - h / 6), (x0 + w, cy + h / 6), (x0, cy + h / 6)])
        poly([(cx - w / 6, y0), (cx + w / 6, y0), (cx + w / 6, y0 + h), (cx - w / 6, y0 + h)])
    else:  # diamond
        poly([(cx, y0), (x0 + w, cy), (cx, y0 + h), (x0, cy)])
    return cv2.resize(canvas, (size, size), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0


def _place(
    rng: np.random.Generator, placed: list[tuple[float, ...]], size: int, object_size: Sequence[int]
) -> tuple[float, ...] | None:
    """A random (x0, y0, w, h) with sides in ``object_size`` inside the image at least 3 px from every
    placed box, or None."""
    gap = 3
    for _ in range(50):
        side = rng.uniform(*object_size)
        w = float(np.clip(side * rng.uniform(0.85, 1.15), *object_size))
        h = float(np.clip(side * rng.uniform(0.85, 1.15), *object_size))
        x0, y0 = rng.uniform(1, size - w - 1), rng.uniform(1, size - h - 1)
        if all(
            x0 + w + gap < px or px + pw + gap < x0 or y0 + h + gap < py or py + ph + gap < y0
            for px, py, pw, ph in placed
        ):
            return x0, y0, w, h
    return None


def render_toy_image(
    seed: int, number: int, size: int = IMAGE_SIZE, object_size: Sequence[int] = OBJECT_SIZE
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Image ``number`` of the dataset with ``seed`` and ``object_size`` -> (uint8 RGB (size, size, 3),
    boxes (G, 4) float32 0-based inclusive tight around the drawn pixels, labels (G,) int64)."""
    image, boxes, labels, _ = _render(seed, number, size, object_size)
    return image, boxes, labels


def toy_object_masks(
    seed: int, number: int, size: int = IMAGE_SIZE, object_size: Sequence[int] = OBJECT_SIZE
) -> np.ndarray:
    """The objects of image ``number`` as masks (G, size, size) bool, in the order of its boxes: the
    pixels drawn at least half in the object's colour (its box is tight around them). What
    ``tools/make_partial_labels.py`` places points and scribbles in."""
    return _render(seed, number, size, object_size)[3]


def _render(
    seed: int, number: int, size: int, object_size: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, number])
    image = _background(rng, size)
    boxes, labels, placed, masks = [], [], [], []
    for _ in range(int(rng.integers(1, 4))):
        box = _place(rng, placed, size, object_size)
        if box is None:
            continue
        placed.append(box)
        cls = int(rng.integers(len(TOY_CLASSES)))
        mask = _shape_mask(cls, box, size)
        colour = _COLOURS[cls] + rng.uniform(-20, 20, 3) + rng.normal(0, 5, (size, size, 3))
        image = image * (1 - mask[..., None]) + colour * mask[..., None]
        ys, xs = np.nonzero(mask >= 0.5)
        boxes.append([xs.min(), ys.min(), xs.max(), ys.max()])
        labels.append(cls)
        masks.append(mask >= 0.5)
    image = np.clip(np.round(image), 0, 255).astype(np.uint8)
    masks = np.array(masks, dtype=bool).reshape(-1, size, size)
    return image, np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64), masks


def _annotation_xml(image_id: str, size: int, boxes: np.ndarray, labels: np.ndarray) -> bytes:
    root = ET.Element("annotation")
    ET.SubElement(root, "folder").text = f"VOC{YEAR}"
    ET.SubElement(root, "filename").text = f"{image_id}.jpg"
    ET.SubElement(ET.SubElement(root, "source"), "database").text = "wsod toy"
    size_node = ET.SubElement(root, "size")
    for tag, value in (("width", size), ("height", size), ("depth", 3)):
        ET.SubElement(size_node, tag).text = str(value)
    ET.SubElement(root, "segmented").text = "0"
    for box, label in zip(to_one_based(boxes), labels, strict=True):
        obj = ET.SubElement(root, "object")
        ET.SubElement(obj, "name").text = TOY_CLASSES[label]
        ET.SubElement(obj, "pose").text = "Unspecified"
        ET.SubElement(obj, "truncated").text = "0"
        ET.SubElement(obj, "difficult").text = "0"
        bndbox = ET.SubElement(obj, "bndbox")
        for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), box, strict=True):
            ET.SubElement(bndbox, tag).text = str(int(value))
    ET.indent(root)
    return ET.tostring(root)


def _write_devkit(
    base: Path, seed: int, num_train: int, num_test: int, object_size: Sequence[int], progress: bool = False
) -> dict[str, list[str]]:
    """Render every image with its xml and write the image set files; returns split -> ids."""
    for folder in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (base / folder).mkdir(parents=True, exist_ok=True)
    ids = [f"{n:06d}" for n in range(num_train + num_test)]
    splits = {"trainval": ids[:num_train], "test": ids[num_train:]}
    splits["train"], splits["val"] = splits["trainval"][0::2], splits["trainval"][1::2]
    present: dict[str, set[int]] = {}
    for number, image_id in enumerate(progress_bar(ids, shown=progress, desc="toy images")):
        image, boxes, labels = render_toy_image(seed, number, object_size=object_size)
        Image.fromarray(image).save(base / "JPEGImages" / f"{image_id}.jpg", quality=92)
        (base / "Annotations" / f"{image_id}.xml").write_bytes(
            _annotation_xml(image_id, IMAGE_SIZE, boxes, labels)
        )
        present[image_id] = set(labels.tolist())
    for split, split_ids in splits.items():
        (base / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i}\n" for i in split_ids))
        for cls, name in enumerate(TOY_CLASSES):
            lines = "".join(f"{i} {1 if cls in present[i] else -1:2d}\n" for i in split_ids)
            (base / "ImageSets" / "Main" / f"{name}_{split}.txt").write_text(lines)
    return splits


def _paths(root: Path) -> ToyDataset:
    proposals = {
        split: root / "proposals" / f"selective_search_{split}.pkl" for split in ("trainval", "test")
    }
    return ToyDataset(root, root / "VOCdevkit", YEAR, TOY_CLASSES, proposals)


def ensure_toy_dataset(
    root: str | os.PathLike = "data/toy",
    *,
    num_train: int = 600,
    num_test: int = 200,
    seed: int = 0,
    object_size: Sequence[int] = OBJECT_SIZE,
    workers: int = 2,
    progress: bool = False,
) -> ToyDataset:
    """The toy dataset at ``root`` (relative to the working directory), generated first if absent.

    ``num_train`` / ``num_test`` make smaller variants (for tests); ``object_size`` (min, max) the objects'
    sides in pixels; a folder made with other settings is an error rather than silently reused.
    ``workers`` processes run Selective Search.
    """
    root = Path(root)
    low, high = (int(v) for v in object_size)
    if not 1 <= low <= high <= IMAGE_SIZE // 2:
        raise ValueError(
            f"object_size {list(object_size)}: expected [min, max] with 1 <= min <= max <= {IMAGE_SIZE // 2}"
        )
    manifest = {
        "format": FORMAT_VERSION,
        "seed": seed,
        "num_train": num_train,
        "num_test": num_test,
        "image_size": IMAGE_SIZE,
        "object_size": [low, high],
        "classes": list(TOY_CLASSES),
    }

    def write(staging: Path) -> None:
        logger.info("generating the toy dataset in %s (%d + %d images)", root, num_train, num_test)
        splits = _write_devkit(
            staging / "VOCdevkit" / f"VOC{YEAR}", seed, num_train, num_test, (low, high), progress
        )
        images_dir = staging / "VOCdevkit" / f"VOC{YEAR}" / "JPEGImages"
        for split, path in _paths(staging).proposal_files.items():
            images = [(i, str(images_dir / f"{i}.jpg")) for i in splits[split]]
            generate_proposals(images, path, workers=workers, progress=progress)

    ensure_generated(root, manifest, write, manifest_name="toy.json", what="a toy dataset")
    return _paths(root)
