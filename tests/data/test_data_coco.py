"""COCO-format json files (instances and label-only) written in the real format and read back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsod.data.coco import CocoDataset, load_coco_records
from wsod.data.loader import collate
from wsod.data.proposals import ProposalSet
from wsod.data.transforms import test_transform

# Category ids deliberately unsorted and with gaps, as COCO's 1..90 are.
CATEGORIES = [{"id": 7, "name": "zebra"}, {"id": 1, "name": "person"}, {"id": 3, "name": "car"}]


def _images(tmp_path, jpeg):
    sizes = {42: (40, 60), 7: (30, 50), 100: (20, 20)}
    for image_id, (h, w) in sizes.items():
        jpeg(tmp_path / "images" / f"img_{image_id}.jpg", h, w, seed=image_id)
    return [
        {"id": image_id, "file_name": f"img_{image_id}.jpg", "height": h, "width": w}
        for image_id, (h, w) in sizes.items()
    ]


def _proposals(ids):
    return ProposalSet(list(ids), [np.array([[0, 0, 9, 9], [2, 3, 15, 12]], np.float32)] * len(ids))


def test_instances_json_labels_boxes_crowd_and_class_mapping(tmp_path, jpeg, write_json):
    annotations = [
        {"id": 1, "image_id": 42, "category_id": 7, "bbox": [10.5, 5.25, 20, 30], "iscrowd": 0},
        {"id": 2, "image_id": 42, "category_id": 1, "bbox": [0, 0, 5, 5], "iscrowd": 0},
        # A crowd region is neither a label nor a ground-truth box.
        {"id": 3, "image_id": 42, "category_id": 3, "bbox": [1, 1, 30, 30], "iscrowd": 1},
        {"id": 4, "image_id": 7, "category_id": 3, "bbox": [2, 4, 6, 8]},
        # Image 100 has only a crowd annotation: no label.
        {"id": 5, "image_id": 100, "category_id": 1, "bbox": [0, 0, 10, 10], "iscrowd": 1},
    ]
    path = write_json(
        {"images": _images(tmp_path, jpeg), "categories": CATEGORIES, "annotations": annotations}
    )
    records, category_ids, names = load_coco_records(path, tmp_path / "images")

    assert category_ids == (1, 3, 7) and names == ("person", "car", "zebra")
    assert [r.image_id for r in records] == [42, 7, 100]
    first, second, third = records
    np.testing.assert_array_equal(first.labels, [1, 0, 1])
    np.testing.assert_array_equal(first.gt_labels, [2, 0])
    # xywh -> (x, y, x + w, y + h), float coordinates kept.
    np.testing.assert_allclose(first.gt_boxes, [[10.5, 5.25, 30.5, 35.25], [0, 0, 5, 5]])
    np.testing.assert_array_equal(first.gt_difficult, [False, False])
    np.testing.assert_array_equal(second.labels, [0, 1, 0])
    np.testing.assert_array_equal(second.gt_boxes, [[2, 4, 8, 12]])
    assert third.labels.sum() == 0 and third.gt_boxes.shape == (0, 4)
    assert (first.height, first.width) == (40, 60)

    dataset = CocoDataset(path, tmp_path / "images", _proposals([42, 7, 100]), drop_unlabelled=True)
    assert dataset.image_ids == [42, 7]
    assert dataset.category_ids == (1, 3, 7)
    assert dataset.category_index == {1: 0, 3: 1, 7: 2}
    assert [dataset.category_ids[c] for c in dataset[0]["gt_labels"].tolist()] == [7, 1]
    keep_all = CocoDataset(path, tmp_path / "images", _proposals([42, 7, 100]))
    assert keep_all.image_ids == [42, 7, 100]


def test_label_only_json_has_labels_and_no_ground_truth(tmp_path, jpeg, write_json):
    images = [
        {k: v for k, v in image.items() if k in ("id", "file_name")} for image in _images(tmp_path, jpeg)
    ]
    annotations = [  # no bbox, no annotation id: one entry per (image, class present)
        {"image_id": 42, "category_id": 3},
        {"image_id": 42, "category_id": 7},
        {"image_id": 7, "category_id": 1},
    ]
    path = write_json({"images": images, "categories": CATEGORIES, "annotations": annotations})
    records, _, _ = load_coco_records(path, tmp_path / "images")
    np.testing.assert_array_equal(records[0].labels, [0, 1, 1])
    assert not records[0].has_boxes and records[0].gt_boxes is None
    assert [(r.height, r.width) for r in records] == [(40, 60), (30, 50), (20, 20)]  # from the files

    dataset = CocoDataset(
        path, tmp_path / "images", _proposals([42, 7, 100]), transform=test_transform(32, 64)
    )
    item = dataset[1]
    assert "gt_boxes" not in item
    torch.testing.assert_close(item["labels"], torch.tensor([1.0, 0.0, 0.0]))
    batch = collate([dataset[0], dataset[1]])
    assert batch["annotations"] == [None, None]
    assert batch["image_ids"] == [42, 7]


def test_unknown_category_is_an_error_naming_the_file(tmp_path, jpeg, write_json):
    annotations = [{"id": 1, "image_id": 42, "category_id": 99, "bbox": [0, 0, 1, 1]}]
    path = write_json(
        {"images": _images(tmp_path, jpeg), "categories": CATEGORIES, "annotations": annotations}
    )
    with pytest.raises(ValueError, match=r"annotations\.json: annotation 0 \(image 42\) has category id 99"):
        load_coco_records(path, tmp_path / "images")


def test_unknown_image_and_mixed_bbox_are_errors(tmp_path, jpeg, write_json):
    images = _images(tmp_path, jpeg)
    ghost = [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1]}]
    path = write_json({"images": images, "categories": CATEGORIES, "annotations": ghost}, "ghost.json")
    with pytest.raises(ValueError, match=r"ghost\.json: annotation 0 refers to image id 5"):
        load_coco_records(path, tmp_path / "images")
    mixed = [{"image_id": 42, "category_id": 1, "bbox": [0, 0, 1, 1]}, {"image_id": 7, "category_id": 1}]
    path = write_json({"images": images, "categories": CATEGORIES, "annotations": mixed}, "mixed.json")
    with pytest.raises(ValueError, match=r"mixed\.json: 1 of 2 annotations have a 'bbox'"):
        load_coco_records(path, tmp_path / "images")


def test_missing_image_file_is_an_error(tmp_path, jpeg, write_json, caplog):
    path = write_json({"images": _images(tmp_path, jpeg), "categories": CATEGORIES, "annotations": []})
    (tmp_path / "images" / "img_7.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"img_7\.jpg"):
        CocoDataset(path, tmp_path / "images", _proposals([42, 7, 100]))
    with pytest.raises(ValueError, match="none of the 3 images has an image-level label"):
        CocoDataset(path, tmp_path / "images", _proposals([42, 7, 100]), drop_unlabelled=True)


def test_a_json_without_images_names_the_file(tmp_path, write_json):
    path = write_json({"images": [], "categories": CATEGORIES, "annotations": []}, "empty.json")
    with pytest.raises(ValueError, match=r"empty\.json: no 'images' list, or an empty one"):
        load_coco_records(path, tmp_path / "images")
