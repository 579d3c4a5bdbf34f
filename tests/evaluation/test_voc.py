"""VOC AP / mAP, CorLoc, the results table and devkit files against hand-computed cases.

Expected numbers come from arithmetic written in the comments, plus one randomised comparison with a
plain-loop transliteration of the devkit's VOCevaldet.m. Boxes are 0-based inclusive pixels: [0, 0, 9, 9]
is a 10 x 10 box of area 100.
"""

from __future__ import annotations

import math

import pytest
import torch

from wsod.evaluation.voc import average_precision, corloc, evaluate, format_results, write_voc_results
from wsod.modeling.inclusive_boxes import inclusive_box_iou

# Four 10 x 10 boxes that do not touch each other.
A, B, C, FAR = [0, 0, 9, 9], [20, 0, 29, 9], [40, 0, 49, 9], [100, 100, 109, 109]


def dets(boxes, scores, labels=None):
    labels = [0] * len(boxes) if labels is None else labels
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "scores": torch.tensor(scores, dtype=torch.float32),
        "labels": torch.tensor(labels, dtype=torch.int64),
    }


def gts(boxes, labels=None, difficult=None):
    labels = [0] * len(boxes) if labels is None else labels
    difficult = [False] * len(boxes) if difficult is None else difficult
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "labels": torch.tensor(labels, dtype=torch.int64),
        "difficult": torch.tensor(difficult, dtype=torch.bool),
    }


def ap(detections, annotations, metric, num_classes=1, **kwargs):
    return evaluate(detections, annotations, num_classes, metric=metric, **kwargs)["ap"]


# ----------------------------------------------------------------------------------------------------
# AP


def test_voc07_and_area_differ():
    # Three objects; ranked detections: TP(A), FP, TP(B), FP. C is never found, npos = 3.
    #   recall    1/3  1/3  2/3  2/3
    #   precision 1    1/2  2/3  1/2
    # 11-point: t = 0, .1, .2, .3 -> 1 (recall 1/3 reaches .3); t = .4, .5, .6 -> max(2/3, 1/2) = 2/3;
    #   t = .7 .. 1 -> 0 (recall stops at 2/3).  AP = (4 + 3 * 2/3) / 11 = 6/11.
    # Area: envelope 1 on (0, 1/3], 2/3 on (1/3, 2/3], 0 beyond.  AP = 1/3 + 2/9 = 5/9.
    detections = [dets([A, FAR, B, FAR], [0.9, 0.8, 0.7, 0.6])]
    annotations = [gts([A, B, C])]
    voc07 = evaluate(detections, annotations, 1, metric="voc07")
    area = evaluate(detections, annotations, 1, metric="area")
    assert voc07["ap"][0] == pytest.approx(6 / 11)
    assert area["ap"][0] == pytest.approx(5 / 9)
    assert voc07["mAP"] == pytest.approx(6 / 11) and area["mAP"] == pytest.approx(5 / 9)
    assert voc07["recall"][0] == pytest.approx(2 / 3)
    assert voc07["metric"] == "voc07" and area["metric"] == "area" and voc07["iou"] == 0.5
    assert voc07["num_gt"] == [3] and voc07["num_detections"] == [4]


@pytest.mark.parametrize("metric", ["voc07", "area"])
def test_detections_on_difficult_objects_are_neither_tp_nor_fp(metric):
    # A is a normal object, D a difficult one. Ranked: on D, on A, on D again. Ignoring both D hits leaves
    # one TP: recall 1, precision 1, AP 1. (Counted as FP the first would give AP 1/2 under both
    # metrics; counted as an object, D would halve recall.)
    D = B
    detections = [dets([D, A, D], [0.9, 0.8, 0.7])]
    annotations = [gts([A, D], difficult=[False, True])]
    result = evaluate(detections, annotations, 1, metric=metric)
    assert result["ap"] == [pytest.approx(1.0)]
    assert result["recall"] == [pytest.approx(1.0)]
    assert result["num_gt"] == [1]


def test_detection_whose_best_box_is_difficult_is_ignored_even_if_it_overlaps_a_normal_box():
    # A = [0, 0, 9, 9] normal, D = [2, 0, 11, 9] difficult, detection [2, 0, 10, 9] (9 x 10 = 90 px):
    #   IoU with D = 90 / (90 + 100 - 90) = 0.9, with A = 80 / (90 + 100 - 80) = 8/11 = 0.727.
    # The devkit takes the best box (D): ignored, so A is never found. AP 0, recall 0.
    detections = [dets([[2, 0, 10, 9]], [0.9])]
    annotations = [gts([A, [2, 0, 11, 9]], difficult=[False, True])]
    result = evaluate(detections, annotations, 1)
    assert result["ap"] == [0.0] and result["recall"] == [0.0]


