"""The targets seam, data side: a record's supervision travels as one targets dict through the dataset,
the transform and collate, every geometric field moved with the image by the proposals' own map."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from wsod.data.dataset import ImageRecord, WeakDetectionDataset
from wsod.data.loader import collate, model_inputs
from wsod.data.targets import geometry_kind, geometry_of, make_targets
from wsod.data.transforms import horizontal_flip, test_transform, train_transform

CLASSES = ("cat", "dog", "bird")
HEIGHT, WIDTH = 60, 100
# A proposal, and the same rectangle as supervision: its corners as points, itself as a box.
PROPOSAL = [10.0, 5.0, 30.0, 25.0]


def _dataset(tmp_path, jpeg, write_pickle, supervision, transform, height=HEIGHT, width=WIDTH):
    """One image of ``height`` x ``width`` with labels (0, 1, 0), the record's ``supervision``, two
    proposals; built like any format reader's dataset."""
    jpeg(tmp_path / "a.jpg", height, width)
    record = ImageRecord(
        "a", str(tmp_path / "a.jpg"), height, width, np.array([0, 1, 0], np.float32), supervision=supervision
    )
    proposals = write_pickle({"a": [[0, 0, 50, 40], PROPOSAL]})
    return WeakDetectionDataset([record], CLASSES, proposals, transform=transform)


