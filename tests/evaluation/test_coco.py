"""The pycocotools bridge: conversion by hand, and evaluation equal to calling pycocotools directly."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from wsod.evaluation.coco import (
    STAT_NAMES,
    evaluate_coco,
    format_coco_stats,
    load_coco,
    save_coco_results,
    to_coco_results,
)

# Contiguous class k is COCO category CATEGORY_IDS[k]: ids need not be contiguous.
CATEGORY_IDS = [1, 3, 7]
IMAGE_IDS = [10, 20, 30]

# Objects of every COCO area range: small < 32^2 <= medium < 96^2 <= large (COCO's "area" field).
OBJECTS = [  # image id, category id, xywh
    (10, 1, [10, 10, 20, 20]),  # small, 400
    (10, 3, [50, 50, 50, 50]),  # medium, 2500
    (20, 1, [0, 0, 120, 100]),  # large, 12000
    (20, 7, [130, 130, 40, 60]),  # medium, 2400
    (30, 7, [5, 5, 25, 30]),  # small, 750
    (30, 3, [60, 20, 100, 110]),  # large, 11000
]

# The detections below, written by hand as COCO results (xywh). Good ones, shifted ones, a duplicate,
# a wrong class and a stray box. Scores are exact in float32, so both forms carry the same numbers.
RESULTS_BY_HAND = [  # image id, category id, xywh, score
    (10, 1, [10, 10, 20, 20], 0.875),
    (10, 3, [52, 50, 48, 52], 0.75),
    (10, 1, [12, 10, 18, 21], 0.25),
    (20, 1, [0, 0, 110, 100], 0.9375),
    (20, 7, [130, 130, 40, 60], 0.625),
    (20, 3, [0, 0, 120, 100], 0.375),
    (30, 7, [5, 5, 25, 30], 0.6875),
    (30, 3, [150, 150, 40, 40], 0.125),
]


def ground_truth():
    return {
        "images": [{"id": i, "width": 200, "height": 200, "file_name": f"{i}.jpg"} for i in IMAGE_IDS],
        "categories": [{"id": c, "name": f"class{c}"} for c in CATEGORY_IDS],
        "annotations": [
            {"id": n + 1, "image_id": i, "category_id": c, "bbox": b, "area": b[2] * b[3], "iscrowd": 0}
            for n, (i, c, b) in enumerate(OBJECTS)
        ],
    }


def dets(boxes, scores, labels):
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "scores": torch.tensor(scores, dtype=torch.float32),
        "labels": torch.tensor(labels, dtype=torch.int64),
    }


def detections():
    # RESULTS_BY_HAND as per-image xyxy detections (x2 = x + w) with contiguous labels.
    return [
        dets([[10, 10, 30, 30], [52, 50, 100, 102], [12, 10, 30, 31]], [0.875, 0.75, 0.25], [0, 1, 0]),
        dets([[0, 0, 110, 100], [130, 130, 170, 190], [0, 0, 120, 100]], [0.9375, 0.625, 0.375], [0, 2, 1]),
        dets([[5, 5, 30, 35], [150, 150, 190, 190]], [0.6875, 0.125], [2, 1]),
    ]


def pycocotools_stats(gt_path, image_ids=None):
    results = [{"image_id": i, "category_id": c, "bbox": b, "score": s} for i, c, b, s in RESULTS_BY_HAND]
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(gt_path))
        evaluator = COCOeval(coco_gt, coco_gt.loadRes(results), iouType="bbox")
        if image_ids is not None:
            evaluator.params.imgIds = image_ids
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator.stats.tolist()


@pytest.fixture
def gt_path(tmp_path):
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(ground_truth()))
    return path


def test_to_coco_results_by_hand():
    # xyxy [52, 50, 100, 102] -> xywh [52, 50, 48, 52]; label 1 -> category 3; detections[0] -> image 10.
    results = to_coco_results(detections(), IMAGE_IDS, CATEGORY_IDS)
    assert results == [
        {"image_id": i, "category_id": c, "bbox": [float(v) for v in b], "score": s}
        for i, c, b, s in RESULTS_BY_HAND
    ]
    assert json.loads(json.dumps(results)) == results  # plain Python numbers
    with pytest.raises(ValueError, match="label"):
        to_coco_results(detections(), IMAGE_IDS, CATEGORY_IDS[:2])
    with pytest.raises(ValueError, match="image ids"):
        to_coco_results(detections(), IMAGE_IDS[:2], CATEGORY_IDS)


def test_equals_pycocotools_on_the_same_detections(gt_path):
    expected = pycocotools_stats(gt_path)
    results = to_coco_results(detections(), IMAGE_IDS, CATEGORY_IDS)
    for ground_truth_form in (gt_path, str(gt_path), ground_truth(), load_coco(gt_path)):
        stats = evaluate_coco(results, ground_truth_form)
        assert list(stats) == list(STAT_NAMES)
        assert list(stats.values()) == expected
    # Part of a split: image_ids restricts evaluation to those images, as imgIds does in pycocotools.
    partial = evaluate_coco(results, gt_path, image_ids=[20, 10])
    assert list(partial.values()) == pycocotools_stats(gt_path, image_ids=[10, 20])
    # The case is not degenerate, and loadRes did not write into our dicts.
    assert any(0 < v < 1 for v in expected) and partial != stats
    assert all(set(r) == {"image_id", "category_id", "bbox", "score"} for r in results)


def test_perfect_detections_score_one(gt_path):
    # Every object found exactly, nothing else: precision 1 at every recall, so every AP and AR is 1.
    perfect = [dets([[x, y, x + w, y + h]], [1.0], [CATEGORY_IDS.index(c)]) for _, c, (x, y, w, h) in OBJECTS]
    image_ids = [i for i, _, _ in OBJECTS]
    stats = evaluate_coco(to_coco_results(perfect, image_ids, CATEGORY_IDS), gt_path)
    assert stats == pytest.approx(dict.fromkeys(STAT_NAMES, 1.0))


def test_no_detections_at_all(gt_path, capsys):
    # pycocotools' loadRes fails on []; the bridge evaluates an empty result set instead. Every area range
    # has objects and nothing is found, so every AP and AR is 0.
    empty = to_coco_results([dets([], [], [])] * 3, IMAGE_IDS, CATEGORY_IDS)
    assert empty == []
    assert evaluate_coco(empty, gt_path) == dict.fromkeys(STAT_NAMES, 0.0)
    # Image 10 alone has no large object: APl and ARl are undefined (-1), the rest 0.
    stats = evaluate_coco([], gt_path, image_ids=[10])
    assert stats == {**dict.fromkeys(STAT_NAMES, 0.0), "APl": -1.0, "ARl": -1.0}
    assert capsys.readouterr().out == ""  # pycocotools' chatter is swallowed


def test_results_json_round_trip(gt_path, tmp_path):
    results = to_coco_results(detections(), IMAGE_IDS, CATEGORY_IDS)
    path = save_coco_results(results, tmp_path / "out" / "results.json")
    assert json.loads(path.read_text()) == results
    assert evaluate_coco(path, gt_path) == evaluate_coco(results, gt_path)


def test_format_coco_stats():
    values = [0.125, 0.25, 0.0, -1.0, 0.5, 1.0, 0.1, 0.2, 0.3, -1.0, 0.4, 0.6]
    lines = format_coco_stats(dict(zip(STAT_NAMES, values, strict=True))).splitlines()
    assert lines[0].split() == list(STAT_NAMES)
    expected = ["12.50", "25.00", "0.00", "-", "50.00", "100.00", "10.00", "20.00", "30.00", "-", "40.00"]
    assert lines[1].split() == [*expected, "60.00"]
    assert lines[2] == (
        "copypaste: COCO bbox AP,AP50,AP75,APs,APm,APl,AR1,AR10,AR100,ARs,ARm,ARl: "
        "12.50,25.00,0.00,nan,50.00,100.00,10.00,20.00,30.00,nan,40.00,60.00"
    )


def _without(data, *fields, keep=()):
    """``data`` with ``fields`` removed from every annotation but those numbered in ``keep``."""
    annotations = [
        a if n in keep else {k: v for k, v in a.items() if k not in fields}
        for n, a in enumerate(data["annotations"])
    ]
    return {**data, "annotations": annotations}


def test_a_raw_file_without_optional_fields_evaluates_as_the_filled_in_one(gt_path, tmp_path):
    # Before: KeyError 'id' (then 'iscrowd', then 'area') inside pycocotools, which read the file raw.
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(_without(ground_truth(), "id", "iscrowd", "area")))
    results = to_coco_results(detections(), IMAGE_IDS, CATEGORY_IDS)
    expected = pycocotools_stats(gt_path)
    assert list(evaluate_coco(results, raw).values()) == expected
    loaded = json.loads(raw.read_text())
    assert list(evaluate_coco(results, loaded).values()) == expected
    assert loaded == json.loads(raw.read_text())  # a dict ground truth is left as it was given


def test_a_given_area_is_kept_for_the_size_ranges(tmp_path):
    # COCO's "area" is the segmentation's, smaller than the box's: an object with a 2500 px box but a
    # 900 px mask is small. A given area is kept; w * h only stands in where none is given.
    data = ground_truth()
    data["annotations"][1]["area"] = 900.0  # the 50 x 50 box of image 10
    given = tmp_path / "given.json"
    given.write_text(json.dumps(data))
    partly = tmp_path / "partly.json"
    partly.write_text(json.dumps(_without(data, "area", keep={1})))
    results = to_coco_results(detections(), IMAGE_IDS, CATEGORY_IDS)
    stats = evaluate_coco(results, partly)
    assert list(stats.values()) == pycocotools_stats(given)
    assert stats != evaluate_coco(results, _without(data, "area"))  # the size split did change


def test_evaluation_errors_name_the_annotation_file(gt_path, tmp_path):
    results = to_coco_results(detections(), IMAGE_IDS, CATEGORY_IDS)
    # An image id the ground truth lacks (pycocotools: a bare AssertionError).
    stray = [*results, {"image_id": 99, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 0.5}]
    with pytest.raises(ValueError, match=r"instances\.json has no image 99 that the results name"):
        evaluate_coco(stray, gt_path)
    # Anything pycocotools itself raises (here: a result without a score, KeyError 'score').
    scoreless = [{k: v for k, v in r.items() if k != "score"} for r in results]
    with pytest.raises(
        ValueError, match=r"COCO evaluation against .*instances\.json failed: KeyError: 'score'"
    ):
        evaluate_coco(scoreless, gt_path)
    with pytest.raises(ValueError, match=r"COCO evaluation against test\.json failed: KeyError"):
        evaluate_coco(scoreless, load_coco(gt_path), source="test.json")
    # Labels only (no boxes): nothing to evaluate boxes against.
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps(_without(ground_truth(), "bbox", "area")))
    with pytest.raises(ValueError, match=r"labels\.json: its annotations have no 'bbox'"):
        evaluate_coco(results, labels)
    # The loader's checks apply to a path as they do to training data.
    duplicated = ground_truth()
    duplicated["annotations"][1]["id"] = 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(duplicated))
    with pytest.raises(ValueError, match=r"bad\.json: annotations\[1\] has id 1, as annotations\[0\] does"):
        evaluate_coco(results, bad)
