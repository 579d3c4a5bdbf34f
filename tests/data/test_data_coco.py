"""COCO-format json files (instances and label-only) written in the real format and read back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsod.data.coco import CocoDataset, load_coco_records, read_coco_json
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
    # Image labels, nothing more (and the ROIs' ids, which every batch has).
    assert [set(t) for t in batch["targets"]] == [{"labels", "proposal_ids"}] * 2
    assert batch["image_ids"] == [42, 7]


def test_unknown_category_is_an_error_naming_the_file(tmp_path, jpeg, write_json):
    annotations = [{"id": 1, "image_id": 42, "category_id": 99, "bbox": [0, 0, 1, 1]}]
    path = write_json(
        {"images": _images(tmp_path, jpeg), "categories": CATEGORIES, "annotations": annotations}
    )
    with pytest.raises(
        ValueError, match=r"annotations\.json: annotations\[0\] \(image 42\) has category id 99"
    ):
        load_coco_records(path, tmp_path / "images")


def test_unknown_image_and_mixed_bbox_are_errors(tmp_path, jpeg, write_json):
    images = _images(tmp_path, jpeg)
    ghost = [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1]}]
    path = write_json({"images": images, "categories": CATEGORIES, "annotations": ghost}, "ghost.json")
    with pytest.raises(ValueError, match=r"ghost\.json: annotations\[0\] refers to image id 5"):
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
    with pytest.raises(ValueError, match=r"annotations\.json: none of its 3 images has a label"):
        CocoDataset(path, tmp_path / "images", _proposals([42, 7, 100]), drop_unlabelled=True)


def test_a_json_without_images_names_the_file(tmp_path, write_json):
    path = write_json({"images": [], "categories": CATEGORIES, "annotations": []}, "empty.json")
    with pytest.raises(ValueError, match=r"empty\.json: no 'images' list, or an empty one"):
        load_coco_records(path, tmp_path / "images")


def test_optional_annotation_fields_are_filled_in_as_pycocotools_reads_them(tmp_path, jpeg, write_json):
    annotations = [
        {"image_id": 42, "category_id": 7, "bbox": [10, 5, 20, 30]},
        # COCO's own area is the segmentation's (here smaller than the box's 100): kept, it decides the
        # small/medium/large split of the evaluation; a given id and iscrowd are kept too.
        {"image_id": 42, "category_id": 1, "bbox": [0, 0, 10, 10], "area": 64.5, "id": 17, "iscrowd": 1},
        {"image_id": 7, "category_id": 3, "bbox": [2, 4, 6, 8]},
    ]
    path = write_json(
        {"images": _images(tmp_path, jpeg), "categories": CATEGORIES, "annotations": annotations}
    )
    coco = read_coco_json(path)
    filled = [(a["id"], a["iscrowd"], a["area"]) for a in coco.dataset["annotations"]]
    assert filled == [(1, 0, 600), (17, 1, 64.5), (3, 0, 48)]  # id i + 1, not crowd, w * h
    assert sorted(coco.anns) == [1, 3, 17] and coco.getAnnIds(imgIds=[42], iscrowd=False) == [1]
    dataset = CocoDataset(path, tmp_path / "images", _proposals([42, 7, 100]))
    assert dataset.coco.dataset["annotations"] == coco.dataset["annotations"]  # what evaluation scores


def _valid():
    images = [{"id": i, "file_name": f"img_{i}.jpg", "height": 20, "width": 20} for i in (42, 7, 100)]
    annotations = [
        {"id": 1, "image_id": 42, "category_id": 7, "bbox": [0, 0, 5, 5]},
        {"id": 2, "image_id": 7, "category_id": 1, "bbox": [1, 1, 5, 5]},
    ]
    return {"images": images, "categories": [dict(c) for c in CATEGORIES], "annotations": annotations}


def _drop(entry, key):
    del entry[key]


# What each did before: KeyError (no file, no field) for the missing ids, file names and names; a
# misleading "category id None" / "image id None" for the annotation fields; a numpy error or a silently
# wrong box for the bboxes; and for the duplicates a wrong answer (pycocotools' index keeps one entry
# per id: a ground-truth box lost, another counted twice; one image's records twice; one class name).
BAD_ENTRIES = {
    "image without id": (lambda d: _drop(d["images"][1], "id"), r"images\[1\] has no 'id'"),
    "image without file_name": (
        lambda d: _drop(d["images"][1], "file_name"),
        r"images\[1\] \(id 7\) has no 'file_name'",
    ),
    "image not an object": (lambda d: d["images"].append(5), r"images\[3\] is not a json object"),
    "duplicate image id": (
        lambda d: d["images"][2].update(id=42),
        r"images\[2\] has id 42, as images\[0\] does: image ids must be unique",
    ),
    "image id a list": (
        lambda d: d["images"][0].update(id=[42]),
        r"images\[0\] has id \[42\]: expected an integer or a string",
    ),
    "category without id": (lambda d: _drop(d["categories"][1], "id"), r"categories\[1\] has no 'id'"),
    "category without name": (
        lambda d: _drop(d["categories"][1], "name"),
        r"categories\[1\] \(id 1\) has no 'name'",
    ),
    "duplicate category id": (
        lambda d: d["categories"][2].update(id=7),
        r"categories\[2\] has id 7, as categories\[0\] does: category ids must be unique",
    ),
    "annotation without image_id": (
        lambda d: _drop(d["annotations"][1], "image_id"),
        r"annotations\[1\] has no 'image_id'",
    ),
    "annotation without category_id": (
        lambda d: _drop(d["annotations"][1], "category_id"),
        r"annotations\[1\] \(image 7\) has no 'category_id'",
    ),
    "bbox of 3 numbers": (
        lambda d: d["annotations"][1].update(bbox=[1, 1, 5]),
        r"annotations\[1\] \(image 7\) has bbox \[1, 1, 5\]: expected \[x, y, w, h\], 4 finite numbers",
    ),
    "bbox with a string": (
        lambda d: d["annotations"][1].update(bbox=[1, 1, "5", 5]),
        r"annotations\[1\] \(image 7\) has bbox \[1, 1, '5', 5\]: expected",
    ),
    "bbox of negative width": (
        lambda d: d["annotations"][1].update(bbox=[10, 1, -5, 5]),
        r"annotations\[1\] \(image 7\) has bbox \[10, 1, -5, 5\]: expected .* w, h >= 0",
    ),
    "area not a number": (
        lambda d: d["annotations"][1].update(area="big"),
        r"annotations\[1\] \(image 7\) has area 'big': expected a finite number >= 0",
    ),
    "annotation id not an integer": (
        lambda d: d["annotations"][1].update(id="2"),
        r"annotations\[1\] has id '2': annotation ids must be integers",
    ),
    "duplicate annotation id": (
        lambda d: d["annotations"][1].update(id=1),
        r"annotations\[1\] has id 1, as annotations\[0\] does: annotation ids must be unique",
    ),
    "a missing id numbered onto a given one": (
        lambda d: _drop(d["annotations"][0], "id") or d["annotations"][1].update(id=1),
        r"annotations\[0\] has no 'id' and would be numbered 1, the id of annotations\[1\]",
    ),
    "annotations not a list": (lambda d: d.update(annotations={}), r"'annotations' is not a list"),
    # int() of these once failed with "invalid literal for int()" or a TypeError, naming no file.
    "width with a unit": (
        lambda d: d["images"][1].update(width="20px"),
        r"images\[1\] \(id 7\) has width '20px'; expected a whole number of pixels \(e.g. 640\), or leave"
        r" 'width' out to read the size from the image file$",
    ),
    "height a list": (
        lambda d: d["images"][0].update(height=[20]),
        r"images\[0\] \(id 42\) has height \[20\]",
    ),
    "fractional width": (
        lambda d: d["images"][2].update(width=20.5),
        r"images\[2\] \(id 100\) has width 20.5",
    ),
    "negative width": (lambda d: d["images"][2].update(width=-20), r"images\[2\] \(id 100\) has width -20"),
    # A list as a class name once loaded, then failed as "unhashable type: 'list'" far from the file.
    "category name a list": (
        lambda d: d["categories"][1].update(name=["person"]),
        r"categories\[1\] \(id 1\) has name \['person'\]; a class name is one non-empty string",
    ),
    "file_name a list": (
        lambda d: d["images"][1].update(file_name=["img_7.jpg"]),
        r"images\[1\] \(id 7\) has file_name \['img_7.jpg'\]; expected the image's path",
    ),
    "no categories": (
        lambda d: d.pop("categories"),
        r"no 'categories' list, or an empty one; expected a COCO json with non-empty 'images' and"
        r" 'categories' lists",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_a_bad_entry_is_an_error_naming_the_file_and_field(tmp_path, write_json, case):
    mutate, message = BAD_ENTRIES[case]
    data = _valid()
    mutate(data)
    path = write_json(data, "bad.json")
    with pytest.raises(ValueError, match=r"^.*bad\.json: " + message):
        load_coco_records(path, tmp_path / "images")


@pytest.mark.parametrize(("width", "height"), [(20.0, "20"), (None, None), (0, 0)])
def test_a_stated_size_may_be_an_integral_number_or_digits_and_a_missing_one_is_read(
    tmp_path, jpeg, write_json, width, height
):
    jpeg(tmp_path / "images" / "img_7.jpg", 30, 20)
    data = _valid()
    data["images"] = [{"id": 7, "file_name": "img_7.jpg", "width": width, "height": height}]
    data["annotations"] = data["annotations"][1:]
    (record,), _, _ = load_coco_records(write_json(data, "sizes.json"), tmp_path / "images")
    assert (record.height, record.width) == ((30, 20) if width is None or width == 0 else (20, 20))


def test_a_json_that_is_not_an_object_names_the_file(tmp_path, write_json):
    path = write_json([{"id": 1}], "list.json")
    with pytest.raises(ValueError, match=r"list\.json: expected a json object with 'images', 'categories'"):
        load_coco_records(path, tmp_path / "images")


def test_the_ground_truth_read_for_evaluation_is_the_one_the_records_came_from(tmp_path, jpeg, write_json):
    data = {"images": _images(tmp_path, jpeg), "categories": CATEGORIES, "annotations": []}
    path = write_json(data, "test.json")
    dataset = CocoDataset(path, tmp_path / "images", _proposals([42, 7, 100]))
    data["images"] = data["images"][:2]
    write_json(data, "test.json")  # rewritten after the records were built (and not yet read again)
    with pytest.raises(ValueError, match=r"test\.json: changed since the dataset was built from it"):
        _ = dataset.coco
