"""PCL's pseudo-labels against a naive loop reference, its loss against autograd of the formula (float64),
and WSDDN's detector without students."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from wsod.modeling.detector import build_detector
from wsod.modeling.method import PseudoLabels
from wsod.modeling.pcl import (
    PCLMethod,
    WSDDNMethod,
    graph_centres,
    pcl_loss,
    pcl_pseudo_labels,
    top_score_group,
)

# ---------------------------------------------------------------------------------------------------
# Naive references: plain Python loops over lists, written from the rules in wsod/modeling/pcl.py's
# module docstring (which follow ppengtang/pcl.pytorch branch 0.4.0).


def naive_iou(a, b):
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def naive_sse(values):
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values)


def naive_top_group(scores, num_groups=3):
    """Every split of the sorted distinct values into num_groups runs; the least total squared distance,
    ties to the earliest start of the top run. Fewer distinct values than groups: the highest ones."""
    distinct = sorted(set(scores))
    if len(distinct) < num_groups:
        return [i for i, s in enumerate(scores) if s == max(scores)]
    best = None
    for cuts in itertools.combinations(range(1, len(distinct)), num_groups - 1):
        edges = [0, *cuts, len(distinct)]
        groups = [set(distinct[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
        cost = sum(naive_sse([s for s in scores if s in g]) for g in groups)
        top_start = cuts[-1]
        if best is None or cost < best[0] - 1e-12 or (abs(cost - best[0]) <= 1e-12 and top_start < best[1]):
            best = (cost, top_start, groups[-1])
    return [i for i, s in enumerate(scores) if s in best[2]]


def naive_graph_centres(boxes, scores, graph_iou=0.4, max_remaining=5):
    n = len(boxes)
    alive = [True] * n
    adjacent = [[i == j or naive_iou(boxes[i], boxes[j]) > graph_iou for j in range(n)] for i in range(n)]
    remaining, centres, centre_scores = n, [], []
    while True:
        best = None
        for i in range(n):
            if not alive[i]:
                continue
            degree = sum(1 for j in range(n) if alive[j] and adjacent[i][j])
            key = (degree, scores[i], -i)  # most neighbours, then highest score, then lowest index
            if best is None or key > best[0]:
                best = (key, i)
        centre = best[1]
        members = [j for j in range(n) if alive[j] and adjacent[centre][j]]
        centres.append(centre)
        centre_scores.append(max(scores[j] for j in members))
        for j in members:
            alive[j] = False
        remaining -= len(members)
        if remaining <= max_remaining:
            return centres, centre_scores


def naive_pcl(proposals, scores, image_labels, fg_iou=0.5, bg_iou=0.1, max_centres=5, clip=1e-9):
    """(labels, weights, cluster, centre boxes, classes, scores) as lists."""
    proposals = proposals.tolist()
    scores = [[min(max(s, clip), 1 - clip) for s in row] for row in scores.tolist()]
    pool = list(range(len(proposals)))
    centres = []  # (proposal index, class, score)
    for c, present in enumerate(image_labels.tolist()):
        if not present or not pool:
            continue
        top = [pool[i] for i in naive_top_group([scores[r][c] for r in pool])]
        chosen, chosen_scores = naive_graph_centres([proposals[r] for r in top], [scores[r][c] for r in top])
        ranked = sorted(range(len(chosen)), key=lambda k: -chosen_scores[k])[:max_centres]  # stable
        for k in ranked:
            centres.append((top[chosen[k]], c, chosen_scores[k]))
        for k in ranked:
            pool.remove(top[chosen[k]])
    labels, weights, cluster = [], [], []
    for box in proposals:
        if not centres:
            labels.append(0), weights.append(0.0), cluster.append(-1)
            continue
        overlaps = [naive_iou(box, proposals[r]) for r, _, _ in centres]
        n = max(range(len(centres)), key=lambda k: (overlaps[k], -k))
        member = overlaps[n] >= fg_iou
        labels.append(centres[n][1] + 1 if member else 0)
        cluster.append(n if member else -1)
        weights.append(0.0 if overlaps[n] < bg_iou else centres[n][2])
    return labels, weights, cluster, centres


def naive_pcl_loss(logits, records):
    """-(1/R_i) [sum_n s_n M_n log(mean p) + sum_bg w log p_bg], averaged over images, by loops."""
    total = 0.0
    start = 0
    for record in records:
        count = len(record)
        probs = torch.softmax(logits[start : start + count], dim=1)
        image = 0.0
        for r in range(count):
            if int(record.labels[r]) == 0:
                image = image + record.weights[r] * torch.log(probs[r, 0])
        for n in range(len(record.pseudo_scores)):
            members = [r for r in range(count) if int(record.extra["cluster"][r]) == n]
            if members:
                mean = sum(probs[r, int(record.labels[r])] for r in members) / len(members)
                image = image + record.pseudo_scores[n] * len(members) * torch.log(mean)
        total = total - image / count
        start += count
    return total / len(records)


def random_boxes(count, generator, *, grid=None):
    """count (4,) xyxy boxes in a 100 x 100 image; on an integer grid (many equal IoUs) when asked."""
    xy = torch.rand(count, 2, generator=generator) * 70
    wh = torch.rand(count, 2, generator=generator) * 40 + 5
    boxes = torch.cat([xy, xy + wh], dim=1)
    return boxes.round() if grid else boxes


# ---------------------------------------------------------------------------------------------------
# Top group: exact 1-D k-means


@pytest.mark.parametrize("seed", range(20))
def test_top_group_matches_every_split_of_the_sorted_scores(seed):
    generator = torch.Generator().manual_seed(seed)
    count = int(torch.randint(3, 40, (1,), generator=generator))
    scores = torch.rand(count, generator=generator, dtype=torch.float64)
    if seed % 2:  # repeated values: groups never split equal scores
        scores = (scores * 6).round() / 6
    got = top_score_group(scores).tolist()
    assert got == naive_top_group(scores.tolist())


def full_matrix_top_group(scores):
    """The same optimum by the O(P^2) dynamic programme (every pair of splits, numpy float64)."""
    values = np.sort(np.asarray(scores, dtype=np.float64), kind="stable")
    order = np.argsort(np.asarray(scores, dtype=np.float64), kind="stable")
    starts = [b for b in range(1, len(values)) if values[b - 1] < values[b]]
    bounds = np.array([0, *starts, len(values)])
    first = np.concatenate([[0.0], np.cumsum(values - values.mean())])
    second = np.concatenate([[0.0], np.cumsum((values - values.mean()) ** 2)])

    def sse(a, b):
        n = np.maximum(b - a, 1)
        s1, s2 = first[b] - first[a], second[b] - second[a]
        return np.where(b > a, np.maximum(s2 - s1 * s1 / n, 0), np.inf)

    two = (sse(np.zeros_like(bounds), bounds)[:, None] + sse(bounds[:, None], bounds[None, :])).min(axis=0)
    last = two + sse(bounds, np.full_like(bounds, len(values)))
    return sorted(order[bounds[int(np.argmin(last))] :].tolist())


@pytest.mark.parametrize("seed", range(8))
def test_top_group_by_divide_and_conquer_equals_the_full_quadratic_programme_on_large_pools(seed):
    generator = torch.Generator().manual_seed(50 + seed)
    count = [300, 2000][seed % 2]
    scores = torch.softmax(torch.randn(count, generator=generator, dtype=torch.float64) * (1 + seed), 0)
    if seed % 4 >= 2:
        scores = (scores * 200).round() / 200  # many equal scores
    assert top_score_group(scores).tolist() == full_matrix_top_group(scores.tolist())


def test_top_group_is_the_optimum_over_every_assignment_not_only_contiguous_ones():
    # 3^n assignments of n = 8 scores: the exact optimum's top group, found by brute force.
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        scores = torch.rand(8, generator=generator, dtype=torch.float64).tolist()
        best = None
        for assignment in itertools.product(range(3), repeat=8):
            groups = [[s for s, a in zip(scores, assignment, strict=True) if a == g] for g in range(3)]
            if any(not g for g in groups):
                continue
            cost = sum(naive_sse(g) for g in groups)
            if best is None or cost < best[0]:
                top = max(groups, key=lambda g: sum(g) / len(g))
                best = (cost, sorted(scores.index(s) for s in top))
        assert top_score_group(torch.tensor(scores)).tolist() == best[1]


def test_top_group_ties_between_optimal_splits_go_to_the_earliest_top_start():
    # [0, 1, 2, 3]: {0}{1}{2,3}, {0,1}{2}{3} and {0}{1,2}{3} all cost 0.5; the rule keeps {2, 3}.
    assert top_score_group(torch.tensor([3.0, 0.0, 2.0, 1.0])).tolist() == [0, 2]


@pytest.mark.parametrize(
    ("scores", "expected"),
    [([0.5], [0]), ([0.2, 0.2, 0.2], [0, 1, 2]), ([0.1, 0.7, 0.1, 0.7], [1, 3]), ([0.3, 0.9], [1])],
)
def test_a_pool_of_fewer_distinct_scores_than_groups_keeps_its_highest(scores, expected):
    assert top_score_group(torch.tensor(scores)).tolist() == expected


def test_an_empty_pool_has_an_empty_top_group():
    assert top_score_group(torch.zeros(0)).tolist() == []


def test_top_group_is_exact_in_float64_for_scores_near_the_clip():
    # float32 sums of squares would cancel here: the scores differ only in their 8th digit.
    scores = torch.tensor([1e-9, 1e-9, 2e-9, 0.5, 0.5 + 1e-8, 0.9], dtype=torch.float32)
    assert top_score_group(scores).tolist() == naive_top_group(scores.double().tolist())


# ---------------------------------------------------------------------------------------------------
# Graph centres


@pytest.mark.parametrize("seed", range(20))
def test_graph_centres_match_the_naive_greedy_loop_with_its_tie_rule(seed):
    generator = torch.Generator().manual_seed(100 + seed)
    count = int(torch.randint(1, 30, (1,), generator=generator))
    boxes = random_boxes(count, generator, grid=True).double()
    scores = (torch.rand(count, generator=generator, dtype=torch.float64) * 4).round() / 4  # score ties too
    centres, centre_scores = graph_centres(boxes, scores)
    expected, expected_scores = naive_graph_centres(boxes.tolist(), scores.tolist())
    assert centres.tolist() == expected
    assert centre_scores.tolist() == expected_scores


def test_degree_ties_go_to_the_highest_score_then_the_lowest_index():
    # Two disjoint pairs (degree 2 each) and a lone box: the pair holding the 0.9 wins, then index order.
    boxes = torch.tensor(
        [[0, 0, 10, 10], [1, 0, 11, 10], [50, 50, 60, 60], [51, 50, 61, 60], [80, 0, 90, 10]],
        dtype=torch.float64,
    )
    scores = torch.tensor([0.3, 0.3, 0.9, 0.2, 0.5], dtype=torch.float64)
    centres, centre_scores = graph_centres(boxes, scores, max_remaining=0)
    assert centres.tolist() == [2, 0, 4]  # pair {2,3} (0.9), pair {0,1} (equal scores: index 0), lone 4
    assert centre_scores.tolist() == [0.9, 0.3, 0.5]


def test_the_greedy_loop_runs_once_for_five_or_fewer_proposals():
    boxes = torch.tensor([[0, 0, 10, 10], [50, 50, 60, 60], [80, 0, 90, 10]], dtype=torch.float64)
    centres, _ = graph_centres(boxes, torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
    assert centres.tolist() == [2]  # all of degree 1: the highest score; the loop stops (3 <= 5 left)


# ---------------------------------------------------------------------------------------------------
# Whole pseudo-labels


def _check_against_naive(proposals, scores, labels):
    record = pcl_pseudo_labels(proposals, scores, labels)
    n_labels, n_weights, n_cluster, n_centres = naive_pcl(proposals, scores, labels)
    assert record.labels.tolist() == n_labels
    assert record.extra["cluster"].tolist() == n_cluster
    torch.testing.assert_close(record.weights, torch.tensor(n_weights, dtype=record.weights.dtype))
    assert record.pseudo_classes.tolist() == [c for _, c, _ in n_centres]
    torch.testing.assert_close(record.pseudo_boxes, proposals[[r for r, _, _ in n_centres]])
    torch.testing.assert_close(
        record.pseudo_scores, torch.tensor([s for _, _, s in n_centres], dtype=scores.dtype)
    )
    assert record.targets.abs().sum() == 0  # no box regression
    return record


@pytest.mark.parametrize("seed", range(25))
def test_pcl_pseudo_labels_match_the_naive_reference(seed):
    generator = torch.Generator().manual_seed(1000 + seed)
    count = int(torch.randint(2, 60, (1,), generator=generator))
    num_classes = 4
    proposals = random_boxes(count, generator, grid=seed % 2 == 0).double()
    scores = torch.rand(count, num_classes, generator=generator, dtype=torch.float64) ** 3
    if seed % 3 == 0:
        scores = (scores * 5).round() / 5  # ties of scores, and zeros clipped to 1e-9
    labels = (torch.rand(num_classes, generator=generator) < 0.6).double()
    _check_against_naive(proposals, scores, labels)


def test_an_image_without_a_positive_class_has_no_cluster_and_no_loss():
    generator = torch.Generator().manual_seed(7)
    proposals = random_boxes(12, generator)
    record = pcl_pseudo_labels(proposals, torch.rand(12, 3, generator=generator), torch.zeros(3))
    assert record.labels.tolist() == [0] * 12 and record.weights.abs().sum() == 0
    assert len(record.pseudo_boxes) == 0 and record.extra["cluster"].tolist() == [-1] * 12
    logits = torch.randn(12, 4, requires_grad=True)
    loss = pcl_loss(logits, [record])
    loss.backward()
    assert loss.item() == 0 and logits.grad.abs().sum() == 0


def test_a_class_whose_pool_is_empty_gets_no_cluster():
    # Two proposals far apart, three classes: class 0 keeps the better one (one centre), class 1 the
    # other, class 2 finds the pool empty (the reference crashes on it).
    proposals = torch.tensor([[0, 0, 10, 10], [50, 50, 60, 60]], dtype=torch.float64)
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.5]], dtype=torch.float64)
    record = _check_against_naive(proposals, scores, torch.ones(3))
    assert record.pseudo_classes.tolist() == [0, 1]
    assert record.labels.tolist() == [1, 2]


def test_only_the_kept_centres_leave_the_pool():
    # Class 0's centre is proposal 0; its neighbour 1 stays in the pool and becomes class 1's centre.
    proposals = torch.tensor([[0, 0, 10, 10], [0, 0, 10, 11], [60, 60, 70, 70]], dtype=torch.float64)
    scores = torch.tensor([[0.9, 0.5], [0.8, 0.9], [0.1, 0.1]], dtype=torch.float64)
    record = _check_against_naive(proposals, scores, torch.ones(2))
    assert record.pseudo_boxes.tolist() == [proposals[0].tolist(), proposals[1].tolist()]


def test_pseudo_labels_run_on_the_scores_device_and_dtype():
    generator = torch.Generator().manual_seed(5)
    proposals = random_boxes(30, generator)
    record = pcl_pseudo_labels(proposals, torch.rand(30, 3, generator=generator), torch.ones(3))
    assert record.weights.dtype == torch.float32 and record.labels.dtype == torch.int64
    assert record.pseudo_boxes.device == proposals.device


# ---------------------------------------------------------------------------------------------------
# Loss


def _random_records(generator, counts, num_classes=3):
    records, all_proposals = [], []
    for count in counts:
        proposals = random_boxes(count, generator).double()
        scores = torch.rand(count, num_classes, generator=generator, dtype=torch.float64)
        labels = (torch.rand(num_classes, generator=generator) < 0.7).double()
        records.append(pcl_pseudo_labels(proposals, scores, labels))
        all_proposals.append(proposals)
    return records, all_proposals


@pytest.mark.parametrize("seed", range(6))
def test_pcl_loss_and_its_gradient_equal_autograd_of_the_formula_in_float64(seed):
    generator = torch.Generator().manual_seed(2000 + seed)
    records, _ = _random_records(generator, [17, 31, 9])
    logits = torch.randn(57, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    loss = pcl_loss(logits, records)
    (grad,) = torch.autograd.grad(loss, logits)
    expected = naive_pcl_loss(logits, records)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    assert torch.autograd.gradcheck(lambda x: pcl_loss(x, records), (logits.detach().requires_grad_(),))


def test_pcl_loss_stays_finite_where_the_reference_clamps():
    # Probabilities far below the reference's 1e-6 clamp: the log-space loss is exact and finite.
    generator = torch.Generator().manual_seed(9)
    records, _ = _random_records(generator, [20])
    logits = torch.zeros(20, 4, dtype=torch.float64)
    logits[:, 0] = -60.0  # background probability ~ e^-60
    logits[:, 1:] = -80.0
    logits.requires_grad_()
    loss = pcl_loss(logits, records)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logits.grad).all()
    torch.testing.assert_close(loss, naive_pcl_loss(logits.detach(), records))


def test_pcl_loss_is_scaled_by_a_loss_weight_unlike_the_reference_backward():
    generator = torch.Generator().manual_seed(11)
    records, proposals = _random_records(generator, [15])
    logits = torch.randn(15, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    method = PCLMethod(first_student_loss_weight=3.0)
    (grad_3,) = torch.autograd.grad(method.losses(1, logits, None, records, proposals)["loss_pcl_1"], logits)
    (grad_1,) = torch.autograd.grad(method.losses(2, logits, None, records, proposals)["loss_pcl_2"], logits)
    torch.testing.assert_close(grad_3, 3 * grad_1)


# ---------------------------------------------------------------------------------------------------
# Methods in the detector


TINY = dict(backbone="resnet18", width=0.25, weights=None, chunk_size=None)


def _batch(generator, num_classes=3):
    images = torch.rand(2, 3, 64, 64, generator=generator)
    proposals = [random_boxes(20, generator) * 0.6 for _ in range(2)]
    targets = [{"labels": torch.tensor([1.0, 0.0, 1.0])}, {"labels": torch.tensor([0.0, 1.0, 0.0])}]
    return images, proposals, targets


def test_pcl_detector_trains_students_without_box_regression_and_detects_proposal_boxes():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build_detector(num_classes=3, method=PCLMethod(), **TINY)
    assert model.loss_names == ("loss_mil", "loss_pcl_1", "loss_pcl_2", "loss_pcl_3")
    assert all(student.bbox_pred is None for student in model.students)
    assert not any("bbox_pred" in name for name in model.state_dict())
    images, proposals, targets = _batch(generator)
    losses = model(images, proposals, targets=targets).losses
    assert list(losses) == list(model.loss_names)
    sum(losses.values()).backward()
    assert all(p.grad is not None for s in model.students for p in s.parameters())
    model.eval()
    (scores, boxes), _ = model.predict_rois(
        model.roi_features(images, proposals), proposals, [(64, 64)] * 2, [(64, 64)] * 2
    )
    torch.testing.assert_close(boxes, proposals[0][:, None, :].expand(-1, 4, 4))
    torch.testing.assert_close(scores.sum(dim=1), torch.ones(20))  # the students' mean softmax


def test_pcl_records_name_the_cluster_centres_for_previews():
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = build_detector(num_classes=3, method=PCLMethod(), num_students=2, **TINY).eval()
    images, proposals, targets = _batch(generator)
    records = model.pseudo_labels(images, proposals, targets)
    assert len(records) == 2 and all(len(per_student) == 2 for per_student in records)
    first = records[0][0]
    assert isinstance(first, PseudoLabels) and set(first.pseudo_classes.tolist()) <= {0, 2}
    assert len(first.pseudo_boxes) >= 2  # one centre at least per positive class


def test_wsddn_detector_is_the_teacher_alone_and_detects_with_its_scores():
    generator = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    model = build_detector(num_classes=3, method=WSDDNMethod(), num_students=0, **TINY)
    assert model.loss_names == ("loss_mil",) and len(model.students) == 0
    images, proposals, targets = _batch(generator)
    losses = model(images, proposals, targets=targets).losses
    assert list(losses) == ["loss_mil"]
    model.eval()
    features = model.roi_features(images, proposals)
    (scores, boxes), _ = model.predict_rois(features, proposals, [(64, 64)] * 2, [(64, 64)] * 2)
    torch.testing.assert_close(scores, model.mil_head(features, [20, 20])[:20])
    torch.testing.assert_close(boxes, proposals[0][:, None, :].expand(-1, 4, 4))
    assert model.pseudo_labels(images, proposals, targets) == []
    detections = model(images, proposals)
    assert set(detections[0]) == {"boxes", "scores", "labels"}


def test_a_method_refuses_students_it_cannot_train():
    with pytest.raises(ValueError, match="WSDDNMethod trains no refinement students.*num_students=0"):
        build_detector(num_classes=3, method=WSDDNMethod(), num_students=3, **TINY)
    with pytest.raises(ValueError, match="PCLMethod trains refinement students.*num_students >= 1"):
        build_detector(num_classes=3, method=PCLMethod(), num_students=0, **TINY)


def test_pcl_method_refuses_bad_settings():
    with pytest.raises(ValueError, match="bg_iou <= fg_iou"):
        PCLMethod(bg_iou=0.6, fg_iou=0.5)
    with pytest.raises(ValueError, match="kmeans_groups must be at least 2"):
        PCLMethod(kmeans_groups=1)
    assert PCLMethod() == PCLMethod() and PCLMethod() != PCLMethod(graph_iou=0.5)
    assert np.isclose(PCLMethod().fg_iou, 0.5)
