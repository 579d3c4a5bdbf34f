"""End to end through the seams: a points field placed on a dataset record reaches the refinement
method's pseudo-labelling call for that image, resized and flipped, with no edit to the detector (the
method is a subclass defined here, the detector the one every config builds)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from wsod.data.dataset import ImageRecord, WeakDetectionDataset
from wsod.data.loader import collate, model_inputs
from wsod.data.proposals import ProposalSet
from wsod.data.transforms import train_transform
from wsod.modeling.detector import build_detector
from wsod.modeling.refinement import MISTMethod

CLASSES = ("cat", "dog", "bird")


class RecordingMist(MISTMethod):
    """MIST, recording the targets dict of every (student, image) call it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict]] = []

    def pseudo_labels(self, student, proposals, scores, targets):
        self.calls.append((student, {k: v.clone() for k, v in targets.items()}))
        return super().pseudo_labels(student, proposals, scores, targets)


def _dataset(tmp_path):
    """Two images, 60 x 100 and 80 x 40; only the first carries points."""
    records = []
    for name, (height, width), supervision in (
        ("a", (60, 100), {"points": [[10, 20], [30, 5]], "point_labels": [1, 0]}),
        ("b", (80, 40), None),
    ):
        path = tmp_path / f"{name}.png"
        Image.fromarray(np.full((height, width, 3), 90, np.uint8)).save(path)
        labels = np.array([0, 1, 0] if name == "a" else [1, 0, 0], np.float32)
        records.append(ImageRecord(name, str(path), height, width, labels, supervision=supervision))
    proposals = ProposalSet(
        ["a", "b"], [np.array([[0, 0, 50, 40], [10, 5, 30, 25]]), np.array([[0, 0, 20, 60]])]
    )
    # One scale (shorter side 90) and the flip forced: image a is 60 x 100 -> 90 x 150, flipped.
    transform = train_transform(scales=(90,), max_size=1000, flip_prob=1.0, lighting_std=0.0)
    return WeakDetectionDataset(records, CLASSES, proposals, transform=transform)


def test_points_on_a_record_reach_the_methods_call_for_their_image_resized_and_flipped(tmp_path):
    torch.manual_seed(0)
    method = RecordingMist()
    model = build_detector("resnet18", num_classes=len(CLASSES), width=0.25, chunk_size=8, method=method)
    dataset = _dataset(tmp_path)
    inputs = model_inputs(collate([dataset[0], dataset[1]]), torch.device("cpu"))
    model.train()
    losses = model(**inputs).losses
    assert set(losses) == set(model.loss_names)

    # Three students x two images, in batch order: each image's own dict, every time.
    assert [student for student, _ in method.calls] == [1, 1, 2, 2, 3, 3]
    for _, first in method.calls[0::2]:
        # (10, 20) -> x1.5 -> (15, 30) -> flipped in width 150 -> (135, 30); (30, 5) -> (105, 7.5).
        torch.testing.assert_close(
            first["points"], torch.tensor([[135.0, 30.0], [105.0, 7.5]]), rtol=0, atol=0
        )
        assert first["point_labels"].tolist() == [1, 0] and first["labels"].tolist() == [0.0, 1.0, 0.0]
    for _, second in method.calls[1::2]:
        # No supervision but its labels, and each ROI's index in its image's proposal list (the collate's).
        assert set(second) == {"labels", "proposal_ids"} and second["labels"].tolist() == [1.0, 0.0, 0.0]
        assert second["proposal_ids"].tolist() == [0]
