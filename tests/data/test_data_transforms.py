"""Transforms: proposals follow resize and flip exactly, size limits hold, normalisation is ImageNet's."""

from __future__ import annotations

import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from wsod.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DetectionTransform,
    test_transform,
    train_transform,
)

PROPOSALS = [[0.0, 0.0, 99.0, 59.0], [10.0, 20.0, 30.0, 50.0], [0.5, 1.5, 2.5, 3.5]]


def _item(height=60, width=100, colour=(255, 128, 0)):
    image = torch.tensor(colour, dtype=torch.uint8).view(3, 1, 1).expand(3, height, width).clone()
    boxes = torch.tensor(PROPOSALS)
    return {
        "image": tv_tensors.Image(image),
        "image_id": "x",
        "labels": torch.tensor([1.0, 0.0]),
        "proposals": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
        "original_size": (height, width),
        "gt_boxes": boxes.clone(),
    }


def test_resize_scales_proposals_by_the_image_size_ratios():
    out = test_transform(90, max_size=1000)(_item())
    assert out["image"].shape == (3, 90, 150) and out["image_size"] == (90, 150)
    assert out["scale"] == pytest.approx(1.5) and out["flipped"] is False
    torch.testing.assert_close(out["proposals"], torch.tensor(PROPOSALS) * 1.5)
    assert type(out["proposals"]) is torch.Tensor and type(out["image"]) is torch.Tensor
    # Evaluation needs the ground truth in original pixels: untouched.
    torch.testing.assert_close(out["gt_boxes"], torch.tensor(PROPOSALS))
    assert out["original_size"] == (60, 100)


def test_unequal_rounding_is_followed_per_axis():
    out = test_transform(100, max_size=1000)(_item(height=33, width=50))
    h, w = out["image_size"]
    assert (h, w) == (100, 151)  # 50 * 100 / 33 = 151.5, truncated
    expected = torch.tensor(PROPOSALS) * torch.tensor([w / 50, h / 33, w / 50, h / 33])
    torch.testing.assert_close(out["proposals"], expected)


def test_longer_side_is_capped():
    out = test_transform(80, max_size=120)(_item(height=60, width=200))
    assert out["image_size"] == (36, 120)
    torch.testing.assert_close(out["proposals"], torch.tensor(PROPOSALS) * torch.tensor([0.6, 0.6, 0.6, 0.6]))


def test_flip_mirrors_proposals_and_twice_is_the_identity():
    out = test_transform(60, max_size=1000, flip=True)(_item())
    assert out["flipped"] is True and out["image_size"] == (60, 100)
    boxes = torch.tensor(PROPOSALS)
    mirrored = torch.stack([100 - boxes[:, 2], boxes[:, 1], 100 - boxes[:, 0], boxes[:, 3]], dim=1)
    torch.testing.assert_close(out["proposals"], mirrored)
    back = F.horizontal_flip(tv_tensors.BoundingBoxes(out["proposals"], format="XYXY", canvas_size=(60, 100)))
    torch.testing.assert_close(back.as_subclass(torch.Tensor), boxes)


def test_flipped_image_pixels_mirror():
    item = _item(height=4, width=6)
    item["image"][:, :, 0] = 0  # a black first column
    out = DetectionTransform([4], 100, flip_prob=1.0, mean=(0, 0, 0), std=(1, 1, 1))(item)
    assert out["image"][:, :, -1].abs().sum() == 0 and out["image"][:, :, 0].abs().sum() > 0


def test_normalisation_is_imagenet_mean_and_std_on_0_1_rgb():
    out = test_transform(60, max_size=1000)(_item(colour=(255, 128, 0)))
    assert out["image"].dtype == torch.float32
    expected = [(v / 255 - m) / s for v, m, s in zip((255, 128, 0), IMAGENET_MEAN, IMAGENET_STD, strict=True)]
    torch.testing.assert_close(out["image"][:, 30, 50], torch.tensor(expected), atol=1e-5, rtol=0)


def test_training_transform_draws_scales_from_the_list_and_flips_sometimes():
    torch.manual_seed(0)
    transform = train_transform(scales=(40, 50, 70), max_size=1000, flip_prob=0.5)
    seen_sizes, seen_flips = set(), set()
    for _ in range(40):
        out = transform(_item())
        h, w = out["image_size"]
        assert h in (40, 50, 70) and w == int(100 * h / 60)
        assert out["scale"] == pytest.approx(h / 60)
        seen_sizes.add(h)
        seen_flips.add(out["flipped"])
        scale = torch.tensor([w / 100, h / 60, w / 100, h / 60])
        expected = torch.tensor(PROPOSALS) * scale
        if out["flipped"]:
            expected = torch.stack(
                [w - expected[:, 2], expected[:, 1], w - expected[:, 0], expected[:, 3]], 1
            )
        torch.testing.assert_close(out["proposals"], expected)
    assert seen_sizes == {40, 50, 70} and seen_flips == {True, False}


def test_test_transform_is_deterministic():
    a, b = test_transform(75, flip=True)(_item()), test_transform(75, flip=True)(_item())
    torch.testing.assert_close(a["image"], b["image"])
    torch.testing.assert_close(a["proposals"], b["proposals"])


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="max_size"):
        DetectionTransform([800], max_size=800)
    with pytest.raises(ValueError, match="flip_prob"):
        DetectionTransform([800], flip_prob=2.0)
    with pytest.raises(ValueError, match="scales"):
        DetectionTransform([])
