"""wsod/modeling/partial_labels.py: the training rules of points, scribbles and boxes, each against a case
worked by hand, the vectorised filter against a loop over ROIs, the point filter against the reference's
own formula (wetectron ``loss.py`` ``filter_pseudo_labels``), the sampler's counts, and the detector's
refusal of partial labels for a method that would ignore them."""

from __future__ import annotations

import pytest
import torch

from wsod.modeling.partial_labels import (
    PartialLabels,
    filter_pseudo_labels,
    partial_guidance,
    partial_pseudo_labels,
    points_in_rois,
    positive_rois,
    sample_training_rois,
    scribble_boxes,
    scribble_coverage,
)
from wsod.modeling.refinement import MISTLabeler, MISTMethod, OICRLabeler, OICRMethod


def _partial(points=(), point_classes=(), scribbles=(), scribble_classes=(), boxes=(), box_classes=()):
    """PartialLabels from plain lists: scribbles as boxes directly."""
    return PartialLabels(
        points=torch.tensor(points, dtype=torch.float32).reshape(-1, 2),
        point_classes=torch.tensor(point_classes, dtype=torch.int64),
        scribble_boxes=torch.tensor(scribbles, dtype=torch.float32).reshape(-1, 4),
        scribble_classes=torch.tensor(scribble_classes, dtype=torch.int64),
        boxes=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        box_classes=torch.tensor(box_classes, dtype=torch.int64),
    )


def test_a_point_is_in_an_roi_only_strictly_inside_it():
    rois = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    points = torch.tensor([[5.0, 5.0], [0.0, 5.0], [10.0, 5.0], [5.0, 10.0], [11.0, 5.0], [0.1, 9.9]])
    assert points_in_rois(rois, points).tolist() == [[True, False, False, False, False, True]]


def test_scribble_coverage_is_the_share_of_the_scribble_box_in_inclusive_pixels():
    # Scribble box 0..9 x 0..9: 10 x 10 = 100 inclusive pixels.
    box = torch.tensor([[0.0, 0.0, 9.0, 9.0]])
    rois = torch.tensor(
        [
            [0.0, 0.0, 4.0, 9.0],  # columns 0..4: 50 pixels -> 0.5, covered (>= 0.5)
            [0.0, 0.0, 3.0, 9.0],  # 40 -> 0.4
            [-5.0, -5.0, 20.0, 20.0],  # all of it -> 1.0, however large the ROI
            [20.0, 20.0, 30.0, 30.0],  # apart -> 0
        ]
    )
    assert scribble_coverage(rois, box).squeeze(1).tolist() == pytest.approx([0.5, 0.4, 1.0, 0.0])
    # A one-point scribble is a 1-pixel box: covered by any ROI around it.
    dot = torch.tensor([[5.0, 5.0, 5.0, 5.0]])
    assert scribble_coverage(torch.tensor([[4.0, 4.0, 6.0, 6.0]]), dot).item() == 1.0


def test_scribble_boxes_span_each_strokes_points_with_its_class():
    points = torch.tensor([[3.0, 4.0], [7.0, 1.0], [5.0, 9.0], [20.0, 20.0], [22.0, 18.0]])
    classes = torch.tensor([2, 2, 2, 0, 0])
    ids = torch.tensor([1, 1, 1, 0, 0])
    boxes, stroke_classes = scribble_boxes(points, classes, ids)
    assert boxes.tolist() == [[20.0, 18.0, 22.0, 20.0], [3.0, 1.0, 7.0, 9.0]]  # ascending stroke id
    assert stroke_classes.tolist() == [0, 2]


def test_from_targets_reads_the_fields_and_none_without_partial_labels():
    labels = torch.tensor([1.0, 0.0, 1.0])
    like = torch.zeros(1, 4)
    assert PartialLabels.from_targets({"labels": labels}, like) is None
    empty = {"labels": labels, "points": torch.zeros(0, 2), "point_labels": torch.zeros(0, dtype=torch.int64)}
    assert PartialLabels.from_targets(empty, like) is None
    targets = {
        "labels": labels,
        "points": torch.tensor([[1.0, 2.0]]),
        "point_labels": torch.tensor([2]),
        "scribble_points": torch.tensor([[0.0, 0.0], [4.0, 3.0]]),
        "scribble_labels": torch.tensor([0, 0]),
        "scribble_ids": torch.tensor([0, 0]),
    }
    partial = PartialLabels.from_targets(targets, like)
    assert partial.scribble_boxes.tolist() == [[0.0, 0.0, 4.0, 3.0]] and partial.boxes.shape == (0, 4)
    assert partial.guided_classes().tolist() == [0, 2] and partial.has_points_or_scribbles


