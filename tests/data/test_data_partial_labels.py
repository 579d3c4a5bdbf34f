"""wsod/data/partial_labels.py and the ROI sampling step: points, scribbles and boxes read from a side file
(VOC, toy, folder) and from COCO annotations, moved exactly by resize and flip (worked by hand), bad
input named by file and annotation, and the training transform's sampling of images with points."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from wsod.data.coco import CocoDataset, load_coco_records
from wsod.data.roi_sampling import PartialLabelRoiSampler
from wsod.data.toy import OBJECT_SIZE
from wsod.data.transforms import DetectionTransform
from wsod.data.voc import VOCDataset

CLASSES = ("cat", "dog", "bird")
# Image a: 40 x 60 (H x W), a cat and a dog; image b: a bird.
IMAGES = {
    "a": (40, 60, [("cat", ("3", "3", "20", "30"), 0), ("dog", ("30", "5", "55", "35"), 0)]),
    "b": (40, 60, [("bird", ("10", "10", "30", "30"), 0)]),
}


@pytest.fixture
def voc(make_voc, write_pickle):
    devkit = make_voc(IMAGES, {"trainval": ["a", "b"]})
    proposals = write_pickle({"a": [[0, 0, 30, 30], [28, 2, 58, 38]], "b": [[5, 5, 35, 35]]})
    return devkit, proposals


def _side_file(tmp_path, images, name="partial.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"images": images}))
    return path


def _open(voc, partial, **kwargs):
    devkit, proposals = voc
    return VOCDataset(
        devkit, "2007", "trainval", proposals, classes=CLASSES, partial_labels=partial, **kwargs
    )


def test_a_side_file_gives_its_images_points_scribbles_and_boxes_and_leaves_the_others(voc, tmp_path):
    partial = _side_file(
        tmp_path,
        {
            "a": [
                {"class": "cat", "point": [10, 12]},
                {"class": "dog", "scribble": [[35, 40, 50], [10, 20, 30]]},
                {"class": "dog", "box": [29, 4, 54, 34]},
                {"class": "cat", "scribble": [[5, 6], [7, 8]]},
            ]
        },
    )
    dataset = _open(voc, partial)
    a, b = dataset.records
    assert b.supervision is None
    s = a.supervision
    np.testing.assert_array_equal(s["points"], [[10, 12]])
    np.testing.assert_array_equal(s["point_labels"], [0])
    np.testing.assert_array_equal(s["scribble_points"], [[35, 10], [40, 20], [50, 30], [5, 7], [6, 8]])
    np.testing.assert_array_equal(s["scribble_labels"], [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(s["scribble_ids"], [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(s["boxes"], [[29, 4, 54, 34]])
    np.testing.assert_array_equal(s["box_labels"], [1])
    targets = dataset[0]["targets"]
    assert sorted(targets) == sorted(["labels", *s])


def test_resize_and_flip_move_points_and_scribbles_exactly(voc, tmp_path):
    partial = _side_file(
        tmp_path,
        {"a": [{"class": "cat", "point": [10, 12]}, {"class": "dog", "scribble": [[35, 50], [10, 30]]}]},
    )
    item = _open(voc, partial)[0]
    # Shorter side 40 -> 80: every coordinate x 2; the flip maps x -> w - x with w = 120.
    for flip, expect_x in ((0.0, lambda x: 2 * x), (1.0, lambda x: 120 - 2 * x)):
        out = DetectionTransform([80], 1000, flip_prob=flip)(item)
        targets = out["targets"]
        assert out["image_size"] == (80, 120) and out["flipped"] == bool(flip)
        assert targets["points"].tolist() == [[expect_x(10), 24.0]]
        assert targets["scribble_points"].tolist() == [[expect_x(35), 20.0], [expect_x(50), 60.0]]
        # The proposals move by the same map, so the point stays strictly inside its proposal.
        x1, y1, x2, y2 = out["proposals"][0].tolist()
        px, py = targets["points"][0].tolist()
        assert min(x1, x2) < px < max(x1, x2) and y1 < py < y2


@pytest.mark.parametrize(
    ("objects", "problem"),
    [
        ([{"class": "cat", "point": [61, 5]}], r"object 0: point reaches outside the 40x60"),
        ([{"class": "cat", "scribble": [[], []]}], r"object 0: scribble has no point"),
        ([{"class": "cat", "scribble": [[1, 2], [3]]}], r"2 x and 1 y coordinates"),
        ([{"class": "dog", "box": [30, 5, 30, 35]}], r"x2 <= x1 or y2 <= y1"),
        (
            [{"class": "cat", "point": [5, 5]}, {"class": "bird", "point": [5, 5]}],
            r"class 'bird', which is not among",
        ),
        ([{"class": "cow", "point": [5, 5]}], r"class 'cow' is not one of the dataset's classes"),
        ([{"class": "cat", "point": [5, 5], "box": [1, 1, 9, 9]}], r"exactly one of point, scribble, box"),
        ([{"class": "cat", "point": "5,5"}], r"point '5,5' is not \[x, y\]"),
    ],
)
def test_bad_partial_labels_name_the_file_image_and_object(voc, tmp_path, objects, problem):
    partial = _side_file(tmp_path, {"a": objects})
    with pytest.raises(ValueError, match=problem) as error:
        _open(voc, partial)
    assert str(partial) in str(error.value) and "image 'a'" in str(error.value)


def test_a_side_file_for_other_images_is_an_error_and_unknown_ids_are_skipped_with_a_count(
    voc, tmp_path, caplog
):
    with pytest.raises(ValueError, match="none of its 1 image ids is in this dataset"):
        _open(voc, _side_file(tmp_path, {"zzz": [{"class": "cat", "point": [5, 5]}]}))
    partial = _side_file(tmp_path, {"a": [{"class": "cat", "point": [5, 5]}], "zzz": []}, name="two.json")
    with caplog.at_level(logging.WARNING):
        dataset = _open(voc, partial)
    assert "1 of 2 image ids are not in this dataset" in caplog.text
    assert dataset.records[0].supervision is not None
    with pytest.raises(FileNotFoundError, match="partial labels file not found"):
        _open(voc, tmp_path / "missing.json")


@pytest.mark.parametrize(
    "images",
    [{}, {"a": [], "b": []}, {"a": [], "zzz": []}],
    ids=["no image", "images without objects", "an unknown image without objects"],
)
def test_a_side_file_that_labels_nothing_is_refused_naming_it(voc, tmp_path, images):
    """Such a file trained on image labels alone while the command named partial labels."""
    partial = _side_file(tmp_path, images)
    with pytest.raises(ValueError) as error:
        _open(voc, partial)
    assert str(error.value) == (
        f"{partial}: labels no object ({len(images)} images, none with a point, scribble or box); give a"
        " file that does (tools/make_partial_labels.py with a larger fraction), or drop the train set's"
        " partial_labels"
    )


def test_a_side_file_that_labels_none_of_the_sets_images_is_refused_naming_it(voc, tmp_path):
    """A trainval file whose labelled images all lie in the other split labels nothing of this one."""
    partial = _side_file(tmp_path, {"a": [], "b": [], "zzz": [{"class": "cat", "point": [5, 5]}]})
    with pytest.raises(ValueError) as error:
        _open(voc, partial)
    assert str(error.value) == (
        f"{partial}: labels none of this set's 2 images (the images it labels, 1, are all outside the set);"
        " give the set a file that labels some of its images, or drop its partial_labels"
    )


@pytest.mark.parametrize("name", [["cat"], {"name": "cat"}, 3, None])
def test_a_class_that_is_not_a_string_is_refused_naming_the_object(voc, tmp_path, name):
    """A class given as a list once failed with a bare ``TypeError: unhashable type: 'list'``."""
    partial = _side_file(
        tmp_path, {"a": [{"class": "cat", "point": [5, 5]}, {"class": name, "point": [5, 5]}]}
    )
    with pytest.raises(ValueError) as error:
        _open(voc, partial)
    assert str(error.value).startswith(f"{partial}: image 'a' (")
    assert str(error.value).endswith(
        f"object 1: class is {name!r}; expected one class name, a string, e.g. 'cat'"
    )


def _coco(tmp_path, jpeg, annotations):
    jpeg(tmp_path / "images" / "1.jpg", 40, 60)
    data = {
        "images": [{"id": 1, "file_name": "1.jpg", "height": 40, "width": 60}],
        "categories": [{"id": 3, "name": "cat"}, {"id": 8, "name": "dog"}],
        "annotations": annotations,
    }
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(data))
    return path


def test_coco_annotations_carry_points_scribbles_and_supervising_boxes(tmp_path, jpeg):
    path = _coco(
        tmp_path,
        jpeg,
        [
            {"id": 1, "image_id": 1, "category_id": 3, "bbox": [2, 3, 10, 20], "point": [5, 9]},
            {"id": 2, "image_id": 1, "category_id": 8, "bbox": [30, 5, 20, 25], "use_as": "box"},
            {"id": 3, "image_id": 1, "category_id": 8, "bbox": [40, 1, 5, 5], "use_as": "scribble",
             "point": [41, 2], "scribble": [[41, 43], [2, 4]]},  # use_as picks the scribble only
            {"id": 4, "image_id": 1, "category_id": 3, "bbox": [0, 0, 3, 3], "use_as": "tag",
             "point": [1, 1]},
            {"id": 5, "image_id": 1, "category_id": 3, "bbox": [1, 1, 3, 3]},  # for evaluation only
        ],
    )  # fmt: skip
    (record,), _, _ = load_coco_records(path, tmp_path / "images")
    s = record.supervision
    np.testing.assert_array_equal(s["points"], [[5, 9]])
    np.testing.assert_array_equal(s["point_labels"], [0])
    np.testing.assert_array_equal(s["boxes"], [[30, 5, 50, 30]])  # the bbox as x1 y1 x2 y2
    np.testing.assert_array_equal(s["box_labels"], [1])
    np.testing.assert_array_equal(s["scribble_points"], [[41, 2], [43, 4]])
    np.testing.assert_array_equal(s["scribble_labels"], [1, 1])
    assert record.gt_boxes.shape == (5, 4)  # every annotation's box is still ground truth


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"point": [70, 5]}, r"annotation id 1 \(image 1\): point reaches outside"),
        ({"scribble": [[], []]}, r"annotation id 1 \(image 1\): scribble has no point"),
        ({"use_as": "click"}, r"use_as is 'click'"),
        ({"use_as": "point"}, r"use_as is 'point' but the annotation has no 'point' field"),
    ],
)
def test_bad_coco_partial_labels_name_the_file_and_annotation(tmp_path, jpeg, extra, problem):
    path = _coco(
        tmp_path, jpeg, [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [2, 3, 10, 20], **extra}]
    )
    with pytest.raises(ValueError, match=problem) as error:
        load_coco_records(path, tmp_path / "images")
    assert str(path) in str(error.value)


def test_a_coco_box_of_zero_width_cannot_supervise(tmp_path, jpeg):
    path = _coco(
        tmp_path, jpeg, [{"id": 7, "image_id": 1, "category_id": 3, "bbox": [2, 3, 0, 20], "use_as": "box"}]
    )
    with pytest.raises(ValueError, match=r"annotation id 7 .*x2 <= x1"):
        CocoDataset(path, tmp_path / "images", {1: np.array([[0, 0, 9, 9]], np.float32)})


def test_the_training_transform_samples_the_rois_of_images_with_points_only(voc, tmp_path):
    partial = _side_file(tmp_path, {"a": [{"class": "cat", "point": [10, 12]}]})
    transform = lambda item: PartialLabelRoiSampler(rois_per_image=1, positive_fraction=1.0)(  # noqa: E731
        DetectionTransform([40], 1000)(item)
    )
    dataset = _open(voc, partial, transform=transform)
    # Image a: proposal 0 holds the point (the only positive), proposal 1 not: one ROI kept, the positive.
    assert dataset[(0, 3)]["proposals"].tolist() == [[0.0, 0.0, 30.0, 30.0]]
    assert len(dataset[(1, 3)]["proposals"]) == 1  # image b has no point: its one proposal as it was
    with pytest.raises(ValueError, match="positive_fraction"):
        PartialLabelRoiSampler(10, 0.0)


def test_the_train_dataset_of_a_config_reads_the_side_file_and_samples(tiny_toy, tmp_path):
    from omegaconf import OmegaConf

    from wsod.build import build_train_dataset

    first_id = tiny_toy.dataset("trainval").image_ids[0]
    record = tiny_toy.dataset("trainval").records[0]
    x1, y1, x2, y2 = record.gt_boxes[0].tolist()
    name = tiny_toy.classes[int(record.gt_labels[0])]
    partial = _side_file(tmp_path, {first_id: [{"class": name, "point": [(x1 + x2) / 2, (y1 + y2) / 2]}]})
    cfg = OmegaConf.create(
        {
            "kind": "toy", "root": str(tiny_toy.root), "num_train": 10, "num_test": 6,
            "object_size": list(OBJECT_SIZE),
            "train": {
                "sets": [{"image_set": "trainval", "partial_labels": str(partial)}], "scales": [160],
                "max_size": 1000, "flip": True, "lighting_std": 0.0, "max_proposals": None,
                "roi_sampling": {"rois_per_image": 8, "positive_fraction": 0.25},
            },
        }
    )  # fmt: skip
    dataset = build_train_dataset(cfg)
    item = dataset[(0, 1)]
    assert "points" in item["targets"] and len(item["proposals"]) <= 8
    assert torch.equal(item["proposals"], dataset[(0, 1)]["proposals"])  # seeded per item: the same draw
    assert "points" not in dataset[(1, 1)]["targets"]
