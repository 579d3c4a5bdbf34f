"""MIL loss, OICR / MIST pseudo-labels and student losses against naive loop-based references."""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.ops import box_iou

from wsod.modeling.box_coder import decode_boxes, encode_boxes
from wsod.modeling.method import PseudoLabels
from wsod.modeling.mil import MILHead, mil_loss
from wsod.modeling.refinement import (
    MISTLabeler,
    MISTMethod,
    OICRLabeler,
    mist_pseudo_labels,
    oicr_pseudo_labels,
    refinement_losses,
)

# ----------------------------------------------------------------------------------------------------
# Naive references: plain Python floats and loops, written from docs/METHOD.md §3-4.


def naive_iou(a, b):
    # Same operation order as torchvision's box_iou, so that float64 results agree to the last bit.
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    w = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    h = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    inter = w * h
    return inter / (area_a + area_b - inter)


def naive_encode(target, proposal):
    pw, ph = proposal[2] - proposal[0], proposal[3] - proposal[1]
    px, py = proposal[0] + 0.5 * pw, proposal[1] + 0.5 * ph
    tw, th = target[2] - target[0], target[3] - target[1]
    tx, ty = target[0] + 0.5 * tw, target[1] + 0.5 * th
    return [10 * (tx - px) / pw, 10 * (ty - py) / ph, 5 * math.log(tw / pw), 5 * math.log(th / ph)]


def naive_pseudo_labels(proposals, scores, image_labels, p, tau, fg_iou, suppress):
    num_rois, num_classes = len(scores), len(scores[0])
    k = max(1, math.floor(p * num_rois))
    pseudo = []  # (box, class, score)
    for c in range(num_classes):
        if image_labels[c] <= 0:
            continue
        ranked = sorted(range(num_rois), key=lambda i, c=c: (-scores[i][c], i))[:k]
        kept = []
        for rank, i in enumerate(ranked):
            compare_with = ranked[:rank] if suppress == "candidates" else kept
            if all(naive_iou(proposals[i], proposals[j]) < tau for j in compare_with):
                kept.append(i)
        pseudo += [(proposals[i], c, scores[i][c]) for i in kept]
    return naive_assign(proposals, pseudo, fg_iou, strict=False)


def naive_oicr_pseudo_labels(proposals, scores, image_labels, fg_iou):
    """The reference code's OICR (its oicr_layer) as read: present classes in ascending order; each
    takes the first proposal of highest remaining score for it, with that score, and the taken
    proposal's scores are set to 0 for every class; ROIs are foreground at IoU strictly above fg_iou."""
    num_rois, num_classes = len(scores), len(scores[0])
    remaining = [list(row) for row in scores]
    pseudo = []
    for c in range(num_classes):
        if image_labels[c] <= 0:
            continue
        best = 0
        for i in range(1, num_rois):
            if remaining[i][c] > remaining[best][c]:  # strictly greater: the first maximum wins
                best = i
        pseudo.append((proposals[best], c, remaining[best][c]))
        remaining[best] = [0.0] * num_classes
    return naive_assign(proposals, pseudo, fg_iou, strict=True)


def naive_assign(proposals, pseudo, fg_iou, strict):
    """Each ROI takes the first pseudo box (box, class, score) of maximal IoU; foreground at IoU >=
    fg_iou (MIST) or > fg_iou (strict, OICR); weight = that box's score; targets for foreground only."""
    labels, weights, targets = [], [], []
    for roi in proposals:
        if not pseudo:
            labels.append(0), weights.append(0.0), targets.append([0.0] * 4)
            continue
        best, best_iou = 0, -1.0
        for g, (box, _, _) in enumerate(pseudo):
            iou = naive_iou(roi, box)
            if iou > best_iou:
                best, best_iou = g, iou
        box, c, score = pseudo[best]
        foreground = best_iou > fg_iou if strict else best_iou >= fg_iou
        labels.append(c + 1 if foreground else 0)
        weights.append(score)
        targets.append(naive_encode(box, roi) if foreground else [0.0] * 4)
    return labels, weights, targets


def random_image(seed, num_rois, num_classes, ties=False):
    g = torch.Generator().manual_seed(seed)
    # Integer corners on a small grid make exact duplicates, nested boxes and IoU ties likely.
    xy = torch.randint(0, 40, (num_rois, 2), generator=g).double()
    wh = torch.randint(4, 40, (num_rois, 2), generator=g).double()
    proposals = torch.cat([xy, xy + wh], dim=1)
    scores = torch.rand(num_rois, num_classes, generator=g, dtype=torch.double)
    if ties:
        scores = (scores * 4).round() / 4
    labels = (torch.rand(num_classes, generator=g) < 0.5).double()
    return proposals, scores, labels


