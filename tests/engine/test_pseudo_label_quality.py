"""The training log's pseudo-label quality (wsod/engine/pseudo_label_quality.py): its counting rule
against a naive loop (IoU exactly 0.5 included), its empty cases, the records the forward keeps, a run
that trains bit for bit alike with and without it, and the keys a real run writes, or does not write
on data without boxes."""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from folder_data import write_image_folder
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_run import tiny_overrides
from torch import Tensor, nn
from torchvision import tv_tensors
from torchvision.ops import box_iou

from wsod.data.folder import proposals_path
from wsod.data.loader import collate, model_inputs
from wsod.data.proposals import ProposalSet
from wsod.data.proposals.store import write_proposal_store
from wsod.data.targets import make_targets
from wsod.data.transforms import DetectionTransform
from wsod.engine.checkpoint import Checkpointer
from wsod.engine.pseudo_label_quality import PseudoLabelQuality, correct_pseudo_boxes, pseudo_label_quality
from wsod.engine.solver import build_optimizer, build_scheduler
from wsod.engine.train import train
from wsod.modeling import PseudoLabels, build_detector
from wsod.modeling.cbl import CBLMethod, top1_seeds
from wsod.modeling.detector import METHODS
from wsod.modeling.method import TrainingProgress
from wsod.modeling.protocol import TrainingOutput
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ("cat", "dog", "bird")


# -- the rule, against a naive loop -------------------------------------------------------------------


def _naive_iou(a: list[int], b: list[int]) -> Fraction:
    """IoU with torchvision's area (x2 - x1) * (y2 - y1), no +1, in exact fractions."""
    width = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return Fraction(inter, union)


def _naive_quality(pseudo: list, truth: list) -> dict[str, float]:
    """The module docstring's rules, one box at a time."""
    if not pseudo:
        return {}
    correct = boxes = 0
    for (pseudo_boxes, pseudo_classes), (true_boxes, true_labels) in zip(pseudo, truth, strict=True):
        for box, cls in zip(pseudo_boxes.tolist(), pseudo_classes.tolist(), strict=True):
            boxes += 1
            hit = any(
                label == cls and _naive_iou([int(v) for v in box], [int(v) for v in true]) >= Fraction(1, 2)
                for true, label in zip(true_boxes.tolist(), true_labels.tolist(), strict=True)
            )
            correct += hit
    values = {"boxes": boxes / len(pseudo)}
    if boxes:
        values["precision"] = correct / boxes
    return values


def _random_boxes(rng: random.Random, count: int) -> Tensor:
    """Integer-cornered boxes on a small grid (many ties and exact halves), each with area > 0."""
    rows = []
    for _ in range(count):
        x1, y1 = rng.randint(0, 10), rng.randint(0, 10)
        rows.append([x1, y1, x1 + rng.randint(1, 10), y1 + rng.randint(1, 10)])
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 4)


def test_an_iou_of_exactly_one_half_is_correct_and_just_below_is_not():
    pseudo, true = torch.tensor([[0.0, 0.0, 10.0, 10.0]]), torch.tensor([[0.0, 0.0, 10.0, 20.0]])
    assert box_iou(pseudo, true).item() == 0.5  # 100 / (100 + 200 - 100), exactly, in float32
    assert _naive_iou([0, 0, 10, 10], [0, 0, 10, 20]) == Fraction(1, 2)
    same, other = torch.tensor([2]), torch.tensor([1])
    assert correct_pseudo_boxes(pseudo, same, true, same).tolist() == [True]
    assert correct_pseudo_boxes(pseudo, same, true, other).tolist() == [False]  # another class
    below = torch.tensor([[0.0, 0.0, 10.0, 20.5]])
    assert box_iou(pseudo, below).item() < 0.5
    assert correct_pseudo_boxes(pseudo, same, below, same).tolist() == [False]
    assert pseudo_label_quality([(pseudo, same)], [(true, same)]) == {"boxes": 1.0, "precision": 1.0}


