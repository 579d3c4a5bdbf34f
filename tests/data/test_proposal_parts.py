"""Part proposals (wsod/data/proposals/parts.py): a hand-counted case, a naive loop reference, the
loading rules and difficult objects, and the report tools/make_proposals.py prints."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from wsod.data.dataset import ImageRecord
from wsod.data.proposals import ProposalSet
from wsod.data.proposals.parts import (
    count_part_proposals,
    format_part_table,
    part_proposal_mask,
    records_part_proposals,
)

ROOT = Path(__file__).resolve().parents[2]


def test_a_hand_counted_image():
    # One object, 20 x 20 pixels (0..19 inclusive): 400 px.
    gt = torch.tensor([[0.0, 0.0, 19.0, 19.0]])
    boxes = torch.tensor(
        [
            [0.0, 0.0, 9.0, 9.0],  # 100 px, all inside, 0.25 of the object: a part
            [0.0, 0.0, 19.0, 19.0],  # the object itself: not a part (not under half)
            [0.0, 0.0, 19.0, 9.0],  # 200 px, exactly half: not a part (under half only)
            [0.0, 0.0, 19.0, 8.0],  # 180 px, 0.45: a part
            [-1.0, 0.0, 8.0, 9.0],  # 100 px, 90 inside (0.90): a part (at least 90%)
            [-2.0, 0.0, 7.0, 9.0],  # 100 px, 80 inside: not a part
            [30.0, 30.0, 35.0, 35.0],  # outside
        ]
    )
    mask = part_proposal_mask(boxes, gt)
    assert mask[:, 0].tolist() == [True, False, False, True, True, False, False]
    # Stricter thresholds move the boundary cases.
    assert part_proposal_mask(boxes, gt, inside=0.95)[:, 0].tolist() == [
        True,
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    assert part_proposal_mask(boxes, gt, max_area=0.3)[:, 0].tolist() == [
        True,
        False,
        False,
        False,
        True,
        False,
        False,
    ]


def _naive_counts(proposals, gt_boxes, gt_labels, num_classes, inside=0.9, max_area=0.5):
    """Pixel by pixel: rasterise each box and count shared pixels (an independent reference)."""
    objects, parts = [0] * num_classes, [0] * num_classes
    for boxes, gts, labels in zip(proposals, gt_boxes, gt_labels, strict=True):
        for gt, label in zip(gts, labels, strict=True):
            objects[label] += 1
            gt_pixels = {(x, y) for x in range(gt[0], gt[2] + 1) for y in range(gt[1], gt[3] + 1)}
            for box in boxes:
                pixels = {(x, y) for x in range(box[0], box[2] + 1) for y in range(box[1], box[3] + 1)}
                if (
                    pixels
                    and len(pixels & gt_pixels) >= inside * len(pixels)
                    and len(pixels) < max_area * len(gt_pixels)
                ):
                    parts[label] += 1
    return objects, parts


def test_counts_match_a_pixel_by_pixel_reference():
    rng = np.random.default_rng(0)
    proposals, gt_boxes, gt_labels = [], [], []
    for _ in range(6):
        corners = rng.integers(0, 40, size=(25, 2))
        sizes = rng.integers(1, 25, size=(25, 2))
        proposals.append(np.concatenate([corners, corners + sizes], axis=1))
        gt_corner = rng.integers(0, 30, size=(3, 2))
        gt_boxes.append(np.concatenate([gt_corner, gt_corner + rng.integers(8, 30, size=(3, 2))], axis=1))
        gt_labels.append(rng.integers(0, 3, size=3))
    report = count_part_proposals(proposals, gt_boxes, gt_labels, ("a", "b", "c"))
    objects, parts = _naive_counts(proposals, gt_boxes, gt_labels, 3)
    assert report.objects.tolist() == objects
    assert report.parts.tolist() == parts
    assert sum(parts) > 0, "the draw must hold parts for the comparison to mean something"
    np.testing.assert_allclose(report.per_object(), np.array(parts) / np.array(objects))


def test_difficult_objects_are_left_out_and_a_class_without_objects_is_nan():
    gt = [np.array([[0, 0, 19, 19], [40, 40, 59, 59]])]
    boxes = [np.array([[0, 0, 9, 9], [40, 40, 45, 45]])]
    report = count_part_proposals(boxes, gt, [np.array([0, 1])], ("a", "b", "c"), [np.array([False, True])])
    assert report.objects.tolist() == [1, 0, 0]
    assert report.parts.tolist() == [1, 0, 0]
    assert np.isnan(report.per_object()[1:]).all()
    table = format_part_table(report)
    assert "a" in table and "nan" in table and "90%" in table


def test_records_apply_the_loading_rules_before_counting():
    record = ImageRecord(
        image_id="0",
        path="unused.png",
        height=100,
        width=100,
        labels=np.array([1.0], np.float32),
        gt_boxes=np.array([[0, 0, 59, 59]], np.float32),
        gt_labels=np.array([0]),
        gt_difficult=np.array([False]),
    )
    boxes = np.array([[0, 0, 9, 9], [0, 0, 29, 29], [0, 0, 59, 59]], np.float32)  # parts of 10 and 30 px
    proposals = ProposalSet(["0"], [boxes])
    assert records_part_proposals(proposals, [record], ("a",)).parts.tolist() == [2]
    assert records_part_proposals(proposals, [record], ("a",), min_size=28).parts.tolist() == [1]
    label_only = ImageRecord(image_id="0", path="unused.png", height=100, width=100, labels=record.labels)
    assert records_part_proposals(proposals, [label_only], ("a",)) is None


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="1 proposal arrays, 2 box and 2 label arrays"):
        count_part_proposals([np.zeros((0, 4))], [np.zeros((0, 4))] * 2, [np.zeros(0)] * 2, ("a",))


def _make_proposals_tool():
    spec = importlib.util.spec_from_file_location("make_proposals_tool", ROOT / "tools" / "make_proposals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_proposals_prints_the_part_table_for_a_toy_split(tmp_path, monkeypatch, capsys):
    """A tiny toy set drawn with data=toy_parts' object sizes and its own proposals: the recall table and
    then, per class, the part proposals per object; ``--object-size`` reaches the toy's manifest check."""
    from wsod.data.toy import TOY_CLASSES, ensure_toy_dataset

    root = tmp_path / "toy"
    toy = ensure_toy_dataset(root, num_train=4, num_test=4, object_size=(25, 70))
    tool = _make_proposals_tool()
    # The tool makes the full-size toy; the test's folder is the tiny one (same drawing, fewer images).
    monkeypatch.setattr(
        tool, "ensure_toy_dataset", functools.partial(ensure_toy_dataset, num_train=4, num_test=4)
    )
    arguments = [
        "toy",
        "--root",
        str(root),
        "--split",
        "test",
        "--proposals",
        str(toy.proposal_files["test"]),
    ]
    arguments += ["--no-progress", "--recall-plot", str(tmp_path / "recall.png")]
    assert tool.main([*arguments, "--object-size", "25", "70"]) == 0
    printed = capsys.readouterr().out
    assert printed.index("recall@0.5") < printed.index("part proposals") < printed.index(TOY_CLASSES[-1])
    for name in TOY_CLASSES:
        assert name in printed
    with pytest.raises(ValueError, match="delete the folder"):  # the default size is not the folder's
        tool.main(arguments)
