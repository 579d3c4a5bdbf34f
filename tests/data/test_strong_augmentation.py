"""The strong view's photometric ops: the reference's parameters, drawn from the seeded global stream; and
the weak/strong pair of the third stage, one geometry, two sets of pixels."""

from __future__ import annotations

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

from wsod.data.strong_augmentation import WeakStrongViews, strong_augmentation
from wsod.data.transforms import test_transform, train_transform


def test_the_ops_and_their_parameters_are_the_references():
    ops = strong_augmentation().transforms
    jitter, grayscale, blur, *erasing = ops
    assert isinstance(jitter, v2.RandomApply) and jitter.p == 0.8
    (color,) = jitter.transforms
    assert color.brightness == (0.6, 1.4) and color.contrast == (0.6, 1.4) and color.saturation == (0.6, 1.4)
    assert color.hue == (-0.1, 0.1)
    assert isinstance(grayscale, v2.RandomGrayscale) and grayscale.p == 0.2
    assert isinstance(blur, v2.RandomApply) and blur.p == 0.5
    (gaussian,) = blur.transforms
    assert gaussian.sigma == [0.1, 2.0] and list(gaussian.kernel_size) == [13, 13]
    expected = [
        (0.7, (0.05, 0.2), (0.3, 3.3)),
        (0.5, (0.02, 0.2), (0.1, 6.0)),
        (0.3, (0.02, 0.2), (0.05, 8.0)),
    ]
    assert [(e.p, tuple(e.scale), tuple(e.ratio)) for e in erasing] == expected
    assert all(e.value is None for e in erasing)  # torchvision's "random": standard-normal noise


def test_a_strong_view_is_a_function_of_the_seed_and_keeps_the_image_shape():
    image = torch.rand(3, 40, 64, generator=torch.Generator().manual_seed(0))
    augment = strong_augmentation()
    views = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        views.append(augment(image))
    assert views[0].shape == image.shape and views[0].dtype == torch.float32
    assert torch.equal(views[0], views[1]) and not torch.equal(views[0], views[2])
    assert torch.equal(image, torch.rand(3, 40, 64, generator=torch.Generator().manual_seed(0)))  # untouched


def test_the_erasing_passes_fire_as_often_as_their_probabilities_say():
    # A view keeps every pixel in place only when all three passes skip: 0.3 x 0.5 x 0.7 = 0.105 of the
    # draws. An erased rectangle (at least 2% of the image, standard-normal noise) leaves the 0-1 range.
    augment = strong_augmentation()
    erased = 0
    for seed in range(300):
        torch.manual_seed(seed)
        out = augment(torch.full((3, 32, 32), 0.5))
        erased += bool(((out < 0) | (out > 1)).any())
    assert 0.85 <= erased / 300 <= 0.94  # 0.895, binomial standard deviation 0.018


def _item() -> dict:
    g = torch.Generator().manual_seed(0)
    image = (torch.rand(3, 40, 60, generator=g) * 255).to(torch.uint8)
    boxes = torch.tensor([[2.0, 3.0, 20.0, 30.0], [10.0, 5.0, 50.0, 35.0]])
    return {
        "image": tv_tensors.Image(image),
        "image_id": "x",
        "labels": torch.tensor([1.0, 0.0]),
        "proposals": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(40, 60)),
        "targets": {
            "labels": torch.tensor([1.0, 0.0]),
            "boxes": boxes.clone(),
            "box_labels": torch.tensor([0, 0]),
        },
        "original_size": (40, 60),
    }


def test_the_weak_and_strong_views_share_their_geometry_and_differ_in_pixels():
    views = WeakStrongViews(train_transform([32, 48, 64], 200, flip_prob=0.5, lighting_std=0.0))
    flips = set()
    for seed in range(6):
        torch.manual_seed(seed)
        weak, strong = views(_item())
        flips.add(weak["flipped"])
        for key in ("image_size", "flipped", "scale"):
            assert weak[key] == strong[key]
        torch.testing.assert_close(weak["proposals"], strong["proposals"], rtol=0, atol=0)
        torch.testing.assert_close(weak["targets"]["boxes"], strong["targets"]["boxes"], rtol=0, atol=0)
        assert weak["image"].shape == strong["image"].shape and not torch.equal(
            weak["image"], strong["image"]
        )
        torch.manual_seed(seed)  # the item's seeded stream: the same pair again
        again_weak, again_strong = views(_item())
        assert torch.equal(again_weak["image"], weak["image"]) and torch.equal(
            again_strong["image"], strong["image"]
        )
    assert flips == {True, False}  # the geometry is the weak view's random one


def test_the_strong_view_is_the_weak_ones_pixels_through_the_strong_ops():
    identity = WeakStrongViews(test_transform(32), strong=lambda pixels: pixels)
    weak, strong = identity(_item())
    torch.testing.assert_close(strong["image"], weak["image"], rtol=0, atol=1e-6)  # un-normalised and back
    seen = []
    recorder = WeakStrongViews(test_transform(32), strong=lambda pixels: seen.append(pixels) or pixels)
    recorder(_item())
    assert seen[0].min() >= 0.0 and seen[0].max() <= 1.0  # the ops see the RGB 0-1 image