def test_random_cases_agree_with_the_naive_loop():
    rng = random.Random(0)
    halves = 0  # pseudo boxes whose only same-class match is at IoU exactly 0.5
    for _ in range(300):
        pseudo, truth = [], []
        for _ in range(rng.randint(1, 4)):
            count, objects = rng.choice([0, 1, 2, 5]), rng.choice([0, 1, 3])
            boxes, classes = _random_boxes(rng, count), torch.tensor([rng.randrange(3) for _ in range(count)])
            true_boxes = _random_boxes(rng, objects)
            true_labels = torch.tensor([rng.randrange(3) for _ in range(objects)], dtype=torch.int64)
            if count and rng.random() < 0.5:  # an object twice as tall as pseudo box 0: IoU exactly 1/2
                x1, y1, x2, y2 = boxes[0].tolist()
                true_boxes = torch.cat([true_boxes, torch.tensor([[x1, y1, x2, 2 * y2 - y1]])])
                true_labels = torch.cat([true_labels, classes[:1]])
            pseudo.append((boxes, classes.long()))
            truth.append((true_boxes, true_labels))
            if count and len(true_boxes):
                same = classes.reshape(-1, 1) == true_labels.reshape(1, -1)
                overlaps = torch.where(same, box_iou(boxes, true_boxes), torch.zeros(()))
                halves += int((overlaps.max(dim=1).values == 0.5).sum())
        assert pseudo_label_quality(pseudo, truth) == _naive_quality(pseudo, truth)
    assert halves > 50  # the inclusive bound decided many boxes


def test_empty_cases_duplicates_and_images_without_boxes():
    empty = (torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))
    box, cls = torch.tensor([[0.0, 0.0, 10.0, 10.0]]), torch.tensor([0])
    assert pseudo_label_quality([], []) == {}  # no image: nothing to say
    assert pseudo_label_quality([empty, empty], [(box, cls), empty]) == {"boxes": 0.0}  # no precision
    assert pseudo_label_quality([(box, cls)], [empty]) == {"boxes": 1.0, "precision": 0.0}  # no object
    # Two boxes on one object are both correct; an image without pseudo boxes adds to the mean only.
    twice = (torch.cat([box, box]), torch.cat([cls, cls]))
    assert pseudo_label_quality([twice, empty], [(box, cls), (box, cls)]) == {"boxes": 1.0, "precision": 1.0}
    with pytest.raises(ValueError, match="2 images of pseudo boxes for 1"):
        pseudo_label_quality([empty, empty], [empty])


# -- the step's counts ----------------------------------------------------------------------------------


def _record(boxes: list[list[float]] | None, classes: list[int] | None = None) -> PseudoLabels:
    if boxes is None:
        return PseudoLabels(torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1, 4))
    count = len(boxes)
    return PseudoLabels(
        torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1, 4),
        pseudo_boxes=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        pseudo_classes=torch.tensor(classes, dtype=torch.int64), pseudo_scores=torch.ones(count),
    )  # fmt: skip


def _targets(boxes: list[list[float]] | None, labels: list[int] | None = None) -> dict[str, Tensor]:
    targets = {"labels": torch.ones(3)}
    if boxes is not None:
        targets["true_boxes"] = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        targets["true_labels"] = torch.tensor(labels, dtype=torch.int64)
    return targets


A, B = [0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 40.0]


def test_counts_add_over_micro_batches_and_leave_out_images_without_true_boxes():
    quality = PseudoLabelQuality()
    # Micro-batch 1: image 0 judged (student 1: one right, one wrong class; student 2: one right);
    # image 1 has no true boxes (left out whatever its pseudo boxes). Teacher: one right on image 0.
    students = [[_record([A, B], [0, 1]), _record([A], [0])], [_record([A], [0]), _record([B], [1])]]
    none = (torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), torch.ones(0))
    teacher = [(torch.tensor([A]), torch.tensor([0]), torch.ones(1)), none]
    output = TrainingOutput({}, pseudo_labels=students, teacher_pseudo_boxes=teacher)
    quality.add(output, [_targets([A, B], [0, 0]), _targets(None)])
    # Micro-batch 2: one judged image without any pseudo box of student 1, one wrong of student 2.
    quality.add(
        TrainingOutput(
            {}, pseudo_labels=[[_record([], [])], [_record([A], [2])]],
            teacher_pseudo_boxes=[(torch.tensor([B]), torch.tensor([1]), torch.ones(1))],
        ),
        [_targets([A], [0])],
    )  # fmt: skip
    # Student 1: 1 right of 2 over 2 images; student 2: 1 of 2; the teacher: 1 of 2.
    assert quality.values() == {
        "pseudo/boxes_1": 1.0, "pseudo/precision_1": 0.5,
        "pseudo/boxes_2": 1.0, "pseudo/precision_2": 0.5,
        "pseudo/precision_teacher": 0.5,
    }  # fmt: skip


