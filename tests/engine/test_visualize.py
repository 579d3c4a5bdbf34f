"""Drawn detections and the PNGs predict writes of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from wsod.engine.visualize import PALETTE, draw_detections, save_png


def test_save_png_writes_the_pixels_it_is_given_and_refuses_other_layouts(tmp_path):
    image = torch.randint(0, 256, (3, 7, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    save_png(image, tmp_path / "a.png")
    with Image.open(tmp_path / "a.png") as png:
        assert png.format == "PNG" and png.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(png), image.permute(1, 2, 0).numpy())  # lossless
    with pytest.raises(ValueError, match=r"uint8 \(3, H, W\)"):
        save_png(image.float(), tmp_path / "b.png")


def test_a_detection_is_drawn_in_its_class_colour_inside_its_box():
    image = torch.zeros(3, 40, 60, dtype=torch.uint8)
    detections = {"boxes": torch.tensor([[10.0, 5.0, 30.0, 25.0]]), "scores": torch.tensor([0.9]),
                  "labels": torch.tensor([1])}  # fmt: skip
    drawn = draw_detections(image, detections, ["cat", "dog"])
    assert drawn.shape == image.shape and drawn.dtype == torch.uint8
    assert tuple(drawn[:, 15, 10].tolist()) == PALETTE[1]  # the box's left edge, in class 1's colour
    assert drawn[:, 35, 50].sum() == 0  # outside the box and its label: untouched
