"""Golden result: losses and detections of a fixed-seed tiny detector, stored in tests/modeling/golden/.

A refactoring must not change what the detector computes. When a change is meant to (a new default that
the method calls for), rerun with ``WSOD_UPDATE_GOLDEN=1`` and say why in the commit: the failure message
prints the new values next to the stored ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from wsod.modeling import build_detector

GOLDEN = Path(__file__).parent / "golden" / "detector_r18.json"
UPDATE = os.environ.get("WSOD_UPDATE_GOLDEN") == "1"


def _inputs():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 64, 96, generator=g)
    proposals = []
    for count in (12, 7):
        xy = torch.rand(count, 2, generator=g) * torch.tensor([70.0, 40.0])
        wh = 8 + torch.rand(count, 2, generator=g) * 20
        proposals.append(torch.cat([xy, xy + wh], dim=1))
    labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    return images, proposals, labels


def _model():
    torch.manual_seed(0)
    model = build_detector("resnet18", num_classes=3, chunk_size=4, width=0.25)
    # Head weights of N(0, 0.001) give near-uniform scores; scale them up so ranks and NMS matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("mil_head", "students")) and name.endswith("weight"):
                p.mul_(30)
    return model


def _result() -> dict:
    model = _model()
    images, proposals, labels = _inputs()
    losses = model(images, proposals, labels).losses
    model.eval()
    with torch.no_grad():
        detections = model(images, proposals)
    return {
        "losses": {k: v.item() for k, v in sorted(losses.items())},
        "detections": [
            {k: v[:5].tolist() for k, v in d.items()}  # the five best of each image
            for d in detections
        ],
    }


def test_losses_and_detections_match_the_stored_golden_result():
    result = _result()
    if UPDATE:
        GOLDEN.write_text(json.dumps(result, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    new = json.dumps(result)
    assert result["losses"] == pytest.approx(golden["losses"], rel=1e-5), f"new values: {new}"
    assert len(result["detections"]) == len(golden["detections"])
    for ours, stored in zip(result["detections"], golden["detections"], strict=True):
        assert ours["labels"] == stored["labels"], f"new values: {new}"
        assert ours["scores"] == pytest.approx(stored["scores"], rel=1e-4), f"new values: {new}"
        for box, stored_box in zip(ours["boxes"], stored["boxes"], strict=True):
            assert box == pytest.approx(stored_box, rel=1e-4, abs=1e-3), f"new values: {new}"
    assert any(v > 0 for k, v in result["losses"].items() if k.startswith("loss_ref_box"))


def test_images_without_partial_labels_train_exactly_as_with_image_labels_alone():
    """Empty partial-label fields (an image without points, scribbles or boxes in a dataset that has
    them), and an image's partial labels, change nothing for the other images: the golden losses."""
    model = _model()
    images, proposals, labels = _inputs()
    empty = {
        "points": torch.zeros(0, 2),
        "point_labels": torch.zeros(0, dtype=torch.int64),
        "scribble_points": torch.zeros(0, 2),
        "scribble_labels": torch.zeros(0, dtype=torch.int64),
        "scribble_ids": torch.zeros(0, dtype=torch.int64),
        "boxes": torch.zeros(0, 4),
        "box_labels": torch.zeros(0, dtype=torch.int64),
    }
    losses = model(images, proposals, targets=[{"labels": row, **empty} for row in labels]).losses
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert {k: v.item() for k, v in sorted(losses.items())} == pytest.approx(golden, rel=1e-5)
    # Image 0 with a point: image 1's pseudo-labels are those it gets alone.
    with_point = [
        {"labels": labels[0], "points": proposals[0][:1, :2] + 1, "point_labels": torch.tensor([0])}
    ]
    records = model.pseudo_labels(images, proposals, [*with_point, {"labels": labels[1], **empty}])
    alone = model.pseudo_labels(images, proposals, [{"labels": row} for row in labels])
    for ours, plain in zip(records, alone, strict=True):
        assert torch.equal(ours[1].labels, plain[1].labels) and torch.equal(ours[1].weights, plain[1].weights)