def test_the_filter_keeps_a_label_only_where_its_class_has_a_point_or_scribble_in_the_roi():
    # Three classes. Class 0 has a point at (5, 5); class 2 a scribble box (40, 40, 49, 49); class 1 has
    # only its image label: its pseudo-labels follow the image-label rules (kept as they are).
    partial = _partial(points=[[5, 5]], point_classes=[0], scribbles=[[40, 40, 49, 49]], scribble_classes=[2])
    rois = torch.tensor(
        [
            [0.0, 0.0, 10.0, 10.0],  # holds class 0's point, labelled class 0 -> kept
            [20.0, 20.0, 30.0, 30.0],  # labelled class 0, no point of class 0 -> background
            [20.0, 20.0, 30.0, 30.0],  # labelled class 1 (no partial label) -> kept
            [38.0, 38.0, 50.0, 50.0],  # covers class 2's scribble, labelled class 0 -> background
            [38.0, 38.0, 50.0, 50.0],  # covers class 2's scribble, labelled class 2 -> kept
            [40.0, 40.0, 43.0, 49.0],  # 4 of 10 columns: 0.4 of the scribble, labelled class 2 -> background
            [0.0, 0.0, 10.0, 10.0],  # background stays background
        ]
    )
    labels = torch.tensor([1, 1, 2, 1, 3, 3, 0])
    filtered = filter_pseudo_labels(labels, rois, partial, num_classes=3)
    assert filtered.tolist() == [1, 0, 2, 0, 3, 0, 0]
    exempt = torch.tensor([False, True, False, False, False, True, False])
    assert filter_pseudo_labels(labels, rois, partial, 3, exempt).tolist() == [1, 1, 2, 0, 3, 3, 0]


def _loop_filter(labels, rois, partial, num_classes):
    """One ROI at a time, the rule as the docstring states it."""
    guided = set(partial.point_classes.tolist()) | set(partial.scribble_classes.tolist())
    out = []
    for label, (x1, y1, x2, y2) in zip(labels.tolist(), rois.tolist(), strict=True):
        c = label - 1
        if label == 0 or c not in guided:
            out.append(label)
            continue
        ok = any(
            pc == c and x1 < px < x2 and y1 < py < y2
            for (px, py), pc in zip(partial.points.tolist(), partial.point_classes.tolist(), strict=True)
        )
        for (sx1, sy1, sx2, sy2), sc in zip(
            partial.scribble_boxes.tolist(), partial.scribble_classes.tolist(), strict=True
        ):
            w = max(0.0, min(x2, sx2) - max(x1, sx1) + 1)
            h = max(0.0, min(y2, sy2) - max(y1, sy1) + 1)
            ok |= sc == c and w * h / ((sx2 - sx1 + 1) * (sy2 - sy1 + 1)) >= 0.5
        out.append(label if ok else 0)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_vectorised_filter_equals_a_loop_over_rois(seed):
    g = torch.Generator().manual_seed(seed)
    num_classes, num_rois = 4, 60
    xy = torch.randint(0, 60, (num_rois, 2), generator=g).float()
    rois = torch.cat([xy, xy + torch.randint(2, 40, (num_rois, 2), generator=g)], dim=1)
    sxy = torch.randint(0, 70, (3, 2), generator=g).float()
    partial = _partial(
        points=torch.randint(0, 90, (5, 2), generator=g).tolist(),
        point_classes=torch.randint(0, 2, (5,), generator=g).tolist(),  # classes 0, 1 have points
        scribbles=torch.cat([sxy, sxy + torch.randint(0, 25, (3, 2), generator=g)], 1).tolist(),
        scribble_classes=[2, 2, 0],  # class 2 scribbles; class 3 only an image label
    )
    labels = torch.randint(0, num_classes + 1, (num_rois,), generator=g)
    assert filter_pseudo_labels(labels, rois, partial, num_classes).tolist() == _loop_filter(
        labels, rois, partial, num_classes
    )


def _reference_point_filter(pseudo_labels, rois, clicks, click_labels):
    """wetectron loss.py filter_pseudo_labels, the point branch, as it computes it (labels 1-based)."""
    pseudo_labels = pseudo_labels.clone()
    clicks_tiled = torch.unsqueeze(torch.cat((clicks, clicks), dim=1), dim=1)
    box_repeat = torch.cat([rois.unsqueeze(0) for _ in range(clicks.shape[0])], dim=0)
    diff = clicks_tiled - box_repeat
    matched = (diff[:, :, 0] > 0) * (diff[:, :, 1] > 0) * (diff[:, :, 2] < 0) * (diff[:, :, 3] < 0)
    matched_cls = matched.float() * click_labels.view(-1, 1)
    repeat = torch.cat([pseudo_labels.unsqueeze(0) for _ in range(matched.shape[0])])
    correct = (matched_cls == repeat.float()).sum(0)
    pseudo_labels[correct == 0] = 0
    return pseudo_labels


