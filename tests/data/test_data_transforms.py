"""Transforms: proposals follow resize and flip exactly, size limits hold, normalisation is ImageNet's,
lighting noise is the reference's PCA noise."""

from __future__ import annotations

import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from wsod.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DetectionTransform,
    Lighting,
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


# The reference code's constants (data/transforms/build.py), written out again to check the module's.
REFERENCE_EIGVAL = [0.2175, 0.0188, 0.0045]
REFERENCE_EIGVEC = [[-0.5675, 0.7192, 0.4009], [-0.5808, -0.0045, -0.8140], [-0.5836, -0.6948, 0.4203]]


def naive_lighting_offset(alpha):
    """Per channel i: sum over eigenvectors j of eigvec[i][j] * alpha[j] * eigval[j] (AlexNet PCA noise)."""
    return [sum(REFERENCE_EIGVEC[i][j] * alpha[j] * REFERENCE_EIGVAL[j] for j in range(3)) for i in range(3)]


def test_zero_std_lighting_is_the_identity_and_draws_nothing():
    image = torch.rand(3, 5, 7)
    torch.manual_seed(0)
    assert Lighting(0.0)(image) is image
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))  # the generator was not used
    item = _item()
    torch.manual_seed(3)
    with_zero = train_transform((40, 50), 1000, flip_prob=0.5, lighting_std=0.0)(item)
    torch.manual_seed(3)
    before = DetectionTransform((40, 50), 1000, flip_prob=0.5)(item)  # no lighting at all
    torch.testing.assert_close(with_zero["image"], before["image"], rtol=0, atol=0)


def test_lighting_adds_the_reference_pca_offset_to_rgb_0_1_before_normalisation():
    image = torch.rand(3, 4, 6, dtype=torch.float32)
    torch.manual_seed(7)
    noisy = Lighting(0.1)(image)
    torch.manual_seed(7)
    alpha = (torch.randn(3) * 0.1).tolist()  # the three draws, in eigenvector order
    expected = torch.tensor(naive_lighting_offset(alpha)).view(3, 1, 1)
    torch.testing.assert_close(noisy - image, expected.expand_as(image), rtol=0, atol=1e-7)
    # In the detection transform the offset lands on 0-1 RGB, before the ImageNet normalisation.
    colour = (255, 128, 0)
    item = _item(colour=colour)
    torch.manual_seed(11)
    out = train_transform((60,), 1000, flip_prob=0.0, lighting_std=0.1)(item)
    torch.manual_seed(11)
    train_transform((60,), 1000, flip_prob=0.0, lighting_std=0.0)(item)  # the same scale draw
    offset = naive_lighting_offset((torch.randn(3) * 0.1).tolist())
    expected = [
        (v / 255 + o - m) / sd
        for v, o, m, sd in zip(colour, offset, IMAGENET_MEAN, IMAGENET_STD, strict=True)
    ]
    torch.testing.assert_close(out["image"][:, 30, 50], torch.tensor(expected), atol=1e-5, rtol=0)
    assert train_transform().lighting_std == 0.1 and test_transform(60).lighting_std == 0.0


def test_lighting_leaves_geometry_and_its_random_draws_alone():
    # Lighting draws after the scale and the flip: the same seed gives the same sizes, flips, proposals.
    for seed in range(8):
        torch.manual_seed(seed)
        noisy = train_transform((40, 50, 70), 1000, flip_prob=0.5, lighting_std=0.1)(_item())
        torch.manual_seed(seed)
        plain = train_transform((40, 50, 70), 1000, flip_prob=0.5, lighting_std=0.0)(_item())
        assert noisy["image_size"] == plain["image_size"] and noisy["flipped"] == plain["flipped"]
        torch.testing.assert_close(noisy["proposals"], plain["proposals"], rtol=0, atol=0)
        assert not torch.equal(noisy["image"], plain["image"])
    with pytest.raises(ValueError, match="lighting"):
        Lighting(-0.1)


def test_true_boxes_ride_in_the_targets_exactly_as_the_proposals_move_and_draw_no_random_number():
    # The pseudo-label quality log (wsod/engine/pseudo_label_quality.py) compares pseudo boxes, which
    # are proposals or boxes made from them, with these: they must share the proposals' every move.
    item = {**_item(), "gt_labels": torch.tensor([1, 0, 1])}
    plain = train_transform(scales=(90, 120), max_size=1000, flip_prob=0.5, lighting_std=0.1)
    carried = train_transform(
        scales=(90, 120), max_size=1000, flip_prob=0.5, lighting_std=0.1, true_boxes=True
    )
    flips = set()
    for seed in range(8):
        torch.manual_seed(seed)
        without = plain(item)
        torch.manual_seed(seed)
        out = carried(item)
        # The same draws: the same scale, flip and lighting noise as without the true boxes.
        assert torch.equal(out["image"], without["image"]) and torch.equal(
            out["proposals"], without["proposals"]
        )
        assert "true_boxes" not in without.get("targets", {})
        assert torch.equal(out["targets"]["true_boxes"], out["proposals"])  # the gt boxes are the proposals
        assert type(out["targets"]["true_boxes"]) is torch.Tensor
        assert out["targets"]["true_labels"].tolist() == [1, 0, 1]
        assert out["targets"]["labels"].tolist() == [1.0, 0.0]  # the item had no targets: its labels
        torch.testing.assert_close(out["gt_boxes"], torch.tensor(PROPOSALS), rtol=0, atol=0)  # untouched
        flips.add(out["flipped"])
    assert flips == {True, False}
    assert "true_boxes" not in item.get("targets", {})  # the input item is left as it was

    no_truth = {k: v for k, v in _item().items() if k != "gt_boxes"}
    assert "targets" not in carried(no_truth)  # nothing to carry: label-only data passes unchanged
