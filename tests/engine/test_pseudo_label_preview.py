"""Tensorboard images of each student's pseudo-labels during training (wsod/engine/pseudo_label_preview.py):
drawn where the boxes are, logged at the right iterations under the right tags, and never changing the
run they watch (losses, random stream, module modes)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator
from tiny_run import tiny_overrides
from torch import Tensor, nn
from torch.utils.data import ConcatDataset, Dataset
from torchvision import tv_tensors

from wsod.data.loader import collate
from wsod.data.targets import make_targets
from wsod.data.transforms import test_transform
from wsod.engine.checkpoint import Checkpointer
from wsod.engine.pseudo_label_preview import PseudoLabelPreview, draw_pseudo_labels
from wsod.engine.solver import build_optimizer, build_scheduler
from wsod.engine.train import train
from wsod.engine.visualize import GROUND_TRUTH_COLOUR, PALETTE
from wsod.modeling import PseudoLabels, build_detector
from wsod.modeling.detector import METHODS
from wsod.modeling.protocol import TrainingOutput
from wsod.modeling.refinement import MISTMethod
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[2]
WSDDNMethod = METHODS["wsddn"]
CLASSES = ("cat", "dog", "bird")
GREY = 90


class _Recorder:
    """A RunLog that keeps what it is given: rows as (kind, iteration, values), images as (tag, image,
    iteration)."""

    enabled, purge_after = True, None

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, dict]] = []
        self.images: list[tuple[str, Tensor, int]] = []

    def record(self, kind: str, iteration: int, values: dict) -> None:
        self.rows.append((kind, iteration, dict(values)))

    def image(self, tag: str, image: Tensor, iteration: int) -> None:
        self.images.append((tag, image, iteration))

    def evaluation(self, iteration: int, evaluation: object) -> None:
        raise AssertionError("no evaluation in these runs")


def _item(index: int, with_boxes: bool = True) -> dict:
    """A raw dataset item (before transform): a 64 x 80 image, 24 proposals, one or two labels."""
    g = torch.Generator().manual_seed(index)
    size = (64, 80)
    xy = torch.randint(0, 40, (24, 2), generator=g).float()
    wh = torch.randint(8, 38, (24, 2), generator=g).float()
    proposals = torch.cat([xy, (xy + wh).clamp(max=torch.tensor([79.0, 63.0]))], dim=1)
    labels = torch.tensor([1.0, 0.0, float(index % 2)])
    item = {
        "image": tv_tensors.Image(torch.randint(0, 256, (3, *size), dtype=torch.uint8, generator=g)),
        "image_id": f"img/{index}",
        "labels": labels,
        "targets": make_targets(labels, None, size),
        "proposals": tv_tensors.BoundingBoxes(proposals, format="XYXY", canvas_size=size),
        "original_size": size,
    }
    if with_boxes:
        item["gt_boxes"] = torch.tensor([[4.0, 4.0, 40.0, 30.0]])
    return item


def _items(count: int = 2) -> list[dict]:
    """Transformed items as the preview takes them: shorter side 48 (so boxes scale by 0.75)."""
    transform = test_transform(48, 200)
    return [transform(_item(i, with_boxes=i == 0)) for i in range(count)]


def _detector(**options) -> nn.Module:
    torch.manual_seed(0)
    options = {"norm": "bn", **options}  # BatchNorm statistics that an eval-mode call must not update
    return build_detector("resnet18", num_classes=len(CLASSES), chunk_size=None, width=0.25, **options)


def _batches(start: int):
    """Training batches of the hand-made items (batch i a function of i alone)."""
    transform = test_transform(48, 200)
    for index in itertools.count(start):
        yield collate([transform(_item(100 + 2 * index)), transform(_item(101 + 2 * index))])


def _train(model: nn.Module, run_dir: Path, max_iter: int, preview: PseudoLabelPreview | None) -> _Recorder:
    optimizer = build_optimizer(model, name="sgd", lr=0.01, momentum=0.9, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, milestones=[], warmup_iters=0)
    recorder = _Recorder()
    train(
        model, optimizer, scheduler, _batches, max_iter=max_iter, device=torch.device("cpu"),
        checkpointer=Checkpointer(run_dir, period=1000), run_log=recorder, progress=False, log_period=1,
        preview=preview,
    )  # fmt: skip
    return recorder


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same 3 steps of a detector with DropBlock (random samples every step) and BatchNorm, without
    previews and with one after every step."""
    runs = {}
    for name, period in (("off", None), ("on", 1)):
        torch.manual_seed(7)  # the training stream: DropBlock's samples
        model = _detector(dropblock=True)
        preview = None if period is None else PseudoLabelPreview(_items(), CLASSES, period=period)
        torch.manual_seed(7)
        recorder = _train(model, tmp_path_factory.mktemp(name), 3, preview)
        runs[name] = (recorder, {k: v.clone() for k, v in model.state_dict().items()})
    return runs


