"""Several views of one training image (``data.train.views``): each view is the random transform drawn
once more from the item's seeded stream, with the proposals and every geometric target field mapped by
that view's own resize and flip; ``proposal_ids`` match ROIs across views (also after ROI sampling);
collate flattens the views image-major; one view is today's plain item."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torchvision import tv_tensors

from wsod.build import _train_transform
from wsod.config_checks import ConfigError, check_config
from wsod.data.loader import collate, split_views
from wsod.data.roi_sampling import PartialLabelRoiSampler
from wsod.data.targets import make_targets
from wsod.data.transforms import DetectionTransform, MultiViewTransform, train_transform
from wsod.data.voc import VOCDataset

HEIGHT, WIDTH = 60, 100
PROPOSALS = torch.tensor(
    [[0.0, 0.0, 99.0, 59.0], [10.0, 20.0, 30.0, 50.0], [0.5, 1.5, 2.5, 3.5], [40, 5, 90, 55]]
)
POINTS = torch.tensor([[20.0, 30.0], [70.0, 10.0]])
BOXES = torch.tensor([[12.0, 22.0, 28.0, 48.0]])


def _item(image_id="x", seed=0):
    """A random 60 x 100 image with four proposals, two points and a box (on the original canvas)."""
    generator = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (3, HEIGHT, WIDTH), dtype=torch.uint8, generator=generator)
    labels = torch.tensor([1.0, 1.0])
    supervision = {
        "points": POINTS.numpy(),
        "point_labels": [0, 1],
        "boxes": BOXES.numpy(),
        "box_labels": [0],
    }
    return {
        "image": tv_tensors.Image(image),
        "image_id": image_id,
        "labels": labels,
        "targets": make_targets(labels, supervision, (HEIGHT, WIDTH)),
        "proposals": tv_tensors.BoundingBoxes(PROPOSALS, format="XYXY", canvas_size=(HEIGHT, WIDTH)),
        "original_size": (HEIGHT, WIDTH),
        "gt_boxes": BOXES.clone(),
    }


def _back_to_original(xy: torch.Tensor, view: dict) -> torch.Tensor:
    """Coordinates (..., 2k) of ``view`` (x at even columns) mapped back to the original image: undo the
    flip (x -> w - x, boxes' x1 and x2 swapped back), then the resize (per axis)."""
    h, w = view["image_size"]
    out = xy.clone()
    if view["flipped"]:
        out[..., 0::2] = w - out[..., 0::2]
        if out.shape[-1] == 4:
            out = out[..., [2, 1, 0, 3]]
    out[..., 0::2] *= WIDTH / w
    out[..., 1::2] *= HEIGHT / h
    return out


def _assert_same_item(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "targets":
            assert a[key].keys() == b[key].keys()
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), name
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_views_differ_but_each_maps_the_proposals_and_targets_by_its_own_resize_and_flip():
    transform = MultiViewTransform(train_transform((40, 50, 70), 1000, flip_prob=0.5, lighting_std=0.1), 6)
    item = _item()
    before = copy.deepcopy(item)
    torch.manual_seed(0)
    views = transform(item)
    assert len(views) == 6
    draws = {(v["image_size"], v["flipped"]) for v in views}
    assert len({size for size, _ in draws}) > 1 and {f for _, f in draws} == {True, False}  # own draws
    for view in views:
        atol = max(WIDTH / view["image_size"][1], HEIGHT / view["image_size"][0]) * 1e-4
        torch.testing.assert_close(
            _back_to_original(view["proposals"], view), PROPOSALS, atol=atol, rtol=1e-5
        )
        targets = view["targets"]
        torch.testing.assert_close(_back_to_original(targets["points"], view), POINTS, atol=atol, rtol=1e-5)
        torch.testing.assert_close(_back_to_original(targets["boxes"], view), BOXES, atol=atol, rtol=1e-5)
        assert targets["point_labels"].tolist() == [0, 1] and targets["box_labels"].tolist() == [0]
        assert torch.equal(view["proposal_ids"], torch.arange(len(PROPOSALS)))
        assert view["proposal_ids"].dtype == torch.int64
        torch.testing.assert_close(view["gt_boxes"], BOXES)  # evaluation's: original pixels
    # Each view draws its own lighting too: no two views have the same pixels, even at one size and flip.
    for k, first in enumerate(views):
        for second in views[k + 1 :]:
            assert first["image"].shape != second["image"].shape or not torch.equal(
                first["image"], second["image"]
            )
    # Every view started from the untouched item.
    _assert_same_item(item, before)


def test_views_are_the_single_view_transform_drawn_in_turn_and_one_view_is_the_plain_item():
    single = train_transform((40, 50, 70), 1000, flip_prob=0.5, lighting_std=0.1)
    torch.manual_seed(3)
    in_turn = [single(_item()) for _ in range(3)]
    torch.manual_seed(3)
    views = MultiViewTransform(single, 3)(_item())
    for a, b in zip(in_turn, views, strict=True):
        _assert_same_item(a, b)
    torch.manual_seed(3)
    (one,) = MultiViewTransform(single, 1)(_item())
    _assert_same_item(one, in_turn[0])


def test_given_proposal_ids_pass_through_and_bad_ones_are_refused():
    item = {**_item(), "proposal_ids": torch.tensor([7, 3, 9, 1])}
    out = DetectionTransform([60], 1000)(item)
    assert out["proposal_ids"].tolist() == [7, 3, 9, 1]
    with pytest.raises(ValueError, match="proposal_ids has 2 values for 4 proposals"):
        DetectionTransform([60], 1000)({**item, "proposal_ids": torch.tensor([0, 1])})


@pytest.mark.parametrize("views", [0, -1, 1.5, True])
def test_a_view_count_below_one_is_refused(views):
    with pytest.raises(ValueError, match=r"^views must be an integer >= 1 \(data.train.views\)"):
        MultiViewTransform(DetectionTransform([60], 1000), views)


def test_the_config_rule_refuses_zero_views_naming_the_key():
    with pytest.raises(ConfigError) as error:
        check_config({"data": {"train": {"views": 0}}})
    problems = str(error.value).splitlines()[1:]
    assert problems == ["  data.train.views=0: expected an integer >= 1"]
    check_config({"data": {"train": {"views": 2}}})


def test_the_same_seed_gives_the_same_views_through_the_dataset(make_voc, write_pickle):
    devkit = make_voc({"a": (40, 60, [("cat", ("3", "3", "20", "30"), 0)])}, {"trainval": ["a"]})
    proposals = write_pickle({"a": [[0, 0, 30, 30], [28, 2, 58, 38], [5, 5, 50, 35]]})
    transform = MultiViewTransform(train_transform((30, 40, 50), 1000, flip_prob=0.5), 4)
    dataset = VOCDataset(devkit, "2007", "trainval", proposals, classes=("cat", "dog"), transform=transform)
    torch.manual_seed(0)
    first = dataset[(0, 11)]
    stream = torch.rand(3)
    torch.manual_seed(0)
    again = dataset[(0, 11)]
    assert torch.equal(stream, torch.rand(3))  # the item's draws leave the process's stream alone
    assert len(first) == len(again) == 4
    for a, b in zip(first, again, strict=True):
        _assert_same_item(a, b)
    assert len({(v["image_size"], v["flipped"]) for v in first}) > 1
    assert all(torch.equal(v["proposal_ids"], first[0]["proposal_ids"]) for v in first)


def _hand_view(image_id, height, width, rois, flipped=False):
    """A transformed-looking view built by hand: no targets, no proposal_ids."""
    return {
        "image": torch.full((3, height, width), float(height)),
        "image_id": image_id,
        "labels": torch.tensor([1.0, 0.0]) if image_id == "a" else torch.tensor([0.0, 1.0]),
        "proposals": torch.arange(rois * 4, dtype=torch.float32).view(rois, 4),
        "image_size": (height, width),
        "original_size": (height, width),
        "flipped": flipped,
    }


def test_collate_flattens_views_image_major_and_split_views_undoes_it():
    items = [
        [_hand_view("a", 20 + v, 30, 2 + v, flipped=bool(v % 2)) for v in range(3)],
        [_hand_view("b", 40 + v, 30, 5, flipped=bool(v % 2)) for v in range(3)],
    ]
    batch = collate(items)
    assert batch["views"] == 3 and batch["images"].shape[0] == 6
    assert batch["image_ids"] == ["a", "a", "a", "b", "b", "b"]
    for i in range(2):
        for v in range(3):
            row, view = i * 3 + v, items[i][v]
            h, w = view["image_size"]
            assert torch.equal(batch["images"][row, :, :h, :w], view["image"])
            assert batch["proposals"][row] is view["proposals"] and batch["image_sizes"][row] == (h, w)
            assert batch["flipped"][row] == view["flipped"] and batch["original_sizes"][row] == (h, w)
            assert torch.equal(batch["image_labels"][row], view["labels"])
            ids = batch["targets"][row]["proposal_ids"]
            assert ids.dtype == torch.int64 and ids.tolist() == list(range(len(view["proposals"])))
            assert set(batch["targets"][row]) == {"labels", "proposal_ids"}
    images = split_views(batch["images"], batch["views"])
    assert images.shape == (2, 3, *batch["images"].shape[1:])
    assert torch.equal(images[1, 2], batch["images"][5]) and images.data_ptr() == batch["images"].data_ptr()
    per_image = split_views(batch["image_ids"], batch["views"])
    assert per_image == [["a", "a", "a"], ["b", "b", "b"]]
    assert split_views(batch["proposals"], 3)[0][1] is items[0][1]["proposals"]
    assert [x for row in split_views(batch["flipped"], 3) for x in row] == batch["flipped"]  # round trip
    with pytest.raises(ValueError, match="6 rows do not split into views of 4"):
        split_views(batch["image_ids"], 4)


def test_collate_of_plain_items_has_one_view_and_refuses_mixed_or_ragged_views():
    a, b = _hand_view("a", 20, 30, 2), _hand_view("b", 40, 30, 5)
    batch = collate([a, b])
    assert batch["views"] == 1 and batch["image_ids"] == ["a", "b"]
    assert [t["proposal_ids"].tolist() for t in batch["targets"]] == [[0, 1], [0, 1, 2, 3, 4]]
    assert "proposal_ids" not in a and "targets" not in a  # the items are left as they were
    assert split_views(batch["image_ids"], 1) == [["a"], ["b"]]
    with pytest.raises(TypeError, match="mixed"):
        collate([a, [b, b]])
    with pytest.raises(ValueError, match=r"same number .* of views.*\[1, 2\]"):
        collate([[a], [b, b]])


def _sampling_config(views):
    return OmegaConf.create(
        {
            "scales": [40, 50, 70], "max_size": 1000, "flip": True, "lighting_std": 0.0, "views": views,
            "roi_sampling": {"rois_per_image": 3, "positive_fraction": 0.34},
        }
    )  # fmt: skip


def _many_proposals_item():
    """The item with 40 proposals (random boxes), so that sampling 3 ROIs keeps a different set per view."""
    item = _item()
    generator = torch.Generator().manual_seed(5)
    xy = torch.rand(40, 2, generator=generator) * torch.tensor([WIDTH / 2, HEIGHT / 2])
    wh = torch.rand(40, 2, generator=generator) * torch.tensor([WIDTH / 2 - 1, HEIGHT / 2 - 1]) + 1
    boxes = torch.cat([xy, xy + wh], dim=1)
    item["proposals"] = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(HEIGHT, WIDTH))
    return item