def test_no_key_without_true_boxes_nor_for_a_method_without_pseudo_boxes_nor_a_missing_teacher():
    quality = PseudoLabelQuality()
    quality.add(TrainingOutput({}, pseudo_labels=[[_record([A], [0])]]), [_targets(None)])
    assert quality.values() == {}  # label-only data
    quality = PseudoLabelQuality()
    quality.add(TrainingOutput({}, pseudo_labels=[[_record(None)], [_record([], [])]]), [_targets([A], [0])])
    assert quality.values() == {"pseudo/boxes_2": 0.0}  # student 1 names no boxes; 2 has none (no precision)
    assert PseudoLabelQuality().values() == {}
    quality = PseudoLabelQuality()
    quality.add(TrainingOutput({}, pseudo_labels=[[_record([A], [0])]]), [_targets([A], [0])])
    with pytest.raises(ValueError, match="2 students' pseudo-labels after 1"):
        quality.add(TrainingOutput({}, pseudo_labels=[[_record([A], [0])]] * 2), [_targets([A], [0])])


# -- the forward keeps its records ----------------------------------------------------------------------


def _item(index: int, with_boxes: bool = True) -> dict:
    """A raw dataset item: a 64 x 80 image, 24 proposals, ground truth on two of them (classes 0 and
    2, both labelled)."""
    g = torch.Generator().manual_seed(index)
    size = (64, 80)
    xy = torch.randint(0, 40, (24, 2), generator=g).float()
    wh = torch.randint(8, 38, (24, 2), generator=g).float()
    proposals = torch.cat([xy, (xy + wh).clamp(max=torch.tensor([79.0, 63.0]))], dim=1)
    labels = torch.tensor([1.0, float(index % 2), 1.0])
    item = {
        "image": tv_tensors.Image(torch.randint(0, 256, (3, *size), dtype=torch.uint8, generator=g)),
        "image_id": f"img/{index}",
        "labels": labels,
        "targets": make_targets(labels, None, size),
        "proposals": tv_tensors.BoundingBoxes(proposals, format="XYXY", canvas_size=size),
        "original_size": size,
    }
    if with_boxes:
        item["gt_boxes"] = proposals[[3, 7]].clone()
        item["gt_labels"] = torch.tensor([0, 2])
        item["gt_difficult"] = torch.zeros(2, dtype=torch.bool)
    return item


# A training transform with a flip and the true boxes carried (as build_train_dataset's).
TRANSFORM = DetectionTransform([48], 200, flip_prob=0.5, true_boxes=True)


def _batch(indices: list[int], with_boxes: bool = True) -> dict:
    torch.manual_seed(indices[0])  # the flips
    return collate([TRANSFORM(_item(i, with_boxes)) for i in indices])


def _detector(**options) -> nn.Module:
    torch.manual_seed(0)
    options = {"norm": "bn", **options}
    return build_detector("resnet18", num_classes=len(CLASSES), chunk_size=None, width=0.25, **options)


@pytest.mark.parametrize("name", ["mist", "oicr", "pcl"])
def test_kept_records_are_the_ones_the_losses_came_from_and_change_no_loss(name):
    model = _detector(method=METHODS[name]()).train()
    inputs = model_inputs(_batch([1, 2]), torch.device("cpu"))
    torch.manual_seed(3)
    plain = model(**inputs)
    torch.manual_seed(3)
    kept = model(**inputs, keep={"pseudo_labels"})
    assert plain.pseudo_labels is None and plain.teacher_pseudo_boxes is None
    assert {k: v.item() for k, v in plain.losses.items()} == {k: v.item() for k, v in kept.losses.items()}
    assert len(kept.pseudo_labels) == 3 and all(len(records) == 2 for records in kept.pseudo_labels)
    assert kept.teacher_pseudo_boxes is None  # no EMA teacher
    # The records are the method's on the chain of source scores (student 1 from the MIL teacher).
    records = model.pseudo_labels(inputs["images"], inputs["proposals"], inputs["targets"])
    for mine, theirs in zip(kept.pseudo_labels, records, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a.labels, b.labels) and torch.equal(a.pseudo_boxes, b.pseudo_boxes)