def test_previews_change_no_loss_and_no_weight_of_the_run(two_runs):
    (off, off_weights), (on, on_weights) = two_runs["off"], two_runs["on"]
    losses = [[(i, {k: v for k, v in row.items() if k.startswith(("loss", "grad"))}) for _, i, row in r.rows]
              for r in (off, on)]  # fmt: skip
    assert len(losses[0]) == 3 and losses[0] == losses[1]  # exactly, not approximately
    assert all(torch.equal(off_weights[k], on_weights[k]) for k in off_weights)  # BatchNorm statistics too
    assert not off.images and len(on.images) == 3 * 2 * 3  # iterations x images x students


def test_each_student_of_each_image_is_logged_at_each_multiple_of_the_period(tmp_path):
    model = _detector()
    preview = PseudoLabelPreview(_items(), CLASSES, period=2)
    recorder = _train(model, tmp_path, 5, preview)
    expected = [
        (f"pseudo_labels/{i}_img_{i}/student_{k}", iteration)
        for iteration in (2, 4) for i in range(2) for k in (1, 2, 3)
    ]  # fmt: skip
    assert [(tag, iteration) for tag, _, iteration in recorder.images] == expected
    for _, image, _ in recorder.images:  # the 48 x 60 resized image, as the detector saw it
        assert image.dtype == torch.uint8 and tuple(image.shape) == (3, 48, 60)


class _Poisoned(nn.Module):
    """The detector, whose loss turns NaN on the training calls listed (counted from 1)."""

    def __init__(self, detector: nn.Module, poisoned: set[int]) -> None:
        super().__init__()
        self.detector, self.poisoned, self.calls = detector, poisoned, 0
        self.method = detector.method

    def forward(self, **inputs) -> TrainingOutput:
        self.calls += 1
        output = self.detector(**inputs)
        if self.calls in self.poisoned:
            output.losses = {k: v * float("nan") for k, v in output.losses.items()}
        return output

    def pseudo_labels(self, *args) -> list[list[PseudoLabels]]:
        return self.detector.pseudo_labels(*args)


def test_a_skipped_step_logs_no_preview(tmp_path):
    model = _Poisoned(_detector(), poisoned={2})
    recorder = _train(model, tmp_path, 3, PseudoLabelPreview(_items(1), CLASSES, period=1))
    assert sorted({iteration for _, _, iteration in recorder.images}) == [1, 3]


class _SamplingMIST(MISTMethod):
    """MIST that draws a random number in each record (as a user's sampling method might)."""

    def pseudo_labels(self, student, proposals, scores, targets):
        torch.rand(1)
        return super().pseudo_labels(student, proposals, scores, targets)


def test_a_call_runs_in_eval_mode_and_restores_every_mode_and_the_random_stream():
    model = _detector(dropblock=True, method=_SamplingMIST())
    model.train()
    model.mil_head.eval()  # a submodule the caller keeps in eval mode stays so
    modes = {name: m.training for name, m in model.named_modules()}
    seen = []
    model.base.register_forward_hook(lambda module, *_: seen.append(module.training))
    preview = PseudoLabelPreview(_items(), CLASSES, period=1)
    before = torch.get_rng_state()
    recorder = _Recorder()
    preview(model, 7, recorder)
    assert torch.equal(torch.get_rng_state(), before)
    assert seen == [False, False]  # one eval-mode forward per image
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert len(recorder.images) == 2 * 3 and {i for *_, i in recorder.images} == {7}


@pytest.mark.parametrize("name", ["oicr", "pcl"])
def test_the_other_methods_with_students_are_drawn_too(name):
    # OICR's top boxes, PCL's cluster centres (a method without box regression) and their members.
    model = _detector(method=METHODS[name]())
    preview = PseudoLabelPreview(_items(), CLASSES, period=1)
    recorder = _Recorder()
    preview(model, 1, recorder)
    assert len(recorder.images) == 2 * 3
    canvases = [image.canvas for image in preview.images for _ in range(3)]
    pairs = zip(recorder.images, canvases, strict=True)
    assert all(not torch.equal(drawn, canvas) for (_, drawn, _), canvas in pairs)


