"""Fixtures for the data tests: small datasets written in the real on-disk formats under tmp_path."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from wsod.data.toy import ToyDataset, ensure_toy_dataset
from wsod.data.toy_voc.generator import ToyVOCDataset, ensure_toy_voc_dataset


def write_jpeg(path: Path, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A random RGB JPEG of the given size; returns the pixels as decoded back."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path, quality=95)
    return np.asarray(Image.open(path).convert("RGB"))


# (name, (xmin, ymin, xmax, ymax) as written in the xml, difficult or None to omit the tag)
VocObject = tuple[str, tuple[str, str, str, str], int | None]


def voc_xml(width: int | None, height: int | None, objects: Sequence[VocObject]) -> str:
    size = (
        ""
        if width is None
        else f"<size><width>{width}</width><height>{height}</height><depth>3</depth></size>"
    )
    parts = []
    for name, (x1, y1, x2, y2), difficult in objects:
        flag = "" if difficult is None else f"<difficult>{difficult}</difficult>"
        parts.append(
            f"<object><name>{name}</name><pose>Left</pose><truncated>0</truncated>{flag}"
            f"<bndbox><xmin>{x1}</xmin><ymin>{y1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax></bndbox></object>"
        )
    return (
        f"<annotation><folder>VOC2007</folder><filename>x.jpg</filename>{size}{''.join(parts)}</annotation>"
    )


@pytest.fixture
def jpeg() -> Callable[..., np.ndarray]:
    """``write_jpeg`` as a fixture, for test modules (which cannot import conftest)."""
    return write_jpeg


@pytest.fixture
def make_voc(tmp_path: Path) -> Callable[..., Path]:
    """Write ``{tmp}/VOCdevkit/VOC{year}`` with the given images; returns the devkit folder.

    ``images``: image id -> (height, width, objects); ``image_sets``: name -> ids.
    """

    def make(
        images: dict[str, tuple[int, int, Sequence[VocObject]]],
        image_sets: dict[str, Sequence[str]],
        year: str = "2007",
        write_size: bool = True,
    ) -> Path:
        base = tmp_path / "VOCdevkit" / f"VOC{year}"
        (base / "Annotations").mkdir(parents=True, exist_ok=True)
        (base / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
        for n, (image_id, (height, width, objects)) in enumerate(images.items()):
            write_jpeg(base / "JPEGImages" / f"{image_id}.jpg", height, width, seed=n)
            xml = voc_xml(width if write_size else None, height, objects)
            (base / "Annotations" / f"{image_id}.xml").write_text(xml)
        for name, ids in image_sets.items():
            (base / "ImageSets" / "Main" / f"{name}.txt").write_text("".join(f"{i}\n" for i in ids))
        return tmp_path / "VOCdevkit"

    return make


@pytest.fixture
def write_pickle(tmp_path: Path) -> Callable[..., Path]:
    """Write a reference-format proposal pickle: ids -> boxes (R, 4)."""

    def write(proposals: dict, name: str = "proposals.pkl", protocol: int = 2) -> Path:
        data = {
            "boxes": [np.asarray(b, dtype=np.float32).reshape(-1, 4) for b in proposals.values()],
            "scores": [np.zeros(len(np.asarray(b).reshape(-1, 4)), np.float32) for b in proposals.values()],
            "indexes": list(proposals),
        }
        path = tmp_path / name
        path.write_bytes(pickle.dumps(data, protocol=protocol))
        return path

    return write


@pytest.fixture
def write_json(tmp_path: Path) -> Callable[[dict, str], Path]:
    def write(data: dict, name: str = "annotations.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    return write


@pytest.fixture(scope="session")
def tiny_toy(tmp_path_factory: pytest.TempPathFactory) -> ToyDataset:
    """A 10 + 6 image toy dataset (Selective Search in-process: no worker start-up cost)."""
    return ensure_toy_dataset(tmp_path_factory.mktemp("toy") / "toy", num_train=10, num_test=6, workers=1)


@pytest.fixture(scope="session")
def tiny_toy_voc(tmp_path_factory) -> ToyVOCDataset:
    """A VOC-like set of 8 + 4 images (Selective Search included: the slow part, made once)."""
    return ensure_toy_voc_dataset(
        tmp_path_factory.mktemp("toy_voc") / "data" / "toy_voc", num_train=8, num_test=4, workers=1
    )