def test_iou_tie_between_boxes_goes_to_the_first_in_annotation_order():
    # Detection A = [0, 0, 9, 9] (100 px) inside both [0, 0, 9, 19] and [0, 0, 19, 9] (200 px each):
    # IoU 100 / 200 = 0.5 with each. The devkit keeps the first maximum (strict >).
    # First box difficult: the detection is ignored, the normal second box is never found: AP 0.
    # First box normal: TP, AP 1.
    tall, wide, detection = [0, 0, 9, 19], [0, 0, 19, 9], [dets([A], [0.9])]
    assert ap(detection, [gts([tall, wide], difficult=[True, False])], "voc07") == [0.0]
    assert ap(detection, [gts([tall, wide], difficult=[False, True])], "voc07") == [pytest.approx(1.0)]


@pytest.mark.parametrize(("metric", "expected"), [("voc07", 28 / 33), ("area", 5 / 6)])
def test_duplicate_detections_are_false_positives(metric, expected):
    # Two objects A, B. Ranked: TP(A), duplicate on A (FP), TP(B).
    #   recall    1/2  1/2  1
    #   precision 1    1/2  2/3
    # 11-point: t = 0 .. .5 (6 thresholds) -> 1; t = .6 .. 1 (5) -> 2/3. AP = (6 + 10/3) / 11 = 28/33.
    # Area: 1/2 * 1 + 1/2 * 2/3 = 5/6.  (A duplicate counted as TP or ignored would give AP 1.)
    detections = [dets([A, [0, 0, 9, 8], B], [0.9, 0.8, 0.7])]
    annotations = [gts([A, B])]
    assert ap(detections, annotations, metric) == [pytest.approx(expected)]


@pytest.mark.parametrize(("metric", "expected"), [("voc07", 6 / 11), ("area", 1 / 2)])
def test_best_box_already_matched_makes_a_false_positive(metric, expected):
    # A = [0, 0, 9, 9] (100 px) inside E = [0, 0, 9, 14] (150 px). Two detections exactly on A:
    #   IoU with A = 1, with E = 100 / 150 = 2/3 >= 0.5.
    # The second's best box A is matched already: FP, although E is free (the devkit does not fall back
    # to the next best box). recall 1/2, 1/2; precision 1, 1/2.
    # 11-point: t = 0 .. .5 -> 1, beyond -> 0: 6/11.  Area: 1/2 * 1 = 1/2.
    detections = [dets([A, A], [0.9, 0.8])]
    annotations = [gts([A, [0, 0, 9, 14]])]
    assert ap(detections, annotations, metric) == [pytest.approx(expected)]
    assert evaluate(detections, annotations, 1)["recall"] == [pytest.approx(0.5)]


def test_iou_exactly_half_counts_for_ap():
    # Detection [0, 0, 4, 9] (5 x 10 = 50 px) inside A (100 px): IoU = 50 / 100 = 0.5 exactly, and the
    # devkit's test is >= 0.5: TP, AP 1.
    half = [0, 0, 4, 9]
    assert inclusive_box_iou(torch.tensor([half], dtype=torch.float64), torch.tensor([A]).double()) == 0.5
    for metric in ("voc07", "area"):
        assert ap([dets([half], [0.9])], [gts([A])], metric) == [pytest.approx(1.0)]
    # A stricter threshold makes the same detection a FP: the threshold is actually used.
    assert ap([dets([half], [0.9])], [gts([A])], "voc07", iou=0.51) == [0.0]


def test_inclusive_pixel_convention():
    # Detection [0, 0, 5, 8] against A = [0, 0, 9, 9]:
    #   inclusive: 6 x 9 = 54 px of 100 -> IoU 0.54 >= 0.5: TP, AP 1, and correct for CorLoc (> 0.5);
    #   exclusive (x2 - x1): 5 x 8 = 40 of 9 x 9 = 81 -> IoU 0.494: it would be a FP and incorrect.
    box = [0, 0, 5, 8]
    iou = inclusive_box_iou(torch.tensor([box]).double(), torch.tensor([A]).double())
    assert iou.item() == pytest.approx(0.54)
    assert ap([dets([box], [0.9])], [gts([A])], "voc07") == [pytest.approx(1.0)]
    assert corloc([dets([box], [0.9])], [gts([A])], 1)["corloc"] == [1.0]