def test_roi_sampling_runs_per_view_and_keeps_the_ids_aligned_with_the_proposals():
    item = _many_proposals_item()
    original = item["proposals"].as_subclass(torch.Tensor)
    transform = _train_transform(_sampling_config(4), sample_rois=True)
    assert isinstance(transform, MultiViewTransform) and transform.views == 4
    torch.manual_seed(1)
    views = transform(item)
    kept = set()
    for view in views:
        ids = view["proposal_ids"]
        assert len(ids) == len(view["proposals"]) == 3 and ids.dtype == torch.int64
        torch.testing.assert_close(
            _back_to_original(view["proposals"], view), original[ids], atol=1e-3, rtol=1e-5
        )
        kept.add(tuple(ids.tolist()))
    assert len(kept) > 1  # each view sampled its own ROIs
    # The sampler alone: ids subset with the proposals.
    single = DetectionTransform([60], 1000)(item)
    sampled = PartialLabelRoiSampler(rois_per_image=3, positive_fraction=0.34)(single)
    assert torch.equal(sampled["proposals"], single["proposals"][sampled["proposal_ids"]])
    assert len(single["proposal_ids"]) == 40  # the input item of the sampler left as it was


def test_one_view_in_the_config_keeps_the_plain_transform():
    transform = _train_transform(_sampling_config(1), sample_rois=True)
    assert not isinstance(transform, MultiViewTransform)
    torch.manual_seed(2)
    assert isinstance(transform(_many_proposals_item()), dict)
    without_key = _sampling_config(1)
    del without_key["views"]
    assert not isinstance(_train_transform(without_key), MultiViewTransform)  # a config saved before views
