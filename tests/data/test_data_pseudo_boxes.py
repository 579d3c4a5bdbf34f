"""wsod/data/pseudo_boxes.py: the pseudo ground-truth json loads in pycocotools (COCO and loadRes), reads
back to the same boxes on the same images, and names the file and entry of every bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO

from wsod.data.pseudo_boxes import (
    attach_pseudo_boxes,
    coco_image_ids,
    pseudo_boxes_json,
    read_pseudo_boxes,
    relative_file_names,
    write_pseudo_boxes,
)
from wsod.data.voc import VOCDataset

CLASSES = ("cat", "dog", "bird")
IMAGES = {
    "000007": (40, 60, [("cat", ("3", "3", "20", "30"), 0), ("dog", ("30", "5", "55", "35"), 0)]),
    "000012": (50, 30, [("bird", ("10", "10", "25", "40"), 0)]),
}
BOXES = [
    {"boxes": torch.tensor([[2.0, 2, 19, 29], [29, 4, 54, 34], [0, 0, 9.5, 9]]),
     "scores": torch.tensor([0.9, 0.8, 0.3]), "labels": torch.tensor([0, 1, 0])},
    {"boxes": torch.tensor([[9.0, 9, 24, 39]]), "scores": torch.tensor([0.7]), "labels": torch.tensor([2])},
]  # fmt: skip


@pytest.fixture
def voc(make_voc, write_pickle):
    devkit = make_voc(IMAGES, {"trainval": list(IMAGES)})
    proposals = write_pickle({i: [[0, 0, 20, 20]] for i in IMAGES})
    return VOCDataset(devkit, "2007", "trainval", proposals, classes=CLASSES)


def _export(voc, tmp_path, boxes=BOXES):
    content = pseudo_boxes_json(voc.records, boxes, CLASSES, [1, 2, 3], {"description": "test"})
    return write_pseudo_boxes(content, tmp_path / "pseudo.json"), content


def test_the_json_loads_in_pycocotools_and_points_back_to_the_source_images(voc, tmp_path):
    path, content = _export(voc, tmp_path)
    coco = COCO(str(path))
    assert sorted(coco.getImgIds()) == [7, 12]  # VOC's numeric ids, as detectron2's VOC loaders number them
    assert [coco.imgs[7]["file_name"], coco.imgs[7]["source_id"]] == ["000007.jpg", "000007"]
    assert (coco.imgs[12]["height"], coco.imgs[12]["width"]) == (50, 30)
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(CLASSES)
    assert len(coco.getAnnIds(imgIds=[7])) == 3 and coco.anns[1]["bbox"] == [2.0, 2.0, 17.0, 27.0]
    assert all(a["iscrowd"] == 0 and a["area"] > 0 for a in coco.anns.values())
    results = coco.loadRes([{"image_id": 7, "category_id": 1, "bbox": [1, 1, 5, 5], "score": 0.5}])
    assert len(results.anns) == 1
    # Every box inside its image, every class among the image's labels.
    for annotation in content["annotations"]:
        image = coco.imgs[annotation["image_id"]]
        x, y, w, h = annotation["bbox"]
        assert min(x, y) >= 0 and x + w <= image["width"] - 1 and y + h <= image["height"] - 1
    record_labels = {coco_image_ids(voc.records)[i]: r.labels for i, r in enumerate(voc.records)}
    assert all(record_labels[a["image_id"]][a["category_id"] - 1] for a in content["annotations"])
    assert content["info"]["images_root"].endswith("VOC2007/JPEGImages")


def test_reading_it_back_gives_the_same_boxes_as_training_supervision(voc, tmp_path):
    path, _ = _export(voc, tmp_path)
    read = read_pseudo_boxes(path, CLASSES)
    size, boxes, labels = read["000007.jpg"]
    assert size == (40, 60) and labels.tolist() == [0, 1, 0]
    np.testing.assert_allclose(boxes, BOXES[0]["boxes"].numpy())
    records = attach_pseudo_boxes(voc.records, CLASSES, path)
    assert [r.image_id for r in records] == ["000007", "000012"]
    np.testing.assert_allclose(records[1].supervision["boxes"], [[9, 9, 24, 39]])
    assert records[1].supervision["box_labels"].tolist() == [2]


def test_images_the_file_lacks_are_left_out_and_counted(voc, tmp_path, caplog):
    content = pseudo_boxes_json(voc.records[:1], BOXES[:1], CLASSES, [1, 2, 3], {})
    path = write_pseudo_boxes(content, tmp_path / "one.json")
    # The one-image json names its file under that image's own folder: the same relative name.
    assert relative_file_names(voc.records[:1]) == ["000007.jpg"]
    records = attach_pseudo_boxes(voc.records, CLASSES, path)
    assert [r.image_id for r in records] == ["000007"]
    assert "1 of 2 training images have no pseudo boxes" in caplog.text


def _edit(tmp_path, voc, change):
    path, content = _export(voc, tmp_path)
    change(content)
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["categories"][0].update(name="lion"), r"categories \['lion'\] are not among"),
        (
            lambda c: c["annotations"][0].update(image_id=99),
            "annotation 1: image_id 99 is none of its images",
        ),
        (lambda c: c["annotations"][1].update(category_id=9), "annotation 2: category_id 9 is none"),
        (
            lambda c: c["annotations"][0].update(bbox=[1, 2, -3, 4]),
            r"annotation 1: bbox \[1, 2, -3, 4\] is not",
        ),
        (lambda c: c["annotations"][0].update(bbox=[1, 2, 3]), "annotation 1: bbox"),
        (lambda c: c["images"][0].pop("width"), "lacks id, file_name, width or height"),
        (lambda c: c.pop("annotations"), "no 'annotations' field .*; expected a COCO instances json"),
        (lambda c: c.pop("categories"), "no 'categories' field .*; expected a COCO instances json"),
        (lambda c: c.update(images={}), "'images' is an object, not a list; expected a COCO instances"),
        # Sizes and ids of a kind the reader cannot use (int() and dict lookups failed without a name).
        (
            lambda c: c["images"][0].update(width="60px"),
            r"images\[0\] \(id 7, file_name '000007.jpg'\): width is '60px'; expected a whole number",
        ),
        (lambda c: c["images"][1].update(height=[50]), r"images\[1\] .*: height is \[50\]; expected a whole"),
        (lambda c: c["images"][1].update(id=[12]), r"images\[1\] \(id \[12\], .*neither an integer nor a"),
        (lambda c: c["categories"][0].update(id=[1]), r"categories\[0\] is .*; expected \{\"id\": integer"),
        (lambda c: c["annotations"][0].update(image_id=[7]), r"annotation 1: image_id \[7\] is none of its"),
        (lambda c: c["annotations"][0].update(category_id=[1]), r"annotation 1: category_id \[1\] is none"),
    ],
)
def test_bad_entries_are_named_with_the_file(voc, tmp_path, change, message):
    path = _edit(tmp_path, voc, change)
    with pytest.raises(ValueError, match=message) as error:
        read_pseudo_boxes(path, CLASSES)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("key", ["annotations", "images"])
def test_a_file_without_any_box_is_refused_naming_it(voc, tmp_path, key):
    """``"annotations": []`` once trained every image as background alone, ending with exit 0."""
    path = _edit(tmp_path, voc, lambda c: c.update({key: []}))
    with pytest.raises(ValueError, match=f"pseudo boxes file {path}: '{key}' is empty: there is nothing"):
        attach_pseudo_boxes(voc.records, CLASSES, path)


def test_an_image_given_twice_is_refused_naming_both_entries(voc, tmp_path):
    """A second entry with the file name of the first left that image with no box; a reused id moved
    the boxes of one image onto the other."""
    path = _edit(tmp_path, voc, lambda c: c["images"].append({**c["images"][0], "id": 99}))
    with pytest.raises(ValueError) as error:
        attach_pseudo_boxes(voc.records, CLASSES, path)
    assert str(error.value) == (
        f"pseudo boxes file {path}: images[2] (id 99, file_name '000007.jpg') has the file_name of"
        " images[0] (id 7): one entry per image (the second would replace the first's boxes); export the"
        " file again"
    )
    path = _edit(tmp_path, voc, lambda c: c["images"][1].update(id=7))
    with pytest.raises(ValueError) as error:
        attach_pseudo_boxes(voc.records, CLASSES, path)
    assert str(error.value).startswith(
        f"pseudo boxes file {path}: images[1] (id 7, file_name '000012.jpg') has the id of images[0]"
        " (file_name '000007.jpg'): image ids must be unique"
    )
    path = _edit(tmp_path, voc, lambda c: c["categories"].append({"id": 1, "name": "dog"}))
    with pytest.raises(ValueError, match=r"categories\[3\] has id 1, as categories\[0\] does"):
        read_pseudo_boxes(path, CLASSES)


def test_other_images_are_refused_by_size_and_by_name(voc, tmp_path):
    path = _edit(tmp_path, voc, lambda c: c["images"][0].update(height=41))
    with pytest.raises(ValueError, match="image 000007.jpg is 41x60 .* and 40x60 in the dataset"):
        attach_pseudo_boxes(voc.records, CLASSES, path)
    path = _edit(tmp_path, voc, lambda c: [i.update(file_name="x/" + i["file_name"]) for i in c["images"]])
    with pytest.raises(ValueError, match="none of its 2 images .* is one of the dataset's 2"):
        attach_pseudo_boxes(voc.records, CLASSES, path)
    with pytest.raises(FileNotFoundError, match="export_pseudo_labels.py"):
        read_pseudo_boxes(tmp_path / "missing.json", CLASSES)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json: not a JSON file \(Expecting property name"):
        read_pseudo_boxes(tmp_path / "bad.json", CLASSES)


def test_image_ids_are_the_sources_own_where_they_can_be():
    class R:
        def __init__(self, image_id):
            self.image_id = image_id

    assert coco_image_ids([R(391895), R(522418)]) == [391895, 522418]  # COCO's
    assert coco_image_ids([R("000005"), R("000007")]) == [5, 7]  # VOC 2007's
    assert coco_image_ids([R("2008_000005"), R("000007")]) == [1, 2]  # not all numeric: positions
    assert coco_image_ids([R("5"), R("005")]) == [1, 2]  # numeric but not distinct as numbers
