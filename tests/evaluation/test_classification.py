"""Image-level classification AP (wsod/evaluation/classification.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from wsod.evaluation.classification import classification_ap, format_classification


def test_classification_ap_equals_the_hand_computed_values():
    # Class 0: images ranked 0.9 (positive), 0.8 (negative), 0.7 (positive), 0.6 (negative):
    # precision 1, 1/2, 2/3, 1/2 at recall 1/2, 1/2, 1, 1.
    #   area:  1/2 x 1 + 1/2 x 2/3 = 5/6
    #   voc07: recall thresholds 0 .. 0.5 (6 of them) reach precision 1, 0.6 .. 1 (5) reach 2/3: 28/33
    # Class 1: the two positives ranked first: AP 1 either way. Class 2: no positive: NaN, not averaged.
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.8, 0.2, 0.5], [0.7, 0.8, 0.5], [0.6, 0.9, 0.5]])
    labels = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 0], [0, 1, 0]])
    area = classification_ap(scores, labels, "area")
    assert area["ap"][:2] == pytest.approx([5 / 6, 1.0]) and math.isnan(area["ap"][2])
    assert area["cls_mAP"] == pytest.approx((5 / 6 + 1) / 2) and area["num_positives"] == [2, 2, 0]
    voc07 = classification_ap(scores, labels, "voc07")
    assert voc07["ap"][:2] == pytest.approx([28 / 33, 1.0])


def test_tied_scores_keep_image_order():
    # All scores tie: the stable ranking is image order, negative first, then the positive.
    result = classification_ap(torch.zeros(2, 1), torch.tensor([[0], [1]]), "area")
    assert result["ap"] == pytest.approx([0.5])


def test_the_report_has_a_table_and_a_copypaste_line():
    result = classification_ap(torch.tensor([[0.9, 0.1], [0.2, 0.3]]), torch.tensor([[1, 0], [0, 0]]))
    report = format_classification(result, ["cat", "dog"])
    assert "cat" in report and "100.00" in report and "mean" in report
    assert report.splitlines()[-1] == "copypaste: cls_mAP(area)=100.00, per-class AP: 100.00,nan"
    with pytest.raises(ValueError, match="must both be"):
        classification_ap(torch.zeros(3, 2), torch.zeros(3, 1))