def test_a_method_without_students_logs_nothing_and_says_so_once(caplog):
    model = _detector(method=WSDDNMethod(), num_students=0)  # the MIL teacher alone
    preview = PseudoLabelPreview(_items(), CLASSES, period=1)
    recorder = _Recorder()
    with caplog.at_level(logging.INFO, logger="wsod.engine.pseudo_label_preview"):
        for iteration in (1, 2, 3):
            preview(model, iteration, recorder)
    assert recorder.images == []
    said = [r.getMessage() for r in caplog.records if "nothing to draw" in r.getMessage()]
    assert said == ["pseudo-label previews: WSDDNMethod trains no students, so there is nothing to draw"]


def _box(x1: int, y1: int, x2: int, y2: int) -> list[float]:
    return [float(x1), float(y1), float(x2), float(y2)]


def _record(labels: list[int], pseudo: list[tuple[list[float], int, float]] | None) -> PseudoLabels:
    count = len(labels)
    boxes = None if pseudo is None else torch.tensor([p[0] for p in pseudo]).reshape(-1, 4)
    return PseudoLabels(
        torch.tensor(labels, dtype=torch.int64), torch.ones(count), torch.zeros(count, 4),
        pseudo_boxes=boxes,
        pseudo_classes=None if pseudo is None else torch.tensor([p[1] for p in pseudo], dtype=torch.int64),
        pseudo_scores=None if pseudo is None else torch.tensor([p[2] for p in pseudo]),
    )  # fmt: skip


def _inside(changed: Tensor, boxes: list[list[float]]) -> bool:
    """Whether every changed pixel (H, W) lies within one of the boxes (xyxy, borders included)."""
    allowed = torch.zeros_like(changed)
    for x1, y1, x2, y2 in boxes:
        allowed[int(y1) : int(y2) + 1, int(x1) : int(x2) + 1] = True
    return bool((changed & ~allowed).sum() == 0)


def test_the_drawing_differs_from_the_image_exactly_on_the_boxes_in_their_colours():
    canvas = torch.full((3, 100, 120), GREY, dtype=torch.uint8)
    # ROI 0: foreground class 1 (a member, thin); ROI 1: background (not drawn).
    proposals = torch.tensor([_box(10, 10, 60, 50), _box(95, 5, 115, 30)])
    pseudo_box, gt = _box(20, 20, 90, 80), _box(4, 60, 50, 95)
    record = _record([2, 0], [(pseudo_box, 0, 0.9)])
    drawn = draw_pseudo_labels(canvas, record, proposals, CLASSES, ground_truth=torch.tensor([gt]))
    assert drawn.dtype == torch.uint8 and drawn.shape == canvas.shape
    assert torch.equal(canvas, torch.full_like(canvas, GREY))  # the canvas itself is not drawn on
    colour = lambda y, x: tuple(drawn[:, y, x].tolist())  # noqa: E731
    assert colour(80, 55) == PALETTE[0]  # the pseudo box's bottom edge: class 0 (cat)
    assert colour(79, 55) == PALETTE[0]  # thick: two pixels
    assert colour(30, 10) == PALETTE[1]  # the member's left edge: class 1 (dog)
    assert colour(30, 11) == (GREY,) * 3  # thin: one pixel
    assert colour(90, 4) == GROUND_TRUTH_COLOUR  # the ground truth's left edge
    assert colour(20, 115) == (GREY,) * 3  # the background ROI is not drawn
    changed = (drawn != canvas).any(dim=0)
    assert _inside(changed, [proposals[0].tolist(), pseudo_box, gt])  # label text inside the pseudo box
    assert changed.sum() > 0


def test_records_without_pseudo_boxes_draw_their_members_and_with_none_the_image_alone():
    canvas = torch.full((3, 50, 60), GREY, dtype=torch.uint8)
    proposals = torch.tensor([_box(10, 10, 40, 30), _box(5, 5, 20, 20)])
    members_only = draw_pseudo_labels(canvas, _record([3, 0], None), proposals, CLASSES)  # PCL-like
    assert tuple(members_only[:, 20, 10].tolist()) == PALETTE[2]
    assert _inside((members_only != canvas).any(dim=0), [proposals[0].tolist()])
    # No positive class: no foreground ROI and an empty pseudo box list.
    nothing = draw_pseudo_labels(canvas, _record([0, 0], []), proposals, CLASSES)
    assert torch.equal(nothing, canvas)