@pytest.mark.parametrize("seed", range(3))
def test_with_points_on_every_class_the_filter_is_the_references(seed):
    # The reference runs points on every object of every image: every labelled class has points.
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, 50, (80, 2), generator=g).float()
    rois = torch.cat([xy, xy + torch.randint(2, 50, (80, 2), generator=g)], dim=1)
    clicks = torch.randint(0, 90, (6, 2), generator=g).float()
    click_classes = torch.tensor([0, 1, 2, 0, 1, 2])
    labels = torch.randint(0, 4, (80,), generator=g)
    ours = filter_pseudo_labels(labels, rois, _partial(clicks.tolist(), click_classes.tolist()), 3)
    assert torch.equal(ours, _reference_point_filter(labels, rois, clicks, (click_classes + 1).float()))


def _scores(num_rois, num_classes, seed=0):
    return torch.rand(num_rois, num_classes, generator=torch.Generator().manual_seed(seed))


def test_a_class_boxed_in_full_takes_its_boxes_as_pseudo_boxes_score_one_for_every_student():
    proposals = torch.tensor(
        [
            [0.0, 0.0, 10.0, 10.0],  # the supervising box of class 1 itself
            [0.0, 0.0, 10.0, 5.0],  # IoU 0.5 with it: foreground for MIST (>=), not OICR (>)
            [50.0, 50.0, 60.0, 60.0],
            [52.0, 50.0, 62.0, 60.0],
        ]
    )
    scores = torch.tensor([[0.1, 0.0], [0.1, 0.0], [0.9, 0.9], [0.2, 0.8]])  # class 1 would pick ROI 2
    image_labels = torch.tensor([1.0, 1.0])
    partial = _partial(boxes=[[0, 0, 10, 10]], box_classes=[1])
    for student in (1, 2, 3):
        record = MISTMethod(p=0.5).pseudo_labels(
            student,
            proposals,
            scores,
            {"labels": image_labels, "boxes": partial.boxes, "box_labels": partial.box_classes},
        )
        # Class 1's only pseudo box is the supervising one (score 1); class 0 keeps its MIST pick.
        assert record.pseudo_classes.tolist() == [1, 0]
        assert record.pseudo_boxes[0].tolist() == [0.0, 0.0, 10.0, 10.0] and record.pseudo_scores[0] == 1.0
        assert record.labels.tolist() == [2, 2, 1, 1]
        assert record.weights[:2].tolist() == [1.0, 1.0]
    oicr = partial_pseudo_labels(OICRLabeler(), proposals, scores, image_labels, partial)
    assert oicr.labels[:2].tolist() == [2, 0]  # OICR's foreground rule is strict (IoU > 0.5)


def test_with_boxes_and_points_of_one_class_the_picks_obey_the_filter_and_the_boxes_do_not():
    proposals = torch.tensor(
        [
            [0.0, 0.0, 10.0, 10.0],  # on the boxed object of class 0 (no point in it)
            [30.0, 30.0, 40.0, 40.0],  # holds class 0's point
            [70.0, 70.0, 80.0, 80.0],  # no point
        ]
    )
    scores = torch.tensor([[0.1], [0.5], [0.9]])
    targets = {
        "labels": torch.tensor([1.0]),
        "boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0]]),
        "box_labels": torch.tensor([0]),
        "points": torch.tensor([[35.0, 35.0]]),
        "point_labels": torch.tensor([0]),
    }
    record = MISTMethod(p=1.0, tau=0.1).pseudo_labels(1, proposals, scores, targets)
    # Picks of class 0 (the proposals by score with NMS: 2, 1, 0) plus the box; ROI 0 takes the box
    # (listed first at equal IoU) and is exempt, ROI 1 its pick with the point, ROI 2 its pick without.
    assert record.pseudo_boxes[0].tolist() == [0.0, 0.0, 10.0, 10.0]
    assert record.labels.tolist() == [1, 1, 0]
    assert record.weights.tolist() == pytest.approx([1.0, 0.5, 0.9])


def test_an_roi_as_close_to_a_supervising_box_as_to_another_classs_pick_takes_the_box():
    proposals = torch.tensor([[0.0, 0.0, 10.0, 10.0], [40.0, 40.0, 50.0, 50.0]])
    scores = torch.tensor([[0.9, 0.0], [0.1, 0.0]])  # class 0 picks ROI 0, which is class 1's box
    targets = {
        "labels": torch.tensor([1.0, 1.0]),
        "boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0]]),
        "box_labels": torch.tensor([1]),
    }
    record = OICRMethod().pseudo_labels(1, proposals, scores, targets)
    assert record.labels.tolist() == [2, 0]