def test_class_with_ground_truth_but_no_detections_has_zero_ap():
    # Class 0: one perfect detection (AP 1). Class 1: an object, no detection (AP 0). mAP = 1/2.
    result = evaluate([dets([A], [0.9], [0])], [gts([A, B], [0, 1])], 2)
    assert result["ap"] == [pytest.approx(1.0), 0.0]
    assert result["recall"] == [pytest.approx(1.0), 0.0]
    assert result["mAP"] == pytest.approx(0.5)
    assert result["num_detections"] == [1, 0]


def test_class_without_non_difficult_ground_truth_is_nan_and_left_out_of_the_mean():
    # Class 0: perfect (AP 1). Class 1: only a difficult object, detected. Class 2: no object, a stray
    # detection. Classes 1 and 2 have no recall to speak of: NaN, and mAP = AP of class 0 = 1.
    detections = [dets([A, B, FAR], [0.9, 0.8, 0.7], [0, 1, 2])]
    annotations = [gts([A, B], [0, 1], difficult=[False, True])]
    for metric in ("voc07", "area"):
        result = evaluate(detections, annotations, 3, metric=metric)
        assert result["ap"][0] == pytest.approx(1.0)
        assert math.isnan(result["ap"][1]) and math.isnan(result["ap"][2])
        assert math.isnan(result["recall"][1]) and math.isnan(result["recall"][2])
        assert result["num_gt"] == [1, 0, 0]
        assert result["mAP"] == pytest.approx(1.0)


def test_detections_of_other_classes_do_not_match():
    # A detection of class 1 exactly on an object of class 0 is a FP for class 1 and no TP for class 0.
    result = evaluate([dets([A], [0.9], [1])], [gts([A, B], [0, 1])], 2)
    assert result["ap"] == [0.0, 0.0]


def test_equal_scores_keep_image_then_detection_order():
    # One object, a FP and a TP of equal score. Input order FP, TP: recall 0, 1; precision 0, 1/2, so the
    # best precision at any recall is 1/2: AP 1/2 under both metrics. Order TP, FP: precision 1 at
    # recall 1: AP 1.
    within_fp_first = [dets([FAR, A], [0.5, 0.5])], [gts([A])]
    within_tp_first = [dets([A, FAR], [0.5, 0.5])], [gts([A])]
    across_fp_first = [dets([FAR], [0.5]), dets([A], [0.5])], [gts([]), gts([A])]
    across_tp_first = [dets([A], [0.5]), dets([FAR], [0.5])], [gts([A]), gts([])]
    for metric in ("voc07", "area"):
        assert ap(*within_fp_first, metric) == [pytest.approx(0.5)]
        assert ap(*within_tp_first, metric) == [pytest.approx(1.0)]
        assert ap(*across_fp_first, metric) == [pytest.approx(0.5)]
        assert ap(*across_tp_first, metric) == [pytest.approx(1.0)]


@pytest.mark.parametrize(("found", "expected"), [(3, 3 / 11), (6, 7 / 11), (7, 8 / 11)])
def test_voc07_recall_thresholds_are_matlabs(found, expected):
    # Ten objects, the first `found` detected with precision 1 and nothing else: recall tops at found/10.
    # MATLAB's 0:0.1:1 holds 3 * 0.1 = 0.30000000000000004 but exactly 0.6 and 0.7, so recall 0.3
    # reaches t = 0, .1, .2 only (3/11), recall 0.6 reaches t = 0 .. .6 (7/11), recall 0.7 t = 0 .. .7
    # (8/11). Exact thresholds k/10 would give 4/11, 7/11, 8/11; the Python port's np.arange(0, 1.1, 0.1)
    # (0.30000000000000004, 0.6000000000000001, 0.7000000000000001) 3/11, 6/11, 7/11.
    objects = [[20 * i, 0, 20 * i + 9, 9] for i in range(10)]
    detections = [dets(objects[:found], [1.0 - 0.01 * i for i in range(found)])]
    assert ap(detections, [gts(objects)], "voc07") == [pytest.approx(expected)]