CASES = [
    pytest.param(dict(seed=0, num_rois=40, num_classes=4), id="random"),
    pytest.param(dict(seed=1, num_rois=60, num_classes=3, ties=True), id="ties"),
    pytest.param(dict(seed=2, num_rois=1, num_classes=3), id="one-proposal"),
    pytest.param(dict(seed=3, num_rois=5, num_classes=3), id="0.15R<1"),
    pytest.param(dict(seed=4, num_rois=200, num_classes=5, ties=True), id="many"),
]


def _check_against_naive(got, proposals, scores, labels, naive=None, **options):
    exp_labels, exp_weights, exp_targets = (naive or naive_pseudo_labels)(
        proposals.tolist(), scores.tolist(), labels.tolist(), **options
    )
    assert got[0].dtype == torch.int64
    assert got[0].tolist() == exp_labels
    assert torch.allclose(got[1], torch.tensor(exp_weights, dtype=torch.double), rtol=0, atol=0)
    assert torch.allclose(got[2], torch.tensor(exp_targets, dtype=torch.double), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("suppress", ["candidates", "kept"])
def test_mist_matches_naive_reference(case, suppress):
    for offset in range(5):
        proposals, scores, labels = random_image(case["seed"] * 10 + offset, **_without_seed(case))
        labels[offset % labels.numel()] = 1.0  # at least one positive class
        got = mist_pseudo_labels(proposals, scores, labels, p=0.15, tau=0.2, suppress=suppress)
        _check_against_naive(got, proposals, scores, labels, p=0.15, tau=0.2, fg_iou=0.5, suppress=suppress)


@pytest.mark.parametrize("case", CASES)
def test_oicr_matches_naive_reference(case):
    for offset in range(5):
        proposals, scores, labels = random_image(case["seed"] * 10 + offset, **_without_seed(case))
        labels[offset % labels.numel()] = 1.0
        got = oicr_pseudo_labels(proposals, scores, labels)
        _check_against_naive(got, proposals, scores, labels, naive=naive_oicr_pseudo_labels, fg_iou=0.5)


def test_oicr_blanks_a_proposal_once_a_class_took_it():
    # Both classes score box a highest. Class 0 (first in ascending order) takes a; a is blanked, so
    # class 1 takes its best remaining proposal, b (score 0.6), not a (0.9) again.
    a, b, c = [0.0, 0.0, 10.0, 10.0], [30.0, 0.0, 40.0, 10.0], [0.0, 30.0, 10.0, 40.0]
    proposals = torch.tensor([c, a, b, [1.0, 0.0, 10.0, 10.0]], dtype=torch.double)
    scores = torch.tensor([[0.1, 0.3], [0.8, 0.9], [0.05, 0.6], [0.7, 0.2]], dtype=torch.double)
    labels, weights, targets = oicr_pseudo_labels(proposals, scores, torch.tensor([1.0, 1.0]))
    # c overlaps no pseudo box: background with a's weight (the first box of maximal IoU 0); a is class
    # 0's box; b is class 1's; the last ROI (IoU 0.9 with a) is class 0 foreground.
    assert labels.tolist() == [0, 1, 2, 1]
    assert weights.tolist() == [0.8, 0.8, 0.6, 0.8]
    assert targets[0].eq(0).all() and targets[1].eq(0).all() and targets[2].eq(0).all()
    assert targets[3].abs().sum() > 0
    _check_against_naive(
        (labels, weights, targets), proposals, scores, torch.tensor([1.0, 1.0]),
        naive=naive_oicr_pseudo_labels, fg_iou=0.5,
    )  # fmt: skip
    # Without blanking (two top-1 picks) class 1 would have taken a as well and b would be background.
    mist_top1 = mist_pseudo_labels(proposals, scores, torch.tensor([1.0, 1.0]), p=0.0)
    assert mist_top1[0].tolist() == [0, 1, 0, 1]


def test_iou_exactly_one_half_is_background_for_oicr_and_foreground_for_mist():
    # The ROI is the top half of the top box: IoU = 50 / 100 = 0.5 exactly (torchvision's box_iou).
    proposals = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 5.0]] + [[50.0, 50.0, 60.0, 60.0]] * 5)
    scores = torch.tensor([[0.9], [0.1]] + [[0.0]] * 5)
    labels = torch.tensor([1.0])
    assert box_iou(proposals[:1], proposals[1:2]).item() == 0.5
    assert oicr_pseudo_labels(proposals, scores, labels)[0][:2].tolist() == [1, 0]
    assert mist_pseudo_labels(proposals, scores, labels)[0][:2].tolist() == [1, 1]
    # The labellers pass their threshold with their own semantics.
    assert OICRLabeler(fg_iou=0.5)(proposals, scores, labels)[0][1] == 0
    assert OICRLabeler(fg_iou=0.49)(proposals, scores, labels)[0][1] == 1
    assert MISTLabeler(fg_iou=0.5)(proposals, scores, labels)[0][1] == 1


