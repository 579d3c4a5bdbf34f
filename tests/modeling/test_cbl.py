"""CBL's rules against naive loop references (written from the reference's description, one ROI and one
seed at a time in Python floats), its distillation loss and gradient against autograd of the formula in
float64, its schedule against hand numbers, and its detector and teacher wiring."""

from __future__ import annotations

import math

import pytest
import torch

from wsod.modeling.cbl import (
    CBLMethod,
    assign_seeds,
    multi_seeds,
    ranking_distillation,
    top1_seeds,
)
from wsod.modeling.detector import build_detector
from wsod.modeling.inclusive_boxes import inclusive_nms
from wsod.modeling.method import MethodBatch, RoiScores, TrainingProgress

EPS = 1e-9


def _iou(a, b) -> float:
    """IoU of two xyxy boxes (Python floats; width x2 - x1, as torchvision)."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def _inclusive_iou(a, b) -> float:
    """IoU of two inclusive xyxy boxes (Python floats; width x2 - x1 + 1, as the reference's cython)."""
    return _iou([a[0], a[1], a[2] + 1, a[3] + 1], [b[0], b[1], b[2] + 1, b[3] + 1])


def _random_image(seed: int, rois: int, classes: int = 4, *, grid: bool = False):
    g = torch.Generator().manual_seed(seed)
    if grid:  # boxes on a coarse grid: exact duplicates and equal IoUs (ties) are common
        xy = torch.randint(0, 6, (rois, 2), generator=g).double() * 10
        wh = torch.randint(1, 5, (rois, 2), generator=g).double() * 10
    else:
        xy = torch.rand(rois, 2, generator=g, dtype=torch.float64) * 80
        wh = torch.rand(rois, 2, generator=g, dtype=torch.float64) * 40 + 2
    boxes = torch.cat([xy, xy + wh], dim=1)
    scores = torch.softmax(torch.randn(rois, classes, generator=g, dtype=torch.float64) * 3, dim=1)
    if grid:  # equal scores too
        scores = (scores * 4).round() / 4
    labels = torch.zeros(classes)
    labels[torch.randperm(classes, generator=g)[: 1 + seed % classes]] = 1
    return boxes, scores, labels


def naive_top1(boxes, scores, labels):
    """OICR's top-1 with clipped scores and the taken row blanked."""
    rows = [[min(max(float(v), EPS), 1 - EPS) for v in row] for row in scores.tolist()]
    seeds = []
    for c, present in enumerate(labels.tolist()):
        if not present:
            continue
        column = [row[c] for row in rows]
        best = max(range(len(column)), key=lambda i: (column[i], -i))  # the first maximum
        seeds.append((boxes[best].tolist(), c, column[best]))
        rows[best] = [0.0] * len(rows[best])
    return seeds


def naive_assign(boxes, seeds, fg, bg):
    labels, weights = [], []
    for roi in boxes.tolist():
        ious = [_iou(roi, s[0]) for s in seeds]
        if not ious:
            labels.append(0)
            weights.append(0.0)
            continue
        best = max(range(len(ious)), key=lambda j: (ious[j], -j))
        labels.append(seeds[best][1] + 1 if ious[best] >= fg else 0)
        weights.append(seeds[best][2] if ious[best] >= bg else 0.0)
    return labels, weights


def naive_multi_seeds(boxes, branches, labels, *, top_fraction, ratio, nms_iou, vote_iou, gamma, offset):
    rois = boxes.tolist()
    cap = max(1, int(len(rois) * top_fraction))
    seeds = []
    for c, present in enumerate(labels.tolist()):
        if not present:
            continue
        chosen = []
        for branch in branches:
            column = branch[:, c].tolist()
            high = sum(1 for v in column if v > max(column) * ratio)
            order = sorted(range(len(column)), key=lambda i: (-column[i], i))[: min(cap, high)]
            chosen.append(order)
        kept = []
        for i in chosen[0]:  # greedy NMS in rank order, dropped at IoU >= nms_iou (cython_nms.pyx:84)
            if all(_inclusive_iou(rois[i], rois[j]) < nms_iou for j in kept):
                kept.append(i)
        for i in reversed(kept):  # the reference's output order: increasing score (cython_nms.pyx:87)
            n = 1 + sum(
                any(_inclusive_iou(rois[i], rois[j]) > vote_iou for j in other) for other in chosen[1:]
            )
            score = branches[0][i, c].item() * (offset + (n / len(branches)) ** gamma)
            seeds.append((rois[i], c, score))
    return seeds


def _as_list(seeds):
    boxes, classes, scores = seeds
    return [(b, c, s) for b, c, s in zip(boxes.tolist(), classes.tolist(), scores.tolist(), strict=True)]


def _assert_seeds_equal(got, expected):
    assert len(got) == len(expected)
    for (b1, c1, s1), (b2, c2, s2) in zip(got, expected, strict=True):
        assert b1 == pytest.approx(b2) and c1 == c2 and s1 == pytest.approx(s2, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_top1_seeds_and_their_assignment_match_a_naive_loop(seed):
    boxes, scores, labels = _random_image(seed, rois=30, grid=seed % 2 == 1)
    seeds = top1_seeds(boxes, scores, labels, score_clip=EPS)
    expected = naive_top1(boxes, scores, labels)
    _assert_seeds_equal(_as_list(seeds), expected)
    got_labels, got_weights, targets, _ = assign_seeds(boxes, seeds, fg_iou=0.5, bg_iou=0.1)
    want_labels, want_weights = naive_assign(boxes, expected, 0.5, 0.1)
    assert got_labels.tolist() == want_labels
    assert got_weights.tolist() == pytest.approx(want_weights, rel=1e-12)
    assert (targets[got_labels == 0] == 0).all()


@pytest.mark.parametrize("seed", range(12))
def test_multi_seeds_match_a_naive_loop(seed):
    boxes, _, labels = _random_image(seed, rois=60 if seed < 8 else 15, grid=seed % 2 == 1)
    g = torch.Generator().manual_seed(100 + seed)
    branches = [
        torch.softmax(torch.randn(len(boxes), 4, generator=g, dtype=torch.float64), 1) for _ in range(3)
    ]
    if seed % 2:
        branches = [(b * 8).round() / 8 + EPS for b in branches]  # ties
    settings = dict(top_fraction=0.05, nms_iou=0.4, vote_iou=0.5, vote_gamma=0.4, vote_offset=1.0)
    got = multi_seeds(boxes, branches, labels, score_ratio=0.7, **settings)
    expected = naive_multi_seeds(
        boxes,
        branches,
        labels,
        top_fraction=0.05,
        ratio=0.7,
        nms_iou=0.4,
        vote_iou=0.5,
        gamma=0.4,
        offset=1.0,
    )
    _assert_seeds_equal(_as_list(got), expected)


def test_the_seed_nms_drops_a_box_at_iou_equal_to_its_threshold_as_the_reference():
    """CBL-WSOD's cython NMS drops at IoU >= 0.4 in inclusive pixels (cython_nms.pyx:44,80-84), where
    torchvision's nms keeps IoU = 0.4: a 100 x 100 box and its left 40 columns are one seed, not two."""
    boxes = torch.tensor([[0.0, 0.0, 99.0, 99.0], [0.0, 0.0, 39.0, 99.0], [200.0, 0.0, 239.0, 99.0]])
    assert _inclusive_iou(boxes[0].tolist(), boxes[1].tolist()) == pytest.approx(0.4, abs=1e-12)
    for dtype in (torch.float32, torch.float64):
        column = torch.tensor([[0.9], [0.8], [0.7]], dtype=dtype)
        seeds = multi_seeds(
            boxes.to(dtype), [column], torch.ones(1),
            top_fraction=1.0, score_ratio=0.0, nms_iou=0.4, vote_iou=0.5, vote_gamma=1.0, vote_offset=0.0,
        )  # fmt: skip
        assert seeds[0].tolist() == [[200.0, 0.0, 239.0, 99.0], [0.0, 0.0, 99.0, 99.0]]  # increasing score
        just_above = multi_seeds(
            boxes.to(dtype), [column], torch.ones(1),
            top_fraction=1.0, score_ratio=0.0, nms_iou=0.41, vote_iou=0.5, vote_gamma=1.0, vote_offset=0.0,
        )  # fmt: skip
        assert len(just_above[0]) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(6))
def test_inclusive_nms_matches_the_reference_loop_on_ties(seed, dtype):
    """Grid boxes, where IoU lands exactly on 0.25, 0.4 or 0.5 often, against the cython rule in Python."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, 6, (40, 2), generator=g) * 10
    wh = torch.randint(1, 6, (40, 2), generator=g) * 10
    boxes = torch.cat([xy, xy + wh - 1], dim=1).to(dtype)  # inclusive: a 10-pixel box spans x .. x + 9
    scores = torch.randperm(40, generator=g).to(dtype)
    for threshold in (0.25, 0.4, 0.5):
        kept = []
        for i in sorted(range(40), key=lambda i: -scores[i].item()):
            if all(_inclusive_iou(boxes[i].tolist(), boxes[j].tolist()) < threshold for j in kept):
                kept.append(i)
        assert inclusive_nms(boxes, scores, threshold).tolist() == kept


def test_multi_seeds_with_fewer_than_20_proposals_take_the_top_one_not_every_proposal():
    # int(0.05 x 19) = 0: the reference's argsort(...)[-0:] selects every proposal; wsod takes one.
    boxes = torch.tensor([[0.0, 0, 10, 10], [50, 50, 60, 60], [0, 50, 10, 60]], dtype=torch.float64)
    branch = torch.tensor([[0.9], [0.8], [0.7]], dtype=torch.float64)
    seeds = multi_seeds(
        boxes, [branch, branch], torch.ones(1), top_fraction=0.05, score_ratio=0.7, nms_iou=0.4,
        vote_iou=0.5, vote_gamma=0.4, vote_offset=1.0,
    )  # fmt: skip
    assert seeds[0].tolist() == [[0.0, 0, 10, 10]]
    assert seeds[2].item() == pytest.approx(0.9 * 2)  # both branches agree: 1 + (2/2)^0.4


def test_multi_seed_votes_and_scores_by_hand():
    boxes = torch.tensor(
        [[0.0, 0, 10, 10], [1, 0, 11, 10], [40, 40, 50, 50], [100, 100, 110, 110]], dtype=torch.float64
    )
    ensemble = torch.tensor([[0.9], [0.1], [0.8], [0.05]], dtype=torch.float64)
    first = torch.tensor([[0.1], [0.9], [0.05], [0.05]], dtype=torch.float64)  # picks box 1: IoU 0.82 with 0
    second = torch.tensor([[0.05], [0.05], [0.05], [0.9]], dtype=torch.float64)  # picks box 3: no vote
    boxes_ = torch.cat([boxes] * 10)  # 40 ROIs: top 2
    branches = [torch.cat([b] * 10) for b in (ensemble, first, second)]
    seeds = multi_seeds(
        boxes_, branches, torch.ones(1), top_fraction=0.05, score_ratio=0.7, nms_iou=0.4, vote_iou=0.5,
        vote_gamma=0.4, vote_offset=1.0,
    )  # fmt: skip
    # Branch 0: the two 0.9 copies of box 0 (one suppressed by NMS); 0.8 < 0.7 x 0.9 is false, but the
    # cap is int(40 x 0.05) = 2, both copies of box 0. Box 0's votes: itself and branch 1 = 2 of 3.
    assert seeds[0].tolist() == [[0.0, 0, 10, 10]]
    assert seeds[2].item() == pytest.approx(0.9 * (1 + (2 / 3) ** 0.4))


def test_a_tie_between_two_seeds_of_a_class_goes_to_the_lower_scoring_one_as_the_reference():
    # CBL-WSOD returns a class's seeds in increasing score order (np.argsort's last k, then cython_nms's
    # input order) and its _sample_rois takes the first maximal overlap: the ROI at IoU 1/3 with each of
    # two seeds takes the lower-scoring one, its weight 0.6.
    proposals = torch.tensor([[0.0, 0, 19, 9], [10, 0, 29, 9], [5, 0, 24, 9]])
    scores = torch.tensor([[0.8], [0.6], [0.01]])
    boxes, classes, seed_scores = multi_seeds(
        proposals, [scores], torch.tensor([1.0]), top_fraction=1.0, score_ratio=0.5, nms_iou=0.4,
        vote_iou=0.5, vote_gamma=1.0, vote_offset=0.0,
    )  # fmt: skip
    assert boxes.tolist() == [[10, 0, 29, 9], [0, 0, 19, 9]] and seed_scores.tolist() == pytest.approx(
        [0.6, 0.8]
    )
    labels, weights, _, _ = assign_seeds(
        torch.tensor([[5.0, 0, 24, 9]]), (boxes, classes, seed_scores), fg_iou=0.3, bg_iou=0.1
    )
    assert labels.tolist() == [1] and weights.tolist() == pytest.approx([0.6])


def test_top1_seeding_removes_the_picked_roi_from_later_classes():
    boxes = torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]])
    scores = torch.tensor([[0.9, 0.8], [0.1, 0.2]])
    seeds = top1_seeds(boxes, scores, torch.ones(2), score_clip=EPS)
    assert seeds[0].tolist() == [[0.0, 0, 10, 10], [20, 20, 30, 30]]  # class 1 takes its second best
    assert seeds[2].tolist() == pytest.approx([0.9, 0.2])


def naive_distillation(mil, teacher, boxes, labels, fg_iou):
    """The formula with autograd, one class and one ROI at a time (float64)."""
    seeds = naive_top1(boxes, teacher[:, 1:].detach(), labels)
    total = mil.new_zeros(())
    rois = boxes.tolist()
    for _, c, score in seeds:
        members = []
        for i, roi in enumerate(rois):
            ious = [_iou(roi, s[0]) for s in seeds]
            best = max(range(len(ious)), key=lambda j: (ious[j], -j))
            if seeds[best][1] == c and ious[best] >= fg_iou and teacher[i, c + 1] > 0:
                members.append(i)
        if not members:
            continue
        m = torch.stack([mil[i, c + 1] for i in members])
        t = torch.stack([teacher[i, c + 1] for i in members]).detach()
        log_p = m - torch.log(torch.exp(m).sum())
        q = torch.exp(t) / torch.exp(t).sum()
        total = total + score * (q * (torch.log(q) - log_p)).sum() / len(members)
    return total


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fg_iou", [0.5, 0.75, 1.0])
def test_ranking_distillation_and_its_gradient_match_autograd_of_the_formula(seed, fg_iou):
    boxes, _, labels = _random_image(seed, rois=25, grid=seed % 2 == 1)
    g = torch.Generator().manual_seed(7 + seed)
    teacher = torch.softmax(torch.randn(len(boxes), 5, generator=g, dtype=torch.float64) * 2, dim=1)
    mil = torch.rand(len(boxes), 5, generator=g, dtype=torch.float64).requires_grad_(True)
    got = ranking_distillation(mil, teacher, boxes, labels, fg_iou=fg_iou, score_clip=EPS)
    (got_grad,) = torch.autograd.grad(got, mil, allow_unused=True, materialize_grads=True)
    want = naive_distillation(mil, teacher, boxes, labels, fg_iou)
    want_grad = torch.autograd.grad(want, mil, allow_unused=True, materialize_grads=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)


def test_the_distillation_ignores_the_band_between_the_background_bound_and_the_rising_threshold():
    seed_box = [0.0, 0, 10, 10]
    boxes = torch.tensor([seed_box, [0, 0, 10, 7], [0, 0, 10, 5.5]], dtype=torch.float64)  # IoU 1, 0.7, 0.55
    teacher = torch.tensor([[0, 0.9], [0, 0.5], [0, 0.3]], dtype=torch.float64)
    mil = torch.tensor([[0, 0.2], [0, 0.7], [0, 0.1]], dtype=torch.float64, requires_grad=True)
    labels = torch.ones(1)
    at_half = ranking_distillation(mil, teacher, boxes, labels, fg_iou=0.5, score_clip=EPS)
    at_06 = ranking_distillation(mil, teacher, boxes, labels, fg_iou=0.6, score_clip=EPS)
    (grad,) = torch.autograd.grad(at_06, mil)
    assert grad[2].abs().sum() == 0 and grad[:2, 1].abs().sum() > 0  # IoU 0.55 < 0.6: no loss
    assert at_half.item() != pytest.approx(at_06.item())
    # At the threshold 1.0 only the seed is left: the softmax of one score is 1 and the KL is 0.
    assert ranking_distillation(mil, teacher, boxes, labels, fg_iou=1.0, score_clip=EPS).item() == 0.0


def test_the_schedule_by_hand():
    method = CBLMethod()  # the reference's: a window of 40000 steps in a run of 35000
    at = lambda i: TrainingProgress(i, 35000)  # noqa: E731
    assert method.mil_loss_weight(at(0)) == 1.0
    assert method.mil_loss_weight(at(20000)) == pytest.approx(0.5)
    assert method.mil_loss_weight(at(34999)) == pytest.approx(1 - 34999 / 40000)
    assert method.distill_iou(at(0)) == 0.5
    assert method.distill_iou(at(10000)) == pytest.approx(0.625)
    assert method.distill_iou(at(34999)) == pytest.approx(0.5 + 0.5 * 34999 / 40000)
    assert not method.multi_seed(at(13999)) and method.multi_seed(at(14000))
    short = CBLMethod(ramp_length=0.5)
    assert short.mil_loss_weight(TrainingProgress(60, 100)) == 0.0
    assert short.distill_iou(TrainingProgress(60, 100)) == 1.0
    with pytest.raises(ValueError, match="TrainingProgress"):
        method.mil_loss_weight(None)


def _toy_detector(**options):
    torch.manual_seed(0)
    return build_detector(
        "resnet18", num_classes=3, chunk_size=None, width=0.125, weights=None, norm="bn", neck_norm="gn",
        freeze_at=0, method=CBLMethod(**options),
    )  # fmt: skip


def _batch(num_images=2):
    g = torch.Generator().manual_seed(3)
    images = torch.randn(num_images, 3, 64, 64, generator=g)
    proposals = []
    for _ in range(num_images):
        xy = torch.rand(30, 2, generator=g) * 40
        proposals.append(torch.cat([xy, xy + 8 + torch.rand(30, 2, generator=g) * 16], dim=1))
    return images, proposals


def test_an_image_without_a_positive_class_trains_with_zero_losses_of_its_own():
    model = _toy_detector().train()
    images, proposals = _batch(1)
    teacher = model.roi_scores(images, proposals)
    output = model(
        images, proposals, targets=[{"labels": torch.zeros(3)}], teacher_scores=teacher,
        progress=TrainingProgress(90, 100),
    )  # fmt: skip
    losses = output.losses
    assert all(torch.isfinite(v) for v in losses.values())
    for name in ("loss_ref_cls_1", "loss_distill", "loss_rcnn_cls", "loss_rcnn_box"):
        assert losses[name].item() == 0.0, name


def test_cbl_needs_its_teacher_and_the_progress_and_says_so():
    model = _toy_detector().train()
    images, proposals = _batch(1)
    targets = [{"labels": torch.tensor([1.0, 0, 0])}]
    with pytest.raises(ValueError, match="solver.ema.enabled=true"):
        model(images, proposals, targets=targets, progress=TrainingProgress(0, 10))
    with pytest.raises(ValueError, match="progress=TrainingProgress"):
        model(images, proposals, targets=targets, teacher_scores=model.roi_scores(images, proposals))


def test_the_detector_predicts_with_the_students_and_the_rcnn_head_and_mixes_with_the_teacher():
    model = _toy_detector().eval()
    teacher = _toy_detector().eval()
    torch.nn.init.normal_(teacher.students[2].cls_score.weight, std=0.5)
    images, proposals = _batch(1)
    inputs = {
        "images": images,
        "proposals": proposals,
        "image_sizes": [(64, 64)],
        "original_sizes": [(64, 64)],
    }
    with torch.no_grad():
        (own,) = model.predict_view(inputs, [False])
        (theirs,) = teacher.predict_view(inputs, [False])
        features = model.roi_features(images, proposals)
        students = [torch.softmax(s(features)[0], dim=1) for s in model.students]
        logits, deltas = model.method_heads["rcnn"](features)
        expected = torch.stack([*students, torch.softmax(logits, dim=1)]).mean(dim=0)
        teacher_probs = torch.softmax(teacher.students[2](teacher.roi_features(images, proposals))[0], dim=1)
    torch.testing.assert_close(own["scores"], expected)
    mixed = model.mix_predictions(own, theirs)
    torch.testing.assert_close(mixed["scores"], (expected + teacher_probs) / 2)
    assert torch.equal(mixed["boxes"], own["boxes"])
    assert not torch.equal(own["boxes"][:, 1], proposals[0])  # the R-CNN head's boxes, decoded


def test_the_weighted_ema_update_is_exact_against_a_hand_computation():
    from wsod.engine.ema import EMATeacher

    model = _toy_detector().double()
    ema = EMATeacher(
        model, momentum=0.999, schedule="ramp", follow=["backbone", "neck"], sources=model.teacher_sources()
    )
    ema.update()  # alpha 0 at the first update: the teacher is the weighted mix
    for _ in range(4):
        ema.update()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    before = {k: v.clone() for k, v in ema.teacher.state_dict().items()}
    alpha = ema.update()
    assert alpha == 1 - 1 / 6  # five updates before this one
    student = model.state_dict()
    after = ema.teacher.state_dict()
    for p in ("weight", "bias"):
        mix = sum(student[f"students.{k}.cls_score.{p}"] for k in range(3)) / 6
        mix = mix + student[f"method_heads.rcnn.cls_score.{p}"] / 2
        expected = alpha * before[f"students.2.cls_score.{p}"] + (1 - alpha) * mix
        torch.testing.assert_close(after[f"students.2.cls_score.{p}"], expected, rtol=1e-13, atol=1e-15)
    name = next(k for k in student if k.startswith("base.") and student[k].is_floating_point())
    torch.testing.assert_close(
        after[name], alpha * before[name] + (1 - alpha) * student[name], rtol=1e-13, atol=1e-15
    )
    assert torch.equal(after["students.0.cls_score.weight"], student["students.0.cls_score.weight"])  # copied


def test_a_method_batch_view_of_the_teacher_reads_student_k():
    scores = RoiScores(torch.zeros(2, 3), (torch.ones(2, 3), torch.full((2, 3), 2.0)))
    assert torch.equal(CBLMethod.teacher_scores(scores), torch.full((2, 3), 2.0))
    assert MethodBatch([], [], 1, torch.zeros(0, 3), ()).progress is None
    assert math.isclose(CBLMethod().ramp_length, 8 / 7)


def test_a_detector_holds_exactly_its_methods_heads_and_progress_is_checked():
    from wsod.modeling.detector import WeaklySupervisedDetector
    from wsod.modeling.mil import MILHead
    from wsod.modeling.refinement import RefinementStudent

    parts = dict(base=torch.nn.Identity(), roi_head=torch.nn.Identity(), mil_head=MILHead(8, 3))
    students = [RefinementStudent(8, 3, box_regression=False)]
    with pytest.raises(ValueError, match=r"trains the heads \['rcnn'\], but the detector was given \[\]"):
        WeaklySupervisedDetector(**parts, students=students, method=CBLMethod())
    heads = CBLMethod().build_heads(8, 3)
    with pytest.raises(ValueError, match=r"trains the heads \[\]"):
        WeaklySupervisedDetector(**parts, students=[RefinementStudent(8, 3)], method_heads=heads)
    with pytest.raises(ValueError, match="TrainingProgress"):
        TrainingProgress(-1, 10)
    with pytest.raises(ValueError, match="TrainingProgress"):
        TrainingProgress(0, 0)
    assert TrainingProgress(3, 12).fraction == 0.25
