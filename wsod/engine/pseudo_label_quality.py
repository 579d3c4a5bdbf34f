"""How right the pseudo boxes are while training: a log of their precision against the true boxes.

Every log step (``log_period``, and the last step) the training loop asks the step's forward for the
pseudo-labels it trained on (``keep={"pseudo_labels"}``: the records the losses were computed from,
kept rather than recomputed) and scores them here, per refinement student k = 1..K (the numbering of
the loss names, ``loss_ref_cls_k``) and for the EMA teacher when the method names its pseudo boxes
(``RefinementMethod.teacher_pseudo_boxes``: CBL's top-1 seeds of its teacher). The row of the step in
``metrics.jsonl`` (and tensorboard, ``train/<key>``) gets:

    pseudo/precision_k       correct / all of student k's pseudo boxes over the step's images
    pseudo/boxes_k           student k's pseudo boxes per image (the mean over the same images)
    pseudo/precision_teacher the teacher's pseudo boxes scored the same way (one set: the teacher's one
                             classifier, not one per student)

Rules, written once (``correct_pseudo_boxes``):

- A pseudo box is correct when its IoU with some true box of the same class is >= 0.5 (inclusive).
  Each box is judged alone: two pseudo boxes on one object are both correct (the question is whether
  the students learn from the right places, not a detection AP; the export's offline
  ``wsod.engine.pseudo_boxes.pseudo_box_quality`` follows the devkit instead).
- IoU is torchvision's ``box_iou`` (area ``(x2 - x1) * (y2 - y1)``, no +1), the IoU the methods label
  their ROIs with (``wsod.modeling.refinement``), in the training batch's pixels: the true boxes are the
  images' ``gt_boxes`` (difficult ones included) moved by the same resize and flip as the proposals
  (``true_boxes`` / ``true_labels`` in the targets, ``wsod.data.transforms``), so they sit where the
  pseudo boxes (proposals, or boxes made from them) do.
- Only images whose targets carry true boxes count (an image of such a set without objects counts, with
  no true box); each view of a multi-view batch counts as an image. An image with no pseudo box adds to
  boxes_k's mean and nothing to precision_k. With no pseudo box of k in the whole step, boxes_k is 0
  and precision_k is left out of the row (a ratio of nothing; metrics.jsonl would need a NaN, which
  tensorboard drops anyway). With no image carrying true boxes (label-only data, e.g. ``data.kind=
  folder``) no ``pseudo/`` key is written at all; nor for a student whose records give no pseudo boxes.
- Counts add over the step's micro-batches (``accumulation``) and over processes (DDP), then divide.

It never changes training: it reads records already made, under ``torch.no_grad``, draws no random
number and writes nothing the step uses, so a run with and without it trains bit for bit alike
(tests/engine/test_pseudo_label_quality.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torchvision.ops import box_iou

from wsod.data.targets import TRUE_BOXES, TRUE_LABELS
from wsod.distributed import is_distributed
from wsod.modeling.protocol import TrainingOutput

__all__ = [
    "IOU_THRESHOLD",
    "PREFIX",
    "TEACHER",
    "correct_pseudo_boxes",
    "pseudo_label_quality",
    "PseudoLabelQuality",
]

IOU_THRESHOLD = 0.5  # a pseudo box is correct at IoU >= this with a true box of its class
PREFIX = "pseudo"  # the keys' prefix: pseudo/precision_k, pseudo/boxes_k, pseudo/precision_teacher
TEACHER = "teacher"

# (boxes (G, 4), classes (G,) int64 in 0..C-1) of one image: pseudo boxes, or true boxes and labels.
Boxes = tuple[Tensor, Tensor]


@torch.no_grad()
def correct_pseudo_boxes(
    pseudo_boxes: Tensor,
    pseudo_classes: Tensor,
    true_boxes: Tensor,
    true_labels: Tensor,
    iou_threshold: float = IOU_THRESHOLD,
) -> Tensor:
    """(G,) bool: pseudo box g (``pseudo_boxes`` (G, 4) xyxy, class ``pseudo_classes[g]``) has IoU >=
    ``iou_threshold`` with some true box (``true_boxes`` (T, 4), ``true_labels`` (T,)) of its class. All
    False without true boxes; (0,) without pseudo boxes. The module docstring says why duplicates are
    each correct."""
    if len(pseudo_boxes) == 0 or len(true_boxes) == 0:
        return torch.zeros(len(pseudo_boxes), dtype=torch.bool, device=pseudo_boxes.device)
    true_boxes = true_boxes.to(pseudo_boxes.device, torch.float32).reshape(-1, 4)
    overlaps = box_iou(pseudo_boxes.float(), true_boxes)  # (G, T)
    same_class = pseudo_classes.reshape(-1, 1) == true_labels.to(pseudo_classes.device).reshape(1, -1)
    return ((overlaps >= iou_threshold) & same_class).any(dim=1)


def _counts(pseudo: Sequence[Boxes], truth: Sequence[Boxes], iou_threshold: float) -> tuple[Tensor, int, int]:
    """(correct boxes (a 0-dim int64 tensor on the boxes' device), all boxes, images) of paired images."""
    if len(pseudo) != len(truth):
        raise ValueError(f"{len(pseudo)} images of pseudo boxes for {len(truth)} of true boxes")
    correct, boxes = torch.zeros((), dtype=torch.int64), 0
    for (pseudo_boxes, pseudo_classes), (true_boxes, true_labels) in zip(pseudo, truth, strict=True):
        found = correct_pseudo_boxes(pseudo_boxes, pseudo_classes, true_boxes, true_labels, iou_threshold)
        correct = correct.to(found.device) + found.sum()  # no host sync: summed on the boxes' device
        boxes += len(pseudo_boxes)
    return correct, boxes, len(pseudo)


def _values(correct: float, boxes: float, images: float) -> dict[str, float]:
    """``{"boxes": per image, "precision": correct / boxes}``, precision left out without boxes and
    everything without images (the module docstring)."""
    if images == 0:
        return {}
    values = {"boxes": boxes / images}
    if boxes:
        values["precision"] = correct / boxes
    return values


def pseudo_label_quality(
    pseudo: Sequence[Boxes], truth: Sequence[Boxes], iou_threshold: float = IOU_THRESHOLD
) -> dict[str, float]:
    """One student's (or the teacher's) quality over a list of images: ``pseudo[i]`` (boxes (G_i, 4),
    classes (G_i,)) its pseudo boxes on image i, ``truth[i]`` (boxes (T_i, 4), labels (T_i,)) that
    image's true boxes, both in the same pixels. Returns ``{"boxes": mean G_i, "precision": correct /
    sum G_i}`` (the module docstring's rules: precision left out when sum G_i = 0, ``{}`` without
    images)."""
    correct, boxes, images = _counts(pseudo, truth, iou_threshold)
    return _values(int(correct), boxes, images)


@dataclass
class _Row:
    """One student's (or the teacher's) counts so far in a step."""

    correct: Tensor  # 0-dim int64 on the counting device: summed without a host sync
    boxes: int = 0
    images: int = 0


class PseudoLabelQuality:
    """The counts of one training step (its micro-batches' forwards, ``add``), as its ``pseudo/`` log
    values (``values``, summed over processes first). Rows: students 1..K, then the teacher.

    ``device``: where the counts are reduced (the model's: NCCL reduces CUDA tensors).
    """

    def __init__(self, device: torch.device | str = "cpu", iou_threshold: float = IOU_THRESHOLD) -> None:
        self.device, self.iou_threshold = torch.device(device), float(iou_threshold)
        self._rows: list[_Row] | None = None

    @torch.no_grad()
    def add(self, output: TrainingOutput, targets: Sequence[Mapping[str, Tensor]] | None) -> None:
        """Count one forward's pseudo boxes (``output.pseudo_labels``, ``output.teacher_pseudo_boxes``)
        against its images' true boxes (``targets[i]["true_boxes"]``, ``["true_labels"]``); images
        without them are left out."""
        with torch.autocast(self.device.type, enabled=False):  # the IoU of the float32 boxes as given
            self._add(output, targets or [])

    def _add(self, output: TrainingOutput, targets: Sequence[Mapping[str, Tensor]]) -> None:
        students = output.pseudo_labels or []
        if self._rows is None:
            zero = torch.zeros((), dtype=torch.int64, device=self.device)
            self._rows = [_Row(zero) for _ in range(len(students) + 1)]
        if len(students) + 1 != len(self._rows):
            raise ValueError(
                f"{len(students)} students' pseudo-labels after {len(self._rows) - 1} in one step"
            )
        judged = [i for i, target in enumerate(targets) if target.get(TRUE_BOXES) is not None]
        truth = [(targets[i][TRUE_BOXES], targets[i][TRUE_LABELS]) for i in judged]
        for row, records in zip(self._rows[:-1], students, strict=True):  # the teacher's row is last
            if any(records[i].pseudo_boxes is None for i in judged):
                continue  # a method that names no pseudo boxes: nothing to score
            self._count(row, [(records[i].pseudo_boxes, records[i].pseudo_classes) for i in judged], truth)
        teacher = output.teacher_pseudo_boxes
        if teacher is not None:
            self._count(self._rows[-1], [(teacher[i][0], teacher[i][1]) for i in judged], truth)

    def _count(self, row: _Row, pseudo: Sequence[Boxes], truth: Sequence[Boxes]) -> None:
        correct, boxes, images = _counts(pseudo, truth, self.iou_threshold)
        row.correct = row.correct + correct.to(self.device)
        row.boxes += boxes
        row.images += images

    def values(self) -> dict[str, float]:
        """``pseudo/precision_k``, ``pseudo/boxes_k`` per student and ``pseudo/precision_teacher``, from
        the counts summed over processes (every process calls it: it is a collective under DDP)."""
        if self._rows is None:
            return {}
        counts = torch.tensor([[0, row.boxes, row.images] for row in self._rows], device=self.device)
        counts[:, 0] = torch.stack([row.correct for row in self._rows])  # (K + 1, 3): correct, boxes, images
        if is_distributed():
            dist.all_reduce(counts)  # a sum: every process's images count once
        values: dict[str, float] = {}
        *students, teacher = counts.tolist()  # the step's one host sync
        for k, (correct, boxes, images) in enumerate(students, start=1):
            for name, value in _values(correct, boxes, images).items():
                values[f"{PREFIX}/{name}_{k}"] = value
        precision = _values(*teacher).get("precision")
        if precision is not None:
            values[f"{PREFIX}/precision_{TEACHER}"] = precision
        return values