def test_boxes_are_scaled_with_an_image_shrunk_to_max_side():
    items = _items(1)  # 48 x 60, ground truth (4, 4, 40, 30) in original pixels = (3, 3, 30, 22.5) resized
    preview = PseudoLabelPreview(items, CLASSES, period=1, max_side=30)
    (image,) = preview.images
    assert tuple(image.canvas.shape) == (3, 24, 30) and image.scale == (0.5, 0.5)
    record = _record([0] * len(image.proposals), [])
    drawn = draw_pseudo_labels(
        image.canvas, record, image.proposals, CLASSES, ground_truth=image.ground_truth, scale=image.scale
    )
    assert tuple(drawn[:, 6, 1].tolist()) == GROUND_TRUTH_COLOUR  # x 3 * 0.5 -> 1, y 3 .. 11


class _Listed(Dataset):
    """Raw items behind a transform, as ``WeakDetectionDataset`` holds them."""

    def __init__(self, items: list[dict]) -> None:
        self.items, self.transform = items, self._refuse

    @staticmethod
    def _refuse(item: dict) -> dict:
        raise AssertionError("the preview must not run the training transform")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        return item if self.transform is None else self.transform(item)


def test_the_first_images_of_a_concatenation_are_read_without_the_training_transform():
    first, second = _Listed([_item(0)]), _Listed([_item(1), _item(2)])
    preview = PseudoLabelPreview.from_dataset(
        ConcatDataset([first, second]), CLASSES, num_images=2, scale=48, max_size=200, period=3
    )
    assert [image.tag for image in preview.images] == ["pseudo_labels/0_img_0", "pseudo_labels/1_img_1"]
    assert tuple(preview.images[1].inputs["images"].shape[-2:]) == (64, 64)  # 48 x 60 padded to 32s
    assert first.transform is not None and second.transform is not None  # the loader's sets untouched
    with pytest.raises(ValueError, match="at least one image"):
        PseudoLabelPreview.from_dataset(first, CLASSES, num_images=0, scale=48, period=1)


def test_a_tiny_run_writes_the_previews_to_tensorboard(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    extra = {
        "pseudo_label_preview.period": 2, "pseudo_label_preview.images": 2, "random_baseline": "false",
        "checkpoint_period": 4,
    }  # fmt: skip
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=tiny_overrides(tiny_toy_root, run_dir, **extra))
    train_from_config(cfg)
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={IMAGES: 0})
    events.Reload()
    tags = [t for t in events.Tags()[IMAGES] if t.startswith("pseudo_labels/")]
    students = cfg.method.num_students
    assert len(tags) == 2 * students and all(t.split("/")[-1].startswith("student_") for t in tags)
    for tag in tags:
        assert [event.step for event in events.Images(tag)] == [2, 4]
    assert "pseudo-label previews every 2 steps: 2 training image(s)" in (run_dir / "log.txt").read_text()


def test_points_and_scribbles_are_drawn_in_their_class_colours_on_top():
    canvas = torch.full((3, 50, 60), GREY, dtype=torch.uint8)
    proposals = torch.tensor([_box(5, 5, 9, 9)])
    partial = {
        "points": torch.tensor([[20.0, 30.0]]),
        "point_labels": torch.tensor([2]),
        "scribble_points": torch.tensor([[40.0, 10.0], [41.0, 11.0], [42.0, 12.0]]),
        "scribble_labels": torch.tensor([1, 1, 1]),
        "scribble_ids": torch.tensor([0, 0, 0]),
    }
    drawn = draw_pseudo_labels(canvas, _record([0], []), proposals, CLASSES, partial_labels=partial)
    assert tuple(drawn[:, 30, 20].tolist()) == PALETTE[2]  # the point
    assert all(tuple(drawn[:, 10 + i, 40 + i].tolist()) == PALETTE[1] for i in range(3))  # the path
    changed = (drawn != canvas).any(dim=0)
    assert _inside(changed, [[17, 27, 23, 33], [39, 9, 43, 13]])
    # Without partial labels nothing is added.
    assert torch.equal(draw_pseudo_labels(canvas, _record([0], []), proposals, CLASSES), canvas)
