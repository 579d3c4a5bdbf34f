"""VOCdevkit trees written in the real format and read back; bad input gives errors naming the file."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from wsod.data.proposals import MissingProposalsError, ProposalSet
from wsod.data.voc import VOC_CLASSES, VOCDataset, load_voc_records

CLASSES = ("cat", "dog", "person")

IMAGES = {
    # Integer coordinates; one difficult dog: the image label has the cat only, the ground truth has both.
    "000005": (60, 80, [("cat", ("1", "2", "30", "40"), 0), ("dog", ("10", "11", "50", "55"), 1)]),
    # Fractional coordinates (as some VOC 2012 files have) and no <difficult> tag (means 0).
    "2008_000008": (
        50,
        70,
        [("person", ("5.5", "6.25", "20.5", "49"), None), ("cat", ("3", "3", "9", "9"), 0)],
    ),
}


def _proposals(ids, boxes=((0, 0, 19, 19), (5, 5, 40, 30))):
    return ProposalSet(list(ids), [np.array(boxes, np.float32)] * len(ids), source="test.pkl")


def test_records_read_back_labels_boxes_difficult_ids(make_voc):
    devkit = make_voc(IMAGES, {"trainval": ["000005", "2008_000008"]})
    records = load_voc_records(devkit, "2007", "trainval", CLASSES)

    assert [r.image_id for r in records] == ["000005", "2008_000008"]
    assert [(r.height, r.width) for r in records] == [(60, 80), (50, 70)]
    first, second = records
    # Labels from non-difficult objects only.
    np.testing.assert_array_equal(first.labels, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(second.labels, [1.0, 0.0, 1.0])
    assert first.labels.dtype == np.float32
    # 1-based inclusive xml -> 0-based inclusive: every coordinate minus one.
    np.testing.assert_array_equal(first.gt_boxes, [[0, 1, 29, 39], [9, 10, 49, 54]])
    np.testing.assert_allclose(second.gt_boxes, [[4.5, 5.25, 19.5, 48], [2, 2, 8, 8]])
    np.testing.assert_array_equal(first.gt_labels, [0, 1])
    np.testing.assert_array_equal(second.gt_labels, [2, 0])
    np.testing.assert_array_equal(first.gt_difficult, [False, True])
    np.testing.assert_array_equal(second.gt_difficult, [False, False])
    assert first.path.endswith("VOC2007/JPEGImages/000005.jpg")


def test_dataset_item_contract(make_voc):
    devkit = make_voc(IMAGES, {"trainval": ["000005", "2008_000008"]})
    proposals = _proposals(["000005", "2008_000008"], boxes=((0, 0, 19, 19), (5, 5, 90, 60)))
    dataset = VOCDataset(devkit, "2007", "trainval", proposals, classes=CLASSES)
    assert len(dataset) == 2 and dataset.num_classes == 3 and dataset.classes == CLASSES
    item = dataset[1]
    assert item["image_id"] == "2008_000008"
    assert item["image"].dtype == torch.uint8 and item["image"].shape == (3, 50, 70)
    assert item["original_size"] == (50, 70)
    torch.testing.assert_close(item["labels"], torch.tensor([1.0, 0.0, 1.0]))
    # The second proposal is clipped to the last column (69) and row (49) of the 70 x 50 image.
    torch.testing.assert_close(item["proposals"], torch.tensor([[0.0, 0, 19, 19], [5, 5, 69, 49]]))
    assert item["proposals"].dtype == torch.float32
    assert item["gt_boxes"].dtype == torch.float32 and item["gt_labels"].dtype == torch.int64
    assert item["gt_difficult"].dtype == torch.bool
    torch.testing.assert_close(item["gt_boxes"], torch.tensor([[4.5, 5.25, 19.5, 48], [2, 2, 8, 8]]))


def test_default_classes_are_the_twenty_voc_classes(make_voc):
    devkit = make_voc({"000001": (20, 30, [("tvmonitor", ("1", "1", "10", "10"), 0)])}, {"test": ["000001"]})
    (record,) = load_voc_records(devkit, "2007", "test")
    assert len(VOC_CLASSES) == 20 and record.labels.shape == (20,)
    assert record.gt_labels.tolist() == [VOC_CLASSES.index("tvmonitor")] == [19]


def test_size_read_from_the_image_when_the_xml_has_none(make_voc):
    devkit = make_voc(
        {"000001": (33, 47, [("cat", ("1", "1", "10", "10"), 0)])}, {"test": ["000001"]}, write_size=False
    )
    (record,) = load_voc_records(devkit, "2007", "test", CLASSES)
    assert (record.height, record.width) == (33, 47)


def test_unknown_class_name_is_an_error_naming_the_file(make_voc):
    devkit = make_voc({"000001": (20, 30, [("unicorn", ("1", "1", "10", "10"), 0)])}, {"test": ["000001"]})
    with pytest.raises(ValueError, match=r"000001\.xml.*unknown class name 'unicorn'"):
        load_voc_records(devkit, "2007", "test", CLASSES)


def test_xml_without_objects_is_kept_or_dropped_with_a_count(make_voc, caplog):
    devkit = make_voc(
        {"000001": (20, 30, []), "000002": (20, 30, [("dog", ("1", "1", "10", "10"), 0)])},
        {"test": ["000001", "000002"]},
    )
    proposals = _proposals(["000001", "000002"])
    with caplog.at_level(logging.WARNING):
        kept = VOCDataset(devkit, "2007", "test", proposals, classes=CLASSES)
    assert "1 annotation files have no object" in caplog.text
    assert kept.image_ids == ["000001", "000002"]
    assert kept[0]["gt_boxes"].shape == (0, 4) and kept[0]["labels"].sum() == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        dropped = VOCDataset(devkit, "2007", "test", proposals, classes=CLASSES, drop_unlabelled=True)
    assert dropped.image_ids == ["000002"]
    assert "dropped 1 of 2 images" in caplog.text


def test_only_difficult_objects_give_no_label(make_voc):
    devkit = make_voc({"000001": (20, 30, [("dog", ("1", "1", "10", "10"), 1)])}, {"test": ["000001"]})
    (record,) = load_voc_records(devkit, "2007", "test", CLASSES)
    assert record.labels.sum() == 0 and record.gt_difficult.tolist() == [True]


def test_missing_and_malformed_xml_name_the_file(make_voc):
    devkit = make_voc({"000001": (20, 30, [])}, {"test": ["000001", "000404"], "broken": ["000001"]})
    with pytest.raises(FileNotFoundError, match=r"000404\.xml"):
        load_voc_records(devkit, "2007", "test", CLASSES)
    (devkit / "VOC2007" / "Annotations" / "000001.xml").write_text("<annotation><object>")
    with pytest.raises(ValueError, match=r"000001\.xml: not a valid xml"):
        load_voc_records(devkit, "2007", "broken", CLASSES)
    with pytest.raises(FileNotFoundError, match=r"Main/nope\.txt"):
        load_voc_records(devkit, "2007", "nope", CLASSES)


def test_missing_image_file_is_an_error_naming_it(make_voc):
    devkit = make_voc(IMAGES, {"trainval": ["000005", "2008_000008"]})
    (devkit / "VOC2007" / "JPEGImages" / "2008_000008.jpg").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"1 of 2 image files are missing; the first is .*2008_000008\.jpg"
    ):
        VOCDataset(devkit, "2007", "trainval", _proposals(["000005", "2008_000008"]), classes=CLASSES)


def test_corrupt_jpeg_is_an_error_naming_it(make_voc):
    devkit = make_voc(IMAGES, {"trainval": ["000005", "2008_000008"]})
    path = devkit / "VOC2007" / "JPEGImages" / "000005.jpg"
    path.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg" * 10)
    dataset = VOCDataset(devkit, "2007", "trainval", _proposals(["000005", "2008_000008"]), classes=CLASSES)
    assert dataset[1]["image"].shape == (3, 50, 70)
    with pytest.raises(RuntimeError, match=r"cannot decode image .*000005\.jpg"):
        dataset[0]


def test_image_missing_from_the_proposal_file_is_an_error_naming_id_and_file(make_voc):
    devkit = make_voc(IMAGES, {"trainval": ["000005", "2008_000008"]})
    with pytest.raises(
        MissingProposalsError, match=r"no proposals in test\.pkl; the first is image id '2008_000008'"
    ):
        VOCDataset(devkit, "2007", "trainval", _proposals(["000005"]), classes=CLASSES)


def test_image_left_without_proposals_gets_the_whole_image_box(make_voc, caplog):
    devkit = make_voc(IMAGES, {"trainval": ["000005", "2008_000008"]})
    # Both boxes are under 2 px wide in inclusive pixels (1.5 and 1): the minimum size (2 px) removes them.
    proposals = _proposals(["000005", "2008_000008"], boxes=((0, 0, 0.5, 30), (10, 10, 10, 20)))
    dataset = VOCDataset(devkit, "2007", "trainval", proposals, classes=CLASSES)
    with caplog.at_level(logging.WARNING):
        item = dataset[0]
        dataset[1]
    torch.testing.assert_close(item["proposals"], torch.tensor([[0.0, 0.0, 79.0, 59.0]]))
    assert dataset.num_whole_image_fallbacks == 2
    assert "image '000005': no proposal left after filtering test.pkl" in caplog.text
    assert "2 such images so far" in caplog.text


def test_max_proposals_keeps_the_first(make_voc):
    devkit = make_voc(IMAGES, {"trainval": ["000005"]})
    dataset = VOCDataset(devkit, "2007", "trainval", _proposals(["000005"]), classes=CLASSES, max_proposals=1)
    torch.testing.assert_close(dataset[0]["proposals"], torch.tensor([[0.0, 0, 19, 19]]))


def test_empty_image_set_and_non_numeric_coordinates_name_the_file_and_field(make_voc):
    devkit = make_voc(
        {"000001": (20, 30, [("dog", ("1", "abc", "10", "10"), 0)])}, {"test": ["000001"], "empty": []}
    )
    with pytest.raises(ValueError, match=r"image set file .*Main/empty\.txt lists no image"):
        load_voc_records(devkit, "2007", "empty", CLASSES)
    with pytest.raises(ValueError, match=r"000001\.xml: <bndbox><ymin> is 'abc', not a number"):
        load_voc_records(devkit, "2007", "test", CLASSES)