def test_average_precision_directly():
    # Area, points (recall, precision): (.5, .5), (1, 1). The envelope is 1 everywhere: AP 1. 11-point: 1.
    recall, precision = torch.tensor([0.5, 1.0]), torch.tensor([0.5, 1.0])
    assert average_precision(recall, precision, "area") == pytest.approx(1.0)
    assert average_precision(recall, precision, "voc07") == pytest.approx(1.0)
    assert average_precision(torch.zeros(0), torch.zeros(0), "voc07") == 0.0
    assert average_precision(torch.zeros(0), torch.zeros(0), "area") == 0.0


# ----------------------------------------------------------------------------------------------------
# CorLoc


def test_corloc_iou_exactly_half_is_not_correct():
    # IoU 50 / 100 = 0.5 exactly; CorLoc needs > 0.5.
    result = corloc([dets([[0, 0, 4, 9]], [0.9])], [gts([A])], 1)
    assert result["corloc"] == [0.0] and result["CorLoc"] == 0.0
    assert result["num_images"] == [1] and result["num_correct"] == [0]


def test_corloc_image_without_detection_of_a_present_class_is_incorrect():
    # Class 0 is in both images; image 0's top detection is on it, image 1 has none: 1/2.
    # Class 1 is in image 1 only, its top detection (0.9) is off and the exact one (0.1) does not count:
    # 0/1. Class 2 occurs nowhere (its stray detection is ignored): NaN, left out. Mean = (1/2 + 0) / 2.
    detections = [dets([A, FAR], [0.8, 0.3], [0, 2]), dets([FAR, B], [0.9, 0.1], [1, 1])]
    annotations = [gts([A], [0]), gts([C, B], [0, 1])]
    result = corloc(detections, annotations, 3)
    assert result["corloc"][:2] == [0.5, 0.0] and math.isnan(result["corloc"][2])
    assert result["num_images"] == [2, 1, 0] and result["num_correct"] == [1, 0, 0]
    assert result["CorLoc"] == pytest.approx(0.25)


def test_corloc_names_the_top_detections_on_a_part():
    # Class 0 in four images, each object 20 x 20 (400 px). Image 0: the top box is a 10 x 10 corner
    # (100 px, all inside): on a part. Image 1: the top box is the object: correct, not on a part.
    # Image 2: a 10 x 10 box with 50 of its 100 px on the object (exactly half: at least half inside)
    # and under half its area: on a part. Image 3: a 10 x 10 box with 40 px on the object: not on a part;
    # and half the object (200 px, not under half, IoU 0.5 is not above): wrong, yet not a part.
    # Class 1 in image 3: its top box is a 5 x 5 piece of the class-0 object, not of its own: not a part.
    big = [0, 0, 19, 19]
    detections = [
        dets([[0, 0, 9, 9], big], [0.9, 0.8]),
        dets([big, [0, 0, 9, 9]], [0.9, 0.8]),
        dets([[15, 0, 24, 9]], [0.9]),
        dets([[16, 0, 25, 9], [0, 0, 4, 4]], [0.9, 0.8], [0, 1]),
        dets([[0, 0, 19, 9]], [0.9]),
    ]
    annotations = [gts([big]), gts([big]), gts([big]), gts([big, [60, 60, 79, 79]], [0, 1]), gts([big])]
    result = corloc(detections, annotations, 2)
    assert result["num_images"] == [5, 1]
    assert result["num_correct"] == [1, 0] and result["num_on_part"] == [2, 0]
    assert result["on_part"] == [pytest.approx(2 / 5), 0.0]
    assert result["OnPart"] == pytest.approx((2 / 5 + 0.0) / 2)  # the mean over the classes present
    # The same verdicts from a pixel-by-pixel reference: rasterise the top box and the object, count.
    expected = {(0, 0): True, (1, 0): False, (2, 0): True, (3, 0): False, (3, 1): False, (4, 0): False}
    for (i, c), verdict in expected.items():
        det, ann = detections[i], annotations[i]
        mine = det["labels"] == c
        x1, y1, x2, y2 = det["boxes"][mine][det["scores"][mine].argmax()].int().tolist()
        ox1, oy1, ox2, oy2 = ann["boxes"][ann["labels"] == c][0].int().tolist()
        box = {(x, y) for x in range(x1, x2 + 1) for y in range(y1, y2 + 1)}
        obj = {(x, y) for x in range(ox1, ox2 + 1) for y in range(oy1, oy2 + 1)}
        iou = len(box & obj) / len(box | obj)
        assert (iou <= 0.5 and len(box & obj) >= 0.5 * len(box) and len(box) < 0.5 * len(obj)) == verdict


