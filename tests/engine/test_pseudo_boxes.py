"""wsod/engine/pseudo_boxes.py: the pseudo ground-truth rule against hand-made cases and a naive loop
reference of SoS-WSOD's filter, and the pseudo boxes' precision / recall against a hand count."""

from __future__ import annotations

import math

import pytest
import torch

from wsod.engine.pseudo_boxes import PseudoBoxRule, containment, pseudo_box_quality, select_pseudo_boxes

SIZE = (100, 200)  # (H, W)


def _detections(rows: list[tuple[float, float, float, float, float, int]]) -> dict[str, torch.Tensor]:
    """(x1, y1, x2, y2, score, label) rows -> a detections dict."""
    t = torch.tensor([r[:5] for r in rows], dtype=torch.float32).reshape(-1, 5)
    return {
        "boxes": t[:, :4],
        "scores": t[:, 4],
        "labels": torch.tensor([r[5] for r in rows], dtype=torch.long),
    }


def _labels(*classes: int, num_classes: int = 4) -> torch.Tensor:
    labels = torch.zeros(num_classes)
    labels[list(classes)] = 1
    return labels


def _rows(selected: dict[str, torch.Tensor]) -> list[tuple]:
    return [
        (*[round(v, 4) for v in box], round(score, 4), label)
        for box, score, label in zip(
            selected["boxes"].tolist(), selected["scores"].tolist(), selected["labels"].tolist(), strict=True
        )
    ]


def test_only_the_image_labels_keep_boxes_and_each_keeps_its_top_one_whatever_its_score():
    dets = _detections([
        (10, 10, 50, 50, 0.9, 0),   # class 0: top
        (60, 10, 90, 50, 0.15, 0),  # class 0: below min_score, not the top -> dropped
        (100, 10, 150, 60, 0.95, 2),  # class 2 is not a label -> dropped
        (20, 20, 80, 80, 0.05, 1),  # class 1: its only box, kept although below min_score
    ])  # fmt: skip
    selected, whole = select_pseudo_boxes(dets, _labels(0, 1), SIZE, PseudoBoxRule(min_score=0.2))
    assert whole == []
    assert _rows(selected) == [(10, 10, 50, 50, 0.9, 0), (20, 20, 80, 80, 0.05, 1)]


def test_boxes_scoring_min_score_are_kept_in_score_order_per_class():
    dets = _detections([(0, 0, 9, 9, 0.2, 1), (50, 50, 70, 70, 0.7, 1), (100, 0, 120, 20, 0.19999, 1)])
    selected, _ = select_pseudo_boxes(dets, _labels(1), SIZE, PseudoBoxRule(min_score=0.2, containment=None))
    assert _rows(selected) == [(50, 50, 70, 70, 0.7, 1), (0, 0, 9, 9, 0.2, 1)]
    one, _ = select_pseudo_boxes(dets, _labels(1), SIZE, PseudoBoxRule(min_score=1.0))
    assert _rows(one) == [(50, 50, 70, 70, 0.7, 1)]  # min_score 1: one box per label


def test_a_part_inside_a_kept_box_of_its_class_gives_way_to_the_whole_object():
    dets = _detections([
        (40, 40, 59, 59, 0.9, 0),  # a part (the face), top-scoring: 100% inside the next box
        (10, 10, 89, 89, 0.5, 0),  # the whole object
        (0, 0, 45, 45, 0.4, 0),    # 36 of 400 part pixels? no: it overlaps the whole box, half inside it
        (45, 45, 59, 59, 0.8, 1),  # class 1 inside class 0's boxes: other classes never contain
    ])  # fmt: skip
    selected, _ = select_pseudo_boxes(dets, _labels(0, 1), SIZE, PseudoBoxRule())
    # box 3 (0..45)^2 lies in (10..89)^2 for 36^2 / 46^2 = 61% of its area: below 0.85, kept
    assert _rows(selected) == [(10, 10, 89, 89, 0.5, 0), (0, 0, 45, 45, 0.4, 0), (45, 45, 59, 59, 0.8, 1)]
    exempt, _ = select_pseudo_boxes(dets, _labels(0, 1), SIZE, PseudoBoxRule(containment_exempt=(0,)))
    assert len(exempt["boxes"]) == 4  # an exempt class keeps its parts
    off, _ = select_pseudo_boxes(dets, _labels(0, 1), SIZE, PseudoBoxRule(containment=None))
    assert len(off["boxes"]) == 4