def test_the_guidance_and_positives_of_a_mixed_image():
    partial = _partial(
        points=[[5, 5]], point_classes=[0], scribbles=[[40, 40, 49, 49]], scribble_classes=[1],
        boxes=[[100, 100, 120, 120]], box_classes=[2],
    )  # fmt: skip
    rois = torch.tensor(
        [
            [0.0, 0.0, 10.0, 10.0],
            [38.0, 38.0, 50.0, 50.0],
            [100.0, 100.0, 120.0, 130.0],
            [60.0, 0.0, 70.0, 9.0],
        ]
    )
    assert partial_guidance(rois, partial, 3).tolist() == [
        [True, False, False],
        [False, True, False],
        [False, False, False],
        [False, False, False],
    ]
    # The box: IoU 400 / 600 = 0.67 >= 0.5, positive for the sampler.
    assert positive_rois(rois, partial).tolist() == [True, True, True, False]


def _targets_with_points(points):
    return {
        "labels": torch.tensor([1.0]),
        "points": torch.tensor(points),
        "point_labels": torch.tensor([0] * len(points)),
    }


def test_the_sampler_keeps_at_most_its_share_of_positives_and_fills_up_with_negatives():
    # 10 ROIs, the first 6 around the point (positive), 4 elsewhere.
    rois = torch.tensor([[0.0, 0.0, 10.0 + i, 10.0] for i in range(6)] + [[50.0, 50.0, 60.0, 60.0]] * 4)
    targets = _targets_with_points([[5.0, 5.0]])
    torch.manual_seed(0)
    kept = sample_training_rois(rois, targets, rois_per_image=4, positive_fraction=0.25)
    assert kept.tolist() == sorted(kept.tolist()) and len(kept) == 4
    assert int((kept < 6).sum()) == 1 and int((kept >= 6).sum()) == 3
    # Few negatives: the positives are still capped, the image keeps fewer ROIs.
    kept = sample_training_rois(rois, targets, rois_per_image=8, positive_fraction=0.25)
    assert int((kept < 6).sum()) == 2 and int((kept >= 6).sum()) == 4
    # The draw comes from torch's global generator: the same seed, the same ROIs.
    torch.manual_seed(5)
    first = sample_training_rois(rois, targets, 4, 0.5)
    torch.manual_seed(5)
    assert torch.equal(first, sample_training_rois(rois, targets, 4, 0.5))


def test_the_sampler_leaves_images_without_points_or_scribbles_and_unbinding_caps_alone():
    rois = torch.tensor([[0.0, 0.0, 10.0, 10.0], [50.0, 50.0, 60.0, 60.0]])
    assert sample_training_rois(rois, {"labels": torch.tensor([1.0])}) is None
    boxes_only = {"labels": torch.tensor([1.0]), "boxes": rois[:1], "box_labels": torch.tensor([0])}
    assert sample_training_rois(rois, boxes_only, rois_per_image=1) is None  # the box kind samples nothing
    assert sample_training_rois(rois, _targets_with_points([[5.0, 5.0]]), 1024, 0.25) is None


def test_a_labeller_that_does_not_name_its_pseudo_boxes_cannot_take_partial_labels():
    from wsod.modeling.refinement import LabelerMethod

    def plain(proposals, scores, image_labels):  # a PseudoLabeler without pseudo_boxes / assign
        return MISTLabeler()(proposals, scores, image_labels)

    with pytest.raises(ValueError, match="pseudo_boxes and assign"):
        LabelerMethod(plain).pseudo_labels(
            1, torch.tensor([[0.0, 0.0, 5.0, 5.0]]), _scores(1, 1), _targets_with_points([[2.0, 2.0]])
        )


def test_the_detector_refuses_partial_labels_for_a_method_that_ignores_them():
    from wsod.modeling import build_detector
    from wsod.modeling.pcl import PCLMethod

    torch.manual_seed(0)
    model = build_detector("resnet18", num_classes=1, width=0.25, method=PCLMethod(), num_students=1)
    images = torch.randn(1, 3, 64, 64)
    proposals = [torch.tensor([[0.0, 0.0, 30.0, 30.0], [10.0, 10.0, 50.0, 50.0]])]
    with pytest.raises(ValueError, match="PCLMethod does not read"):
        model(images, proposals, targets=[_targets_with_points([[5.0, 5.0]])])
    model(images, proposals, targets=[{"labels": torch.tensor([1.0]), "points": torch.zeros(0, 2)}])