def test_cbl_keeps_its_teachers_top1_seeds_for_the_teacher_precision():
    method = CBLMethod()
    model = _detector(method=method).train()
    inputs = model_inputs(_batch([1, 2]), torch.device("cpu"))
    teacher = _detector(method=CBLMethod()).eval()
    scores = teacher.roi_scores(inputs["images"], inputs["proposals"])
    progress = TrainingProgress(5, 10)
    plain = model(**inputs, teacher_scores=scores, progress=progress)
    kept = model(**inputs, teacher_scores=scores, progress=progress, keep={"pseudo_labels"})
    assert {k: v.item() for k, v in plain.losses.items()} == {k: v.item() for k, v in kept.losses.items()}
    counts = [len(p) for p in inputs["proposals"]]
    for i, (boxes, classes, found) in enumerate(kept.teacher_pseudo_boxes):
        probs = scores.students[-1].split(counts)[i][:, 1:]
        labels = inputs["targets"][i]["labels"]
        expected = top1_seeds(inputs["proposals"][i], probs, labels, score_clip=method.score_clip)
        assert torch.equal(boxes, expected[0]) and torch.equal(classes, expected[1])
        assert torch.equal(found, expected[2])
        assert len(boxes) == int(inputs["targets"][i]["labels"].sum())  # one seed per positive class
    quality = PseudoLabelQuality()
    quality.add(kept, inputs["targets"])
    values = quality.values()
    assert {f"pseudo/{n}_{k}" for n in ("precision", "boxes") for k in (1, 2, 3)} | {
        "pseudo/precision_teacher"
    } == set(values)
    assert all(0.0 <= v <= 1.0 for k, v in values.items() if "precision" in k)


# -- the loop: only at log steps, and the run unchanged ------------------------------------------------


class _Recorder:
    """A RunLog that keeps its rows as (kind, iteration, values)."""

    enabled, purge_after = True, None

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, dict]] = []

    def record(self, kind: str, iteration: int, values: dict) -> None:
        self.rows.append((kind, iteration, dict(values)))

    def image(self, tag: str, image: Tensor, iteration: int) -> None:
        raise AssertionError("no images in these runs")

    def evaluation(self, iteration: int, evaluation: object) -> None:
        raise AssertionError("no evaluation in these runs")


def _batches(with_boxes: bool):
    def make(start: int):
        for index in itertools.count(start):
            yield _batch([100 + 2 * index, 101 + 2 * index], with_boxes)

    return make


def _train(model, run_dir: Path, *, measure: bool, with_boxes: bool = True, log_period: int = 2):
    optimizer = build_optimizer(model, name="sgd", lr=0.01, momentum=0.9, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, milestones=[], warmup_iters=0)
    recorder = _Recorder()
    train(
        model, optimizer, scheduler, _batches(with_boxes), max_iter=3, device=torch.device("cpu"),
        checkpointer=Checkpointer(run_dir, period=1000), run_log=recorder, progress=False,
        log_period=log_period, pseudo_label_quality=measure,
    )  # fmt: skip
    return recorder


