"""The IoU conventions and comparison directions docs/METHOD.md §15 states, each on a box pair built to sit
where the rules differ (float64, so that an IoU of exactly 1/2 is exact)."""

from __future__ import annotations

import pytest
import torch
from composed import composed
from torchvision.ops import box_iou

from wsod.engine.pseudo_boxes import containment
from wsod.modeling.inclusive_boxes import inclusive_box_iou
from wsod.modeling.refinement import _assign_to_pseudo_boxes

SEED = torch.tensor([[0.0, 0.0, 99.0, 99.0]], dtype=torch.float64)
CLASSES, SCORES = torch.tensor([0]), torch.tensor([0.9], dtype=torch.float64)


def test_labelling_uses_continuous_iou_where_the_references_add_one_pixel():
    # The integer left 50 columns of a 100-pixel box: continuous IoU 49/99 < 0.5, inclusive 50/100 = 0.5,
    # foreground in wetectron (background is IoU < 0.5) and background in wsod (§15, the convention).
    left = torch.tensor([[0.0, 0.0, 49.0, 99.0]], dtype=torch.float64)
    assert box_iou(left, SEED).item() < 0.5 and inclusive_box_iou(left, SEED).item() == pytest.approx(0.5)
    labels, _, _ = _assign_to_pseudo_boxes(left, SEED, CLASSES, SCORES, 0.5)
    assert labels.tolist() == [0]
    # At a continuous IoU of exactly 0.5 (49.5 / 99), MIST's >= takes the ROI and OICR's > does not.
    half = torch.tensor([[0.0, 0.0, 49.5, 99.0]], dtype=torch.float64)
    assert box_iou(half, SEED).item() == 0.5
    mist, _, _ = _assign_to_pseudo_boxes(half, SEED, CLASSES, SCORES, 0.5)
    oicr, _, _ = _assign_to_pseudo_boxes(half, SEED, CLASSES, SCORES, 0.5, strict=True)
    assert mist.tolist() == [1] and oicr.tolist() == [0]


def test_the_exports_containment_is_the_true_share_wherever_the_part_lies():
    # SoS-WSOD's VOC containment reads corner boxes as xywh (§15, difference 3): a part in the bottom-right
    # quarter would measure 0.44 there. wsod: every quarter is wholly inside (share 1.0).
    whole = [100.0, 100.0, 299.0, 299.0]
    for part in ([100.0, 100.0, 199.0, 199.0], [200.0, 200.0, 299.0, 299.0]):
        share = containment(torch.tensor([part, whole]), epsilon=1e-6)[0, 1].item()
        assert share == pytest.approx(1.0, abs=1e-7)


def test_the_export_keeps_every_detection_where_sos_caps_at_100():
    assert composed("export", ("checkpoint=c.pth",)).detections_per_image is None