def _without_seed(case):
    return {k: v for k, v in case.items() if k != "seed"}


def test_the_two_suppression_rules_differ_where_the_paper_says():
    # Ranked a > b > c; IoU(a, b) >= 0.2, IoU(b, c) >= 0.2, IoU(a, c) = 0. b is suppressed by a; the
    # reference code then also drops c (it overlaps the higher-ranked b), Algorithm 1 keeps c.
    proposals = torch.tensor(
        [[0, 0, 10, 10], [6, 0, 16, 10], [12, 0, 22, 10]] + [[100, 100, 101, 101]] * 17, dtype=torch.double
    )
    scores = torch.tensor([[0.9], [0.8], [0.7]] + [[0.0]] * 17, dtype=torch.double)
    labels = torch.tensor([1.0], dtype=torch.double)
    ref = mist_pseudo_labels(proposals, scores, labels, suppress="candidates")
    paper = mist_pseudo_labels(proposals, scores, labels, suppress="kept")
    assert ref[0][:3].tolist() == [1, 0, 0]  # only a is a pseudo box
    assert paper[0][:3].tolist() == [1, 0, 1]  # a and c


def test_no_positive_class_gives_background_with_zero_weight():
    proposals, scores, labels = random_image(7, 30, 4)
    labels.zero_()
    for got in (mist_pseudo_labels(proposals, scores, labels), oicr_pseudo_labels(proposals, scores, labels)):
        assert got[0].eq(0).all() and got[1].eq(0).all() and got[2].eq(0).all()


def test_pseudo_labels_have_no_gradient():
    proposals, scores, labels = random_image(8, 20, 3)
    labels[1] = 1
    scores.requires_grad_(True)
    labels_out, weights, targets = mist_pseudo_labels(proposals, scores, labels)
    assert not weights.requires_grad and not targets.requires_grad


def test_box_encode_decode_round_trip():
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(50, 2, generator=g, dtype=torch.double) * 100
    proposals = torch.cat([xy, xy + torch.rand(50, 2, generator=g, dtype=torch.double) * 80 + 2], dim=1)
    targets = proposals + torch.randn(50, 4, generator=g, dtype=torch.double) * 3
    targets[:, 2:] = torch.maximum(targets[:, 2:], targets[:, :2] + 1)
    deltas = encode_boxes(targets, proposals)
    for d, t, pr in zip(deltas.tolist(), targets.tolist(), proposals.tolist(), strict=True):
        assert d == pytest.approx(naive_encode(t, pr), rel=1e-12, abs=1e-12)
    decoded = decode_boxes(deltas, proposals)
    assert decoded.shape == (50, 1, 4)
    assert torch.allclose(decoded[:, 0], targets, atol=1e-9)
    # Class-specific deltas (R, 4 K) decode to (R, K, 4), class by class.
    both = decode_boxes(torch.cat([deltas, torch.zeros_like(deltas)], dim=1), proposals)
    assert torch.allclose(both[:, 0], targets, atol=1e-9) and torch.allclose(both[:, 1], proposals)


# ----------------------------------------------------------------------------------------------------
# Losses.


def naive_mil_loss(cls_logits, det_logits, counts, image_labels):
    total, start = 0.0, 0
    for n, labels in zip(counts, image_labels, strict=True):
        rows_cls = cls_logits[start : start + n]
        rows_det = det_logits[start : start + n]
        start += n
        num_columns = len(rows_cls[0])
        loss = 0.0
        for c in range(num_columns):
            det_norm = sum(math.exp(r[c]) for r in rows_det)
            phi = 0.0
            for rc, rd in zip(rows_cls, rows_det, strict=True):
                cls_prob = math.exp(rc[c]) / sum(math.exp(v) for v in rc)
                phi += cls_prob * math.exp(rd[c]) / det_norm
            phi = min(max(phi, 1e-10), 1 - 1e-10)
            y = 0.0 if c == 0 else labels[c - 1]
            loss += -(y * math.log(phi) + (1 - y) * math.log(1 - phi))
        total += loss / num_columns
    return total / len(counts)