def test_a_run_trains_bit_for_bit_alike_with_and_without_it_and_measures_only_logged_steps(
    tmp_path, monkeypatch
):
    calls = []
    add = PseudoLabelQuality.add
    monkeypatch.setattr(PseudoLabelQuality, "add", lambda self, *a: (calls.append(1), add(self, *a)))
    runs = {}
    for measure in (False, True):
        model = _detector(dropblock=True)  # DropBlock: random samples every step, from the run's stream
        torch.manual_seed(7)
        recorder = _train(model, tmp_path / str(measure), measure=measure)
        runs[measure] = (recorder.rows, model.state_dict(), torch.get_rng_state())
    (off_rows, off_weights, off_rng), (on_rows, on_weights, on_rng) = runs[False], runs[True]
    assert len(calls) == 2  # steps 2 (log_period) and 3 (the last), none at step 1
    assert torch.equal(off_rng, on_rng)  # the random stream is where it would be
    assert all(torch.equal(off_weights[k], on_weights[k]) for k in off_weights)  # exactly, BN statistics too
    losses = lambda rows: [{k: v for k, v in r.items() if k.startswith(("loss", "grad"))} for _, _, r in rows]  # noqa: E731
    assert [i for _, i, _ in on_rows] == [2, 3] and losses(off_rows) == losses(on_rows)
    assert not any(k.startswith("pseudo/") for _, _, row in off_rows for k in row)
    for _, _, row in on_rows:
        keys = {k for k in row if k.startswith("pseudo/")}
        assert {f"pseudo/boxes_{k}" for k in (1, 2, 3)} <= keys <= {
            f"pseudo/{n}_{k}" for n in ("precision", "boxes") for k in (1, 2, 3)
        }  # fmt: skip
        assert all(0.0 <= row[k] <= 1.0 for k in keys if "precision" in k)


def test_a_run_on_images_without_boxes_logs_no_pseudo_key(tmp_path):
    recorder = _train(_detector(), tmp_path, measure=True, with_boxes=False, log_period=1)
    assert [i for _, i, _ in recorder.rows] == [1, 2, 3]
    assert not any(k.startswith("pseudo/") for _, _, row in recorder.rows for k in row)


# -- real runs ------------------------------------------------------------------------------------------


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _train_from_config(overrides: list[str]) -> dict:
    threads = torch.get_num_threads()
    try:
        return train_from_config(_compose(overrides))
    finally:
        torch.set_num_threads(threads)


def test_a_toy_run_writes_the_pseudo_keys_to_metrics_jsonl_and_tensorboard(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    _train_from_config(tiny_overrides(tiny_toy_root, run_dir, log_period=2, random_baseline="false"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train_rows] == [2, 4]
    for row in train_rows:
        for k in (1, 2, 3):  # MIST's three students, numbered as loss_ref_cls_k
            assert f"loss_ref_cls_{k}" in row and 0.0 <= row[f"pseudo/precision_{k}"] <= 1.0
            assert row[f"pseudo/boxes_{k}"] >= 1.0  # every toy image has a label: a pseudo box per class
        assert "pseudo/precision_teacher" not in row  # MIST has no EMA teacher
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    for tag in ("train/pseudo/precision_1", "train/pseudo/boxes_1"):
        assert [s.step for s in events.Scalars(tag)] == [2, 4]
    first = events.Scalars("train/pseudo/precision_1")[0].value
    assert first == pytest.approx(train_rows[0]["pseudo/precision_1"])


def test_a_folder_run_of_image_labels_alone_writes_no_pseudo_key(tmp_path):
    root = tmp_path / "mine"
    write_image_folder(root, num_train=4, num_test=2)
    rng = np.random.default_rng(0)
    names = sorted(str(p.relative_to(root / "images")) for p in (root / "images").rglob("*.jpg"))
    corners = [rng.integers(0, 80, (16, 2)) for _ in names]
    boxes = [np.concatenate([c, c + rng.integers(30, 79, (16, 2))], 1).astype(np.float32) for c in corners]
    write_proposal_store(ProposalSet(names, [b.clip(0, 159) for b in boxes]), proposals_path(root))
    run_dir = tmp_path / "run"
    settings = {
        "data.root": str(root), "data.train.scales": "[64]", "data.test.scales": "[64]",
        "data.train.num_workers": 0, "data.test.num_workers": 0, "solver.max_iter": 2,
        "solver.warmup_iters": 1, "solver.milestones": "[1]", "model.chunk_size": 16,
        "output_dir": str(run_dir), "log_period": 1, "progress": "false", "random_baseline": "false",
    }  # fmt: skip
    _train_from_config(["data=folder", *(f"{k}={v}" for k, v in settings.items())])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train_rows] == [1, 2] and all("loss_ref_cls_1" in r for r in train_rows)
    assert not any(key.startswith("pseudo/") for row in rows for key in row)