def test_corloc_counts_difficult_objects():
    # The only object of class 0 is difficult: the class is present, and a detection on it is correct.
    # Two objects of class 0 in one image: a hit on either is correct (one image, counted once).
    result = corloc([dets([A], [0.9]), dets([B], [0.9])], [gts([A], difficult=[True]), gts([A, B])], 1)
    assert result["corloc"] == [1.0] and result["num_images"] == [2]


# ----------------------------------------------------------------------------------------------------
# Independent check: a plain-loop transliteration of VOCevaldet.m on random images.


def devkit_ap(detections, annotations, cls, use_07):
    gt = []
    npos = 0
    for ann in annotations:
        keep = [i for i, label in enumerate(ann["labels"].tolist()) if label == cls]
        boxes = [ann["boxes"][i].tolist() for i in keep]
        diff = [bool(ann["difficult"][i]) for i in keep]
        gt.append({"BB": boxes, "diff": diff, "det": [False] * len(keep)})
        npos += sum(not d for d in diff)
    ids, confidence, BB = [], [], []
    for i, det in enumerate(detections):
        for box, score, label in zip(
            det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist(), strict=True
        ):
            if label == cls:
                ids.append(i), confidence.append(score), BB.append(box)
    si = sorted(range(len(ids)), key=lambda d: -confidence[d])  # Python's sort is stable, like MATLAB's
    tp, fp = [0] * len(si), [0] * len(si)
    for d, k in enumerate(si):
        g, bb = gt[ids[k]], BB[k]
        ovmax, jmax = -math.inf, None
        for j, bbgt in enumerate(g["BB"]):
            iw = min(bb[2], bbgt[2]) - max(bb[0], bbgt[0]) + 1
            ih = min(bb[3], bbgt[3]) - max(bb[1], bbgt[1]) + 1
            if iw > 0 and ih > 0:
                ua = (
                    (bb[2] - bb[0] + 1) * (bb[3] - bb[1] + 1)
                    + (bbgt[2] - bbgt[0] + 1) * (bbgt[3] - bbgt[1] + 1)
                    - iw * ih
                )
                if iw * ih / ua > ovmax:
                    ovmax, jmax = iw * ih / ua, j
        if ovmax >= 0.5:
            if not g["diff"][jmax]:
                if not g["det"][jmax]:
                    tp[d] = 1
                    g["det"][jmax] = True
                else:
                    fp[d] = 1
        else:
            fp[d] = 1
    rec, prec, ctp, cfp = [], [], 0, 0
    for t, f in zip(tp, fp, strict=True):
        ctp, cfp = ctp + t, cfp + f
        rec.append(ctp / npos)
        prec.append(ctp / (ctp + cfp) if ctp + cfp else math.nan)  # MATLAB: 0/0 = NaN, max skips it
    if use_07:
        thresholds = [0.0, 0.1, 0.2, 0.1 * 3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
        total = 0.0
        for t in thresholds:
            ps = [p for r, p in zip(rec, prec, strict=True) if r >= t and not math.isnan(p)]
            total += (max(ps) if ps else 0.0) / 11
        return total
    mrec, mpre = [0.0, *rec, 1.0], [0.0, *[0.0 if math.isnan(p) else p for p in prec], 0.0]
    for i in range(len(mpre) - 2, -1, -1):
        mpre[i] = max(mpre[i], mpre[i + 1])
    return sum((mrec[i] - mrec[i - 1]) * mpre[i] for i in range(1, len(mrec)) if mrec[i] != mrec[i - 1])


def random_images(seed, num_images=6, num_classes=3):
    g = torch.Generator().manual_seed(seed)
    detections, annotations = [], []
    for _ in range(num_images):
        # Integer corners on a small grid and coarse scores make IoU ties, exact 0.5s and score ties likely.
        num_gt, num_det = (int(n) for n in torch.randint(0, 6, (2,), generator=g))
        xy = torch.randint(0, 12, (num_gt + num_det, 2), generator=g).float()
        wh = torch.randint(1, 10, (num_gt + num_det, 2), generator=g).float()
        boxes = torch.cat([xy, xy + wh], dim=1)
        annotations.append(
            {
                "boxes": boxes[:num_gt],
                "labels": torch.randint(0, num_classes, (num_gt,), generator=g),
                "difficult": torch.rand(num_gt, generator=g) < 0.25,
            }
        )
        detections.append(
            {
                "boxes": boxes[num_gt:],
                "scores": (torch.rand(num_det, generator=g) * 4).round() / 4,
                "labels": torch.randint(0, num_classes, (num_det,), generator=g),
            }
        )
    return detections, annotations


@pytest.mark.parametrize("seed", range(20))
def test_matches_devkit_loop_on_random_images(seed):
    detections, annotations = random_images(seed)
    for metric in ("voc07", "area"):
        result = evaluate(detections, annotations, 3, metric=metric)
        for c in range(3):
            if result["num_gt"][c] == 0:
                assert math.isnan(result["ap"][c])
            else:
                assert result["ap"][c] == pytest.approx(
                    devkit_ap(detections, annotations, c, metric == "voc07")
                )


# ----------------------------------------------------------------------------------------------------
# Inputs, table, result files


def test_empty_and_invalid_inputs():
    empty = evaluate([], [], 2)
    assert math.isnan(empty["mAP"]) and empty["num_gt"] == [0, 0]
    assert math.isnan(corloc([], [], 2)["CorLoc"])
    # No detections at all, objects present: AP 0, CorLoc 0.
    no_dets = [dets([], [])], [gts([A])]
    assert evaluate(*no_dets, 1)["mAP"] == 0.0 and corloc(*no_dets, 1)["CorLoc"] == 0.0
    # "difficult" may be left out: nothing is difficult.
    assert evaluate([dets([A], [0.9])], [{"boxes": torch.tensor([A]), "labels": torch.tensor([0])}], 1)[
        "mAP"
    ] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="metric"):
        evaluate(*no_dets, 1, metric="coco")
    with pytest.raises(ValueError, match="iou"):
        evaluate(*no_dets, 1, iou=0.0)
    with pytest.raises(ValueError, match="labels"):
        evaluate([dets([A], [0.9], [1])], [gts([A])], 1)
    with pytest.raises(ValueError, match="images"):
        evaluate([dets([A], [0.9])], [], 1)
    with pytest.raises(ValueError, match="length"):
        evaluate([dets([A], [0.9, 0.8])], [gts([A])], 1)