def test_of_two_boxes_inside_each_other_the_higher_scoring_stays_and_a_class_never_loses_all():
    # Near-identical boxes contain each other: SoS-WSOD drops both; the higher-scoring one stays here.
    dets = _detections([(10, 10, 50, 50, 0.6, 0), (10, 10, 50, 51, 0.7, 0)])
    selected, _ = select_pseudo_boxes(dets, _labels(0), SIZE, PseudoBoxRule())
    assert _rows(selected) == [(10, 10, 50, 51, 0.7, 0)]
    # A cycle A in B in C in A (each 85%+ of its area inside the next) would drop all three: the top stays.
    boxes = torch.tensor([[0.0, 0, 99, 99], [0, 0, 99, 99], [0, 0, 99, 99]])
    cycle = {
        "boxes": boxes,
        "scores": torch.tensor([0.3, 0.9, 0.5]),
        "labels": torch.zeros(3, dtype=torch.long),
    }
    selected, _ = select_pseudo_boxes(cycle, _labels(0), SIZE, PseudoBoxRule())
    assert _rows(selected) == [(0, 0, 99, 99, 0.9, 0)]


def test_a_label_without_any_detection_gets_the_whole_image_and_boxes_are_clipped():
    dets = _detections([(-5, -3, 250, 40, 0.8, 0)])
    selected, whole = select_pseudo_boxes(dets, _labels(0, 3), SIZE, PseudoBoxRule())
    assert whole == [3]
    assert _rows(selected) == [(0, 0, 199, 40, 0.8, 0), (0, 0, 199, 99, 0.0, 3)]
    empty, whole = select_pseudo_boxes(dets, _labels(), SIZE, PseudoBoxRule())
    assert whole == [] and empty["boxes"].shape == (0, 4)


def test_containment_is_the_share_of_the_first_box_in_inclusive_pixels():
    boxes = torch.tensor([[0.0, 0, 9, 9], [5, 0, 14, 9], [0, 0, 19, 19]])
    share = containment(boxes)
    assert share[0, 1].item() == pytest.approx(0.5)  # 5 of 10 columns, all 10 rows
    assert share[0, 2].item() == pytest.approx(1.0) and share[2, 0].item() == pytest.approx(0.25)
    assert torch.allclose(share.diagonal(), torch.ones(3, dtype=share.dtype))