def test_mil_loss_matches_naive_reference():
    torch.manual_seed(0)
    head = MILHead(8, 3).double()
    torch.nn.init.normal_(head.cls_score.weight, std=0.5)
    torch.nn.init.normal_(head.det_score.weight, std=0.5)
    features = torch.randn(11, 8, dtype=torch.double)
    counts = [7, 1, 3]
    image_labels = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0]], dtype=torch.double)
    loss = mil_loss(head(features, counts), counts, image_labels)
    expected = naive_mil_loss(
        head.cls_score(features).tolist(), head.det_score(features).tolist(), counts, image_labels.tolist()
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def naive_refinement_losses(logits, deltas, labels, weights, targets, counts):
    cls_total = box_total = 0.0
    start = 0
    for n in counts:
        cls_sum = box_sum = 0.0
        for r in range(start, start + n):
            row = logits[r]
            log_norm = math.log(sum(math.exp(v) for v in row))
            cls_sum += weights[r] * (log_norm - row[labels[r]])
            if labels[r] > 0:
                for j in range(4):
                    diff = abs(deltas[r][4 * labels[r] + j] - targets[r][j])
                    box_sum += weights[r] * (0.5 * diff * diff if diff < 1 else diff - 0.5)
        cls_total += cls_sum / n
        box_total += box_sum / n
        start += n
    return cls_total / len(counts), box_total / len(counts)


def test_refinement_losses_match_naive_reference():
    g = torch.Generator().manual_seed(0)
    counts = [6, 1, 9]
    num_rois, num_classes = sum(counts), 3
    logits = torch.randn(num_rois, num_classes + 1, generator=g, dtype=torch.double)
    deltas = torch.randn(num_rois, 4 * (num_classes + 1), generator=g, dtype=torch.double) * 2
    labels = torch.randint(0, num_classes + 1, (num_rois,), generator=g)
    weights = torch.rand(num_rois, generator=g, dtype=torch.double)
    targets = torch.randn(num_rois, 4, generator=g, dtype=torch.double) * 2
    normalizer = torch.cat([torch.full((n,), 1.0 / (n * len(counts)), dtype=torch.double) for n in counts])
    cls_loss, box_loss = refinement_losses(logits, deltas, labels, weights, targets, normalizer)
    exp_cls, exp_box = naive_refinement_losses(
        logits.tolist(), deltas.tolist(), labels.tolist(), weights.tolist(), targets.tolist(), counts
    )
    assert cls_loss.item() == pytest.approx(exp_cls, rel=1e-12)
    assert box_loss.item() == pytest.approx(exp_box, rel=1e-12)
    assert box_loss.item() > 0


# ----------------------------------------------------------------------------------------------------
# The detector's losses end to end.


def naive_softmax_rows(rows):
    out = []
    for row in rows:
        norm = sum(math.exp(v) for v in row)
        out.append([math.exp(v) / norm for v in row])
    return out


def naive_detector_losses(model, roi_features, proposals, image_labels, first_weight):
    """Every loss of ``WeaklySupervisedDetector.losses`` from the naive references: MIL on the teacher;
    student 1 on the teacher's ROI scores, student k on softmax(student k-1); x ``first_weight`` on
    student 1; each loss a mean over an image's ROIs, then over images."""
    counts = [len(p) for p in proposals]
    features = roi_features
    cls_logits = model.mil_head.cls_score(features).tolist()
    det_logits = model.mil_head.det_score(features).tolist()
    losses = {"loss_mil": naive_mil_loss(cls_logits, det_logits, counts, image_labels.tolist())}
    source = model.mil_head(features, counts).tolist()  # teacher ROI scores (checked by the MIL test)
    for k, student in enumerate(model.students, start=1):
        logits, deltas = (t.tolist() for t in student(features))
        labels, weights, targets = [], [], []
        start = 0
        for boxes, image_label in zip(proposals, image_labels, strict=True):
            rows = source[start : start + len(boxes)]
            start += len(boxes)
            got = naive_pseudo_labels(
                boxes.tolist(), [r[1:] for r in rows], image_label.tolist(),
                p=0.15, tau=0.2, fg_iou=0.5, suppress="candidates",
            )  # fmt: skip
            labels += got[0]
            weights += got[1]
            targets += got[2]
        cls_loss, box_loss = naive_refinement_losses(logits, deltas, labels, weights, targets, counts)
        factor = first_weight if k == 1 else 1.0
        losses[f"loss_ref_cls_{k}"] = factor * cls_loss
        losses[f"loss_ref_box_{k}"] = factor * box_loss
        source = naive_softmax_rows(logits)
    return losses


def test_detector_losses_equal_the_naive_references_end_to_end():
    from wsod.modeling import build_detector

    torch.manual_seed(0)
    model = build_detector("resnet18", num_classes=4, chunk_size=None, width=0.25).double()
    with torch.no_grad():  # sharper heads than the N(0, 0.001) init, so that ranks and IoUs matter
        for name, p in model.named_parameters():
            if name.startswith(("mil_head", "students")) and name.endswith("weight"):
                p.normal_(std=0.3)
    images = [random_image(seed, n, 4) for seed, n in ((10, 30), (11, 9), (12, 17))]
    proposals = [p for p, _, _ in images]
    image_labels = torch.stack([labels for _, _, labels in images])
    image_labels[1] = 0  # an image without any positive class: MIL loss only
    features = torch.randn(sum(len(p) for p in proposals), 128, dtype=torch.double)
    losses = model.losses(features, proposals, image_labels)
    expected = naive_detector_losses(model, features, proposals, image_labels, first_weight=3.0)
    assert losses.keys() == expected.keys()
    for name, value in expected.items():
        assert losses[name].item() == pytest.approx(value, rel=1e-10, abs=1e-12), name
    assert all(value > 0 for value in expected.values())  # nothing compared is trivially zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_binary_cross_entropy_equals_torchs_and_lets_nan_through(dtype):
    from wsod.modeling.mil import binary_cross_entropy

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(50, 21, generator=g, dtype=dtype).clamp(1e-10, 1 - 1e-10)
    scores[0, :3] = torch.tensor([1e-10, 1 - 1e-10, 0.5], dtype=dtype)  # 1 - 1e-10 is 1.0 in float32
    targets = (torch.rand(50, 21, generator=g) < 0.3).to(dtype)
    # Two implementations of log and log1p meet here: torch's loss calls libm's per element, ours the
    # vectorised kernels (SLEEF's on AVX2 / AVX-512 CPUs, within 1 ulp, libm's on others). On this
    # machine's AVX-512 they differ by an ulp on 62 of these 1050 float32 values; whether the means
    # then agree to the last bit depends on how the summation's rounding absorbs them, i.e. on the
    # CPU and libm. Every term is >= 0, so the means agree to a few ulps relative: 16 eps leaves room
    # for that and the summation's reassociation, and still fails at any difference in the formula.
    torch.testing.assert_close(
        binary_cross_entropy(scores, targets),
        torch.nn.functional.binary_cross_entropy(scores, targets),
        rtol=16 * torch.finfo(dtype).eps,
        atol=0,
    )
    # Where every log is exact (0, or -inf clamped to -100) the two agree to the last bit on any CPU.
    clamped = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=dtype)
    for target in (torch.ones_like(clamped), torch.zeros_like(clamped)):
        assert torch.equal(
            binary_cross_entropy(clamped, target), torch.nn.functional.binary_cross_entropy(clamped, target)
        )
        assert binary_cross_entropy(clamped, target).item() == 50.0  # two of the four terms are -(-100)
    # A diverged forward: torch's raises, ours returns NaN for the training loop's non-finite guard.
    scores[3, 4] = float("nan")
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        torch.nn.functional.binary_cross_entropy(scores, targets)
    assert binary_cross_entropy(scores, targets).isnan()
    head_scores = torch.full((4, 3), float("nan"), dtype=dtype)
    assert mil_loss(head_scores, [4], torch.ones(1, 2, dtype=dtype)).isnan()


def test_loss_scales_are_the_mean_pseudo_label_weight_each_loss_averages():
    # Naive: per image the sum of its ROIs' weights (all ROIs for cls, foreground for box) over its R_i,
    # then the mean over images; what refinement_losses would give with every CE and smooth L1 at 1.
    torch.manual_seed(0)
    records = []
    for num_rois in (5, 8):
        labels = torch.randint(0, 3, (num_rois,))
        records.append(PseudoLabels(labels, torch.rand(num_rois), torch.zeros(num_rois, 4)))
    scales = MISTMethod().loss_scales(2, records)
    cls = box = 0.0
    for r in records:
        rois = len(r.labels)
        cls += sum(float(r.weights[i]) for i in range(rois)) / rois / len(records)
        box += sum(float(r.weights[i]) for i in range(rois) if r.labels[i] > 0) / rois / len(records)
    assert set(scales) == {"loss_ref_cls_2", "loss_ref_box_2"}
    assert scales["loss_ref_cls_2"].item() == pytest.approx(cls, rel=1e-6)
    assert scales["loss_ref_box_2"].item() == pytest.approx(box, rel=1e-6)