def test_format_results_table_and_copypaste_line():
    # Class 0: AP 1 (CorLoc 1); class 1: AP 0 (CorLoc 0); class 2: no object (NaN).
    detections = [dets([A, FAR], [0.9, 0.8], [0, 1])]
    annotations = [gts([A, B], [0, 1])]
    results = evaluate(detections, annotations, 3)
    text = format_results(results, ["cat", "dog", "sheep"], corloc(detections, annotations, 3))
    lines = text.splitlines()
    assert lines[0].split() == ["class", "AP(voc07)", "recall", "CorLoc", "on", "a", "part"]
    assert lines[2].split() == ["cat", "100.00", "100.00", "100.00", "0.00"]
    assert lines[3].split() == ["dog", "0.00", "0.00", "0.00", "0.00"]
    assert lines[4].split() == ["sheep", "-", "-", "-", "-"]
    assert lines[-2].split() == ["mean", "50.00", "50.00", "50.00", "0.00"]
    assert lines[-1] == "copypaste: mAP(voc07,iou=0.5)=50.00, CorLoc=50.00, per-class AP: 100.00,0.00,nan"
    no_corloc = format_results(evaluate(detections, annotations, 3, metric="area"), ["cat", "dog", "sheep"])
    assert no_corloc.splitlines()[-1] == "copypaste: mAP(area,iou=0.5)=50.00, per-class AP: 100.00,0.00,nan"
    with pytest.raises(ValueError, match="class names"):
        format_results(results, ["cat"])


def test_write_voc_results(tmp_path):
    # 0-based inclusive boxes become the devkit's 1-based ones (+1); one file per class, empty ones too.
    detections = [dets([[0, 1, 9, 10.5], [5, 5, 7, 7]], [0.25, 1e-7], [1, 0]), dets([A], [0.5], [1])]
    paths = write_voc_results(detections, ["000001", "000004"], ["cat", "dog", "sheep"], tmp_path)
    assert [p.name for p in paths] == [
        "comp4_det_test_cat.txt",
        "comp4_det_test_dog.txt",
        "comp4_det_test_sheep.txt",
    ]
    assert paths[0].read_text() == "000001 1e-07 6.00 6.00 8.00 8.00\n"
    assert paths[1].read_text() == "000001 0.25 1.00 2.00 10.00 11.50\n000004 0.5 1.00 1.00 10.00 10.00\n"
    assert paths[2].read_text() == ""
    with pytest.raises(ValueError, match="labels"):
        write_voc_results(detections, ["000001", "000004"], ["cat"], tmp_path)