def _reference(dets, labels, size, min_score, threshold):
    """A loop of SoS-WSOD's filter (tools/pgf.py) with wsod's differences (module docstring), in plain
    Python: class filter, top box + score rule, containment against the other kept boxes."""
    height, width = size
    rows = [
        ([min(max(v, 0.0), (width if k % 2 == 0 else height) - 1) for k, v in enumerate(box)], s, c)
        for box, s, c in zip(
            dets["boxes"].tolist(), dets["scores"].tolist(), dets["labels"].tolist(), strict=True
        )
    ]
    out = []
    for c in [k for k, v in enumerate(labels.tolist()) if v > 0]:
        mine = sorted([r for r in rows if r[2] == c], key=lambda r: -r[1])
        if not mine:
            out.append(([0.0, 0.0, width - 1.0, height - 1.0], 0.0, c))
            continue
        kept = [r for i, r in enumerate(mine) if i == 0 or r[1] >= min_score]

        def share(a, b):
            iw = min(a[2], b[2]) - max(a[0], b[0]) + 1
            ih = min(a[3], b[3]) - max(a[1], b[1]) + 1
            return max(iw, 0) * max(ih, 0) / ((a[2] - a[0] + 1) * (a[3] - a[1] + 1) + 1e-6)

        survivors = []
        for i, a in enumerate(kept):
            gone = False
            for j, b in enumerate(kept):
                if i == j or share(a[0], b[0]) < threshold:
                    continue
                if share(b[0], a[0]) >= threshold and i < j:
                    continue  # i holds j too and scores higher: i stays
                gone = True
            if not gone:
                survivors.append(a)
        out += survivors or kept[:1]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_rule_matches_a_naive_loop_on_random_detections(seed):
    generator = torch.Generator().manual_seed(seed)
    n = 60
    xy = torch.rand(n, 2, generator=generator) * torch.tensor([180.0, 80.0])
    wh = 2 + torch.rand(n, 2, generator=generator) * 60
    boxes = torch.cat([xy, xy + wh], dim=1)
    # A few nested boxes, so that the containment step acts.
    boxes[n // 2 :] = (
        boxes[: n // 2]
        + torch.tensor([1.0, 1.0, -1.0, -1.0]) * torch.rand(n // 2, 1, generator=generator) * 3
    )
    dets = {
        "boxes": boxes,
        "scores": torch.rand(n, generator=generator),
        "labels": torch.randint(0, 4, (n,), generator=generator),
    }
    labels = (torch.rand(4, generator=generator) > 0.4).float()
    labels[0] = 1
    selected, _ = select_pseudo_boxes(dets, labels, SIZE, PseudoBoxRule())
    expected = _reference(dets, labels, SIZE, 0.2, 0.85)
    got = _rows(selected)
    want = [(*[round(v, 4) for v in box], round(s, 4), c) for box, s, c in expected]
    assert got == want
    unfiltered, _ = select_pseudo_boxes(dets, labels, SIZE, PseudoBoxRule(containment=None))
    assert len(got) < len(unfiltered["boxes"])  # the containment step acted on these detections


def _sos_pgf(dets, labels, t_keep, t_con):
    """SoS-WSOD's filter (tools/pgf.py at 12d0b3b) as its plain loop, written from its facts, without
    wsod's differences, for the ties: the class filter; per class the first detection (here by
    decreasing score, as a model lists them) kept, each other dropped when ``score < t_keep``, a Python
    float against a Python float (line 238); then box i dropped when another kept box j of its class
    has ``inter / (area_i + 1e-6) >= t_con`` (contain_cal, lines 209-219; line 259), areas in wsod's
    inclusive pixels. Returns (box, score, label) rows, class by class."""
    rows = [
        (box, s, c)
        for box, s, c in zip(
            dets["boxes"].tolist(), dets["scores"].tolist(), dets["labels"].tolist(), strict=True
        )
        if labels[c] > 0
    ]
    rows.sort(key=lambda r: (r[2], -r[1]))
    seen, kept = set(), []
    for row in rows:
        if row[2] not in seen:
            seen.add(row[2])
            kept.append(row)
        elif not row[1] < t_keep:
            kept.append(row)

    def contain(a, b):
        inter = max(0, min(a[2], b[2]) - max(a[0], b[0]) + 1) * max(0, min(a[3], b[3]) - max(a[1], b[1]) + 1)
        return inter / ((a[2] - a[0] + 1) * (a[3] - a[1] + 1) + 1e-6)

    save = [True] * len(kept)
    for i, a in enumerate(kept):
        for j, b in enumerate(kept):
            if i != j and a[2] == b[2] and contain(a[0], b[0]) >= t_con:
                save[i] = False
    return [row for row, keep in zip(kept, save, strict=True) if keep]


def _as_rows(rows) -> list[tuple]:
    return [(*[round(v, 4) for v in box], round(s, 4), c) for box, s, c in rows]


def test_a_box_exactly_containment_inside_another_stays_as_in_sos():
    # Box 0 (4 x 4 = 16 pixels) has 3 x 4 = 12 of them inside box 1: a share of exactly 0.75 in binary.
    dets = _detections([(0, 0, 3, 3, 0.9, 0), (1, 0, 10, 10, 0.8, 0)])
    assert containment(dets["boxes"])[0, 1].item() == 0.75
    for threshold, kept in ((0.75, 2), (0.7499, 1)):  # at the share: kept; just below it: given way
        rule = PseudoBoxRule(containment=threshold)
        selected, _ = select_pseudo_boxes(dets, _labels(0), SIZE, rule)
        assert _rows(selected) == _as_rows(_sos_pgf(dets, _labels(0), 0.2, threshold))
        assert len(selected["boxes"]) == kept
    # The default 0.85 as a tie: 17 of box 0's 20 pixels inside box 1; 17 / 20 rounds to the double 0.85.
    dets = _detections([(0, 0, 19, 0, 0.9, 1), (3, 0, 30, 5, 0.8, 1)])
    assert containment(dets["boxes"])[0, 1].item() == 17 / 20 == 0.85
    selected, _ = select_pseudo_boxes(dets, _labels(1), SIZE, PseudoBoxRule())
    assert _rows(selected) == _as_rows(_sos_pgf(dets, _labels(1), 0.2, 0.85))
    assert len(selected["boxes"]) == 2


def test_containment_one_drops_nothing_as_in_sos():
    dets = _detections([
        (10, 10, 89, 89, 0.9, 0),  # the whole
        (30, 30, 49, 49, 0.8, 0),  # wholly inside it
        (30, 30, 49, 49, 0.7, 0),  # the same box again: each wholly inside the other
        (0, 0, 99, 99, 0.6, 0),    # holding all three
    ])  # fmt: skip
    one, _ = select_pseudo_boxes(dets, _labels(0), SIZE, PseudoBoxRule(containment=1.0))
    assert _rows(one) == _as_rows(_sos_pgf(dets, _labels(0), 0.2, 1.0))
    assert len(one["boxes"]) == 4  # a share is at most area / (area + 1e-6) < 1
    almost, _ = select_pseudo_boxes(dets, _labels(0), SIZE, PseudoBoxRule(containment=0.99))
    assert _rows(almost) == [(0, 0, 99, 99, 0.6, 0)]  # the step acts just below 1


@pytest.mark.parametrize("threshold", [0.7, 0.9])
def test_a_score_of_exactly_float32_of_min_score_falls_below_it_as_in_sos(threshold):
    score = torch.tensor(threshold, dtype=torch.float32)
    assert score.item() < threshold and bool(score >= threshold)  # below in double, equal in float32
    dets = _detections([(0, 0, 9, 9, 0.95, 0), (50, 0, 59, 9, threshold, 0), (100, 0, 109, 9, 0.99, 1)])
    rule = PseudoBoxRule(min_score=threshold)
    selected, _ = select_pseudo_boxes(dets, _labels(0, 1), SIZE, rule)
    assert _rows(selected) == _as_rows(_sos_pgf(dets, _labels(0, 1), threshold, 0.85))
    assert _rows(selected) == [(0, 0, 9, 9, 0.95, 0), (100, 0, 109, 9, 0.99, 1)]
    # float32(0.2) lies above 0.2: kept in double as in float32.
    dets["scores"][1] = 0.2
    selected, _ = select_pseudo_boxes(dets, _labels(0, 1), SIZE, PseudoBoxRule(min_score=0.2))
    assert _rows(selected) == _as_rows(_sos_pgf(dets, _labels(0, 1), 0.2, 0.85))
    assert len(selected["boxes"]) == 3


def test_precision_and_recall_at_iou_half_match_a_hand_count():
    truth = [
        {"boxes": torch.tensor([[0.0, 0, 9, 9], [20, 20, 39, 39]]), "labels": torch.tensor([0, 0]),
         "difficult": torch.tensor([False, False])},
        {"boxes": torch.tensor([[0.0, 0, 9, 9], [50, 50, 59, 59]]), "labels": torch.tensor([1, 1]),
         "difficult": torch.tensor([False, True])},
    ]  # fmt: skip
    pseudo = [
        # image 1, class 0: a hit on object 1 (score .9), a second box on it (.5: counted, false), a miss
        {"boxes": torch.tensor([[0.0, 0, 9, 9], [1, 1, 9, 9], [100, 100, 110, 110]]),
         "scores": torch.tensor([0.9, 0.5, 0.4]), "labels": torch.tensor([0, 0, 0])},
        # image 2, class 1: a hit, and a box on the difficult object (not counted); class 2 has no object
        {"boxes": torch.tensor([[0.0, 0, 9, 8], [50, 50, 59, 59], [0, 0, 5, 5]]),
         "scores": torch.tensor([0.8, 0.7, 0.6]), "labels": torch.tensor([1, 1, 2])},
    ]  # fmt: skip
    quality = pseudo_box_quality(pseudo, truth, num_classes=3)
    assert quality["true_positives"].tolist() == [1, 1, 0]
    assert quality["pseudo_boxes"].tolist() == [3, 1, 1]
    assert quality["objects"].tolist() == [2, 1, 0]
    assert quality["precision"] == pytest.approx(2 / 5) and quality["recall"] == pytest.approx(2 / 3)
    assert quality["class_precision"][:2].tolist() == pytest.approx([1 / 3, 1.0])
    assert quality["class_recall"][:2].tolist() == pytest.approx([0.5, 1.0])
    assert math.isnan(quality["class_recall"][2].item())
    with pytest.raises(ValueError, match="2 images of pseudo boxes for 1"):
        pseudo_box_quality(pseudo, truth[:1], num_classes=3)