def test_points_on_a_record_come_out_of_the_loader_resized_and_flipped(tmp_path, jpeg, write_pickle):
    supervision = {"points": [[10, 20], [30, 5]], "point_labels": [1, 0]}
    # The training transform with one scale (60 -> 90: x 1.5, width 150) and the flip forced.
    transform = train_transform(scales=(90,), max_size=1000, flip_prob=1.0)
    batch = collate([_dataset(tmp_path, jpeg, write_pickle, supervision, transform)[0]])
    (targets,) = batch["targets"]
    assert set(targets) == {"labels", "points", "point_labels", "proposal_ids"} and batch["flipped"] == [True]
    # (10, 20) -> (15, 30) -> (150 - 15, 30); (30, 5) -> (45, 7.5) -> (150 - 45, 7.5).
    torch.testing.assert_close(targets["points"], torch.tensor([[135.0, 30.0], [105.0, 7.5]]), rtol=0, atol=0)
    assert type(targets["points"]) is torch.Tensor and targets["points"].dtype == torch.float32
    torch.testing.assert_close(targets["point_labels"], torch.tensor([1, 0]))  # int64, unchanged
    torch.testing.assert_close(targets["labels"], torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(targets["labels"], batch["image_labels"][0])


def test_points_without_the_flip_are_only_resized(tmp_path, jpeg, write_pickle):
    supervision = {"points": [[10, 20], [30, 5]], "point_labels": [1, 0]}
    transform = train_transform(scales=(90,), max_size=1000, flip_prob=0.0)
    batch = collate([_dataset(tmp_path, jpeg, write_pickle, supervision, transform)[0]])
    torch.testing.assert_close(batch["targets"][0]["points"], torch.tensor([[15.0, 30.0], [45.0, 7.5]]))


def test_boxes_on_a_record_come_out_of_the_loader_resized_and_flipped(tmp_path, jpeg, write_pickle):
    supervision = {"boxes": [[10, 20, 40, 50]], "box_labels": [2]}
    transform = train_transform(scales=(90,), max_size=1000, flip_prob=1.0)
    batch = collate([_dataset(tmp_path, jpeg, write_pickle, supervision, transform)[0]])
    (targets,) = batch["targets"]
    # x 1.5: (15, 30, 60, 75); flipped in width 150: x1' = 150 - 60, x2' = 150 - 15.
    torch.testing.assert_close(targets["boxes"], torch.tensor([[90.0, 30.0, 135.0, 75.0]]), rtol=0, atol=0)
    assert type(targets["boxes"]) is torch.Tensor
    torch.testing.assert_close(targets["box_labels"], torch.tensor([2]))


def test_scribbles_move_as_points_with_their_stroke_ids_and_labels_unchanged(tmp_path, jpeg, write_pickle):
    supervision = {
        "scribble_points": [[0, 0], [10, 20], [12, 22], [100, 60]],
        "scribble_labels": [1, 1, 1, 0],
        "scribble_ids": [0, 0, 0, 1],
    }
    transform = test_transform(90, max_size=1000, flip=True)
    (targets,) = collate([_dataset(tmp_path, jpeg, write_pickle, supervision, transform)[0]])["targets"]
    expected = torch.tensor([[150.0, 0.0], [135.0, 30.0], [132.0, 33.0], [0.0, 90.0]])
    torch.testing.assert_close(targets["scribble_points"], expected, rtol=0, atol=0)
    assert targets["scribble_ids"].tolist() == [0, 0, 0, 1] and targets["scribble_labels"].tolist() == [
        1,
        1,
        1,
        0,
    ]


def test_an_image_without_supervision_has_targets_with_labels_only(tmp_path, jpeg, write_pickle):
    for supervision in (None, {}):
        dataset = _dataset(tmp_path, jpeg, write_pickle, supervision, train_transform((90,), 1000))
        item = dataset[0]
        assert set(item["targets"]) == {"labels"} and "labels" in item  # other code reads item["labels"]
        assert set(collate([item])["targets"][0]) == {"labels", "proposal_ids"}  # ids: the loader's
    untransformed = _dataset(tmp_path, jpeg, write_pickle, None, None)[0]
    torch.testing.assert_close(untransformed["targets"]["labels"], untransformed["labels"])


def test_before_the_transform_geometry_is_tv_tensors_on_the_original_canvas(tmp_path, jpeg, write_pickle):
    supervision = {"points": np.array([[10, 20]]), "boxes": np.zeros((0, 4)), "point_weights": [0.5]}
    targets = _dataset(tmp_path, jpeg, write_pickle, supervision, None)[0]["targets"]
    assert isinstance(targets["points"], tv_tensors.KeyPoints) and targets["points"].canvas_size == (60, 100)
    assert isinstance(targets["boxes"], tv_tensors.BoundingBoxes) and targets["boxes"].shape == (0, 4)
    assert targets["point_weights"].dtype == torch.float32  # floats as float32, whatever numpy made them


def test_points_and_boxes_follow_the_proposals_map_for_every_drawn_scale_and_flip(
    tmp_path, jpeg, write_pickle
):
    # Points on the proposal's corners stay on them and the box stays the proposal, for every scale and
    # flip drawn (33 x 50 rounds the two axes differently): one affine map for every field.
    supervision = {"points": [PROPOSAL[:2], PROPOSAL[2:]], "boxes": [PROPOSAL]}
    transform = train_transform((40, 64, 100), 1000, flip_prob=0.5, lighting_std=0.1)
    dataset = _dataset(tmp_path, jpeg, write_pickle, supervision, transform, height=33, width=50)
    flips = set()
    for seed in range(12):
        item = dataset[(0, seed)]
        proposal = item["proposals"][1]
        flips.add(item["flipped"])
        corners = proposal.view(2, 2) if not item["flipped"] else proposal[[2, 1, 0, 3]].view(2, 2)
        torch.testing.assert_close(item["targets"]["points"], corners, rtol=0, atol=0)
        torch.testing.assert_close(item["targets"]["boxes"][0], proposal, rtol=0, atol=0)
    assert flips == {True, False}


def test_the_random_draws_stay_scale_then_flip_then_lighting_with_or_without_targets():
    scales = (40, 50, 70)
    transform = train_transform(scales, 1000, flip_prob=0.5, lighting_std=0.1)

    def item(with_targets):
        image = tv_tensors.Image(
            torch.randint(
                0, 256, (3, HEIGHT, WIDTH), generator=torch.Generator().manual_seed(1), dtype=torch.uint8
            )
        )
        out = {
            "image": image,
            "labels": torch.tensor([1.0, 0.0, 0.0]),
            "proposals": tv_tensors.BoundingBoxes(
                torch.tensor([PROPOSAL]), format="XYXY", canvas_size=(60, 100)
            ),
            "original_size": (HEIGHT, WIDTH),
        }
        if with_targets:
            out["targets"] = {
                "labels": out["labels"],
                "points": torch.tensor([[1.0, 2.0]]),
                "boxes": torch.tensor([PROPOSAL]),
            }
        return out

    for seed in range(6):
        torch.manual_seed(seed)
        plain = transform(item(False))
        torch.manual_seed(seed)
        ours = transform(item(True))
        after = torch.get_rng_state()
        # The draws, written out: the scale (RandomChoice), the flip, the three lighting coefficients.
        torch.manual_seed(seed)
        scale = scales[int(torch.multinomial(torch.tensor([1 / 3] * 3), 1))]
        flipped = bool(torch.rand(()) < 0.5)
        torch.randn(3)
        assert torch.equal(torch.get_rng_state(), after)
        assert ours["image_size"][0] == scale and ours["flipped"] == flipped == plain["flipped"]
        torch.testing.assert_close(ours["image"], plain["image"], rtol=0, atol=0)
        torch.testing.assert_close(ours["proposals"], plain["proposals"], rtol=0, atol=0)


def test_torchvision_flips_keypoints_one_pixel_left_of_the_box_rule_which_wsod_keeps_for_points():
    # Why horizontal_flip handles points itself: torchvision 0.29 mirrors keypoints as pixel indices.
    points = tv_tensors.KeyPoints(torch.tensor([[10.0, 20.0], [0.0, 5.0]]), canvas_size=(60, 100))
    torchvision_flip = F.horizontal_flip(points).as_subclass(torch.Tensor)
    torch.testing.assert_close(torchvision_flip, torch.tensor([[89.0, 20.0], [99.0, 5.0]]))
    ours = horizontal_flip(points)
    assert isinstance(ours, tv_tensors.KeyPoints) and ours.canvas_size == (60, 100)
    torch.testing.assert_close(ours.as_subclass(torch.Tensor), torch.tensor([[90.0, 20.0], [100.0, 5.0]]))
    torch.testing.assert_close(horizontal_flip(ours), points)  # its own inverse
    box = tv_tensors.BoundingBoxes(
        torch.tensor([[10.0, 20.0, 10.0, 20.0]]), format="XYXY", canvas_size=(60, 100)
    )
    torch.testing.assert_close(horizontal_flip(box)[0, :2], ours[0])  # a point and a zero-size box agree


def test_the_transform_leaves_the_item_and_its_targets_as_they_were():
    # Test-time augmentation transforms one item once per view.
    points = tv_tensors.KeyPoints(torch.tensor([[10.0, 20.0]]), canvas_size=(HEIGHT, WIDTH))
    targets = {"labels": torch.tensor([1.0, 0.0, 0.0]), "points": points}
    item = {
        "image": tv_tensors.Image(torch.zeros(3, HEIGHT, WIDTH, dtype=torch.uint8)),
        "labels": targets["labels"],
        "targets": targets,
        "proposals": tv_tensors.BoundingBoxes(torch.tensor([PROPOSAL]), format="XYXY", canvas_size=(60, 100)),
        "original_size": (HEIGHT, WIDTH),
    }
    views = [test_transform(s, 1000, flip=f)(item) for s in (90, 30) for f in (False, True)]
    assert item["targets"] is targets and targets["points"] is points and points.tolist() == [[10.0, 20.0]]
    assert [v["targets"]["points"].tolist() for v in views] == [
        [[15, 30]],
        [[135, 30]],
        [[5, 10]],
        [[45, 10]],
    ]


def test_hand_built_targets_with_plain_geometry_move_on_the_image_canvas():
    geometry = geometry_of({"labels": torch.zeros(3), "points": torch.tensor([[1.0, 2.0]])}, (60, 100))
    assert set(geometry) == {"points"} and geometry["points"].canvas_size == (60, 100)
    with pytest.raises(ValueError, match="'corners'.*KeyPoints.*rename"):
        geometry_of({"corners": tv_tensors.KeyPoints(torch.zeros(1, 2), canvas_size=(60, 100))}, (60, 100))
    with pytest.raises(ValueError, match="'boxes' has shape"):
        geometry_of({"boxes": torch.zeros(2, 2)}, (60, 100))
    with pytest.raises(ValueError, match="'points' is a BoundingBoxes; its name asks for KeyPoints"):
        geometry_of(
            {"points": tv_tensors.BoundingBoxes(torch.zeros(1, 4), format="XYXY", canvas_size=(6, 9))}, (6, 9)
        )
    with pytest.raises(ValueError, match="'boxes' is in XYWH format"):
        geometry_of(
            {"boxes": tv_tensors.BoundingBoxes(torch.zeros(1, 4), format="XYWH", canvas_size=(6, 9))}, (6, 9)
        )
    with pytest.raises(ValueError, match=r"'points' is on a \(6, 9\) canvas but the image is \(60, 100\)"):
        geometry_of({"points": tv_tensors.KeyPoints(torch.zeros(1, 2), canvas_size=(6, 9))}, (60, 100))


def test_geometry_is_recognised_by_the_field_name():
    assert [geometry_kind(n) for n in ("points", "scribble_points", "boxes", "given_boxes")] == [
        "points",
        "points",
        "boxes",
        "boxes",
    ]
    assert {
        geometry_kind(n) for n in ("labels", "point_labels", "scribble_ids", "box_labels", "pointsx")
    } == {None}


def test_targets_copy_the_record_arrays():
    supervision = {"points": np.array([[1.0, 2.0]], np.float32), "point_labels": np.array([3], np.int32)}
    targets = make_targets(torch.zeros(3), supervision, (60, 100))
    targets["points"].add_(1)
    assert supervision["points"].tolist() == [[1.0, 2.0]] and targets["point_labels"].dtype == torch.int64


def test_model_inputs_move_every_target_tensor_to_the_device():
    item = {
        "image": torch.zeros(3, 32, 32),
        "image_id": "a",
        "labels": torch.tensor([1.0, 0.0, 0.0]),
        "targets": {
            "labels": torch.tensor([1.0, 0.0, 0.0]),
            "points": torch.ones(2, 2),
            "point_labels": torch.ones(2, dtype=torch.int64),
        },
        "proposals": torch.tensor([PROPOSAL]),
        "image_size": (32, 32),
        "original_size": (32, 32),
        "flipped": False,
    }
    inputs = model_inputs(collate([item]), device="meta")  # a device every machine has
    assert all(v.device.type == "meta" for t in inputs["targets"] for v in t.values())
    assert inputs["targets"][0]["point_labels"].dtype == torch.int64


@pytest.mark.parametrize(
    ("supervision", "message"),
    [
        ({"labels": [1, 0, 0]}, "named 'labels'.*rename"),
        ({"points": [[1, 2, 3]]}, "'points' has shape \\(1, 3\\).*\\(N, 2\\)"),
        ({"points": [[150, 5]]}, "'points' reaches outside the 60x100"),
        ({"points": [[math.nan, 5]]}, "'points' holds a NaN"),
        ({"given_boxes": [[10, 10, 5, 20]]}, "'given_boxes' has a box with x2 < x1"),
        ({"point_classes": ["cat"]}, "'point_classes' holds <U3 values.*class indices"),
        ({"points": [[1, 2], [3, 4]], "point_labels": [0]}, "'point_labels' has 1 values for the 2 rows"),
        ({"scribble_points": [[1, 2]], "scribble_ids": [0, 0]}, "'scribble_ids' has 2 values for the 1 rows"),
    ],
)
def test_bad_supervision_is_an_error_naming_the_image_and_the_field(
    tmp_path, jpeg, write_pickle, supervision, message
):
    with pytest.raises(ValueError, match=message) as error:
        _dataset(tmp_path, jpeg, write_pickle, supervision, None)
    assert "image 'a'" in str(error.value) and "a.jpg" in str(error.value)
