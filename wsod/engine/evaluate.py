"""The one evaluation path, for the end of training, periodic evaluation and tools/eval.py alike.

``Evaluator(dataset, ...)(model)`` predicts the test set with the configured test-time augmentation and
precision, scores it once (on the main process under torchrun) and returns detections, metrics and a
printable report; ``write_evaluation`` puts them on disk. Which scoring applies is decided here, in
``evaluate_detections``, by the test set and the metric the data config names:

- a test set with ground-truth boxes: ``voc07`` (11-point AP, VOC 2007) or ``area`` (VOC 2010 and later)
  give devkit AP + CorLoc; ``coco`` gives the COCOeval numbers of its json;
- a test set with image-level labels only (a folder dataset, a label-only COCO json): detection AP and
  CorLoc cannot be computed, and the report says so in one line; the image-level classification mAP
  (``cls_mAP``) of the detector's image scores (the MIL teacher's, docs/METHOD.md §10) is reported
  instead, its AP formula picked by the metric (``voc07``: 11-point, otherwise the area). Predictions
  are written all the same.

Each evaluation also carries per-class values (``AP_<class>``, or ``cls_AP_<class>``) and a few test
images with their top detections drawn, for the run's tensorboard (``RunLog.evaluation``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from wsod.data.dataset import RESULT_FORMATS, WeakDetectionDataset
from wsod.distributed import broadcast_object, is_main_process
from wsod.engine.checkpoint import save_checkpoint
from wsod.engine.inference import predict, random_detections
from wsod.engine.visualize import draw_detections, tag_safe
from wsod.evaluation import METRICS, classification, coco, voc
from wsod.modeling.protocol import Detector

__all__ = [
    "METRICS",
    "Evaluation",
    "Evaluator",
    "NO_BOXES",
    "RESULT_WRITERS",
    "evaluate_detections",
    "primary_metric",
    "random_baseline_line",
    "result_writer",
    "score_detections",
    "write_evaluation",
]

logger = logging.getLogger(__name__)

Detections = list[dict[str, Tensor]]
# The line a label-only evaluation prints instead of detection numbers.
NO_BOXES = "detection AP and CorLoc unavailable: the test set has no boxes (image-level labels only)"
# Tensorboard images of each evaluation: the first few test images, their best few detections.
PREVIEW_IMAGES = 4
PREVIEW_DETECTIONS = 5
PREVIEW_MAX_SIDE = 512


def primary_metric(metric: str, has_boxes: bool = True) -> str:
    """The metric name that ranks checkpoints (``model_best.pth``) for a data config's ``metric``, on a
    test set with boxes or (``has_boxes=False``) with image-level labels only."""
    if not has_boxes:
        return "cls_mAP"
    return "AP" if metric == "coco" else "mAP"


def evaluate_detections(
    detections: Detections, dataset: WeakDetectionDataset, *, metric: str = "voc07"
) -> tuple[dict[str, float], str]:
    """Metrics of ``detections`` (dataset order, original pixels) and a printable report.

    ``metric`` "voc07" or "area": devkit AP at IoU >= 0.5 (``mAP``), CorLoc at IoU > 0.5 (``CorLoc``), the
    share of top detections on a part of an object (``on_part``, the report's ``on a part`` mean) and,
    when the detections hold image scores, the image-level classification mAP (``cls_mAP``),
    with a per-class table and a ``copypaste:`` line. "coco": the 12 COCOeval stats (``AP``, ``AP50``,
    ...) through pycocotools, for a dataset whose ``result_format`` is "coco" (``CocoDataset``: it holds
    its ground truth as ``coco``). A dataset without ground-truth boxes: ``cls_mAP``, the classification
    mAP of the detections' ``image_scores`` (see the module docstring).
    """
    metrics, report, _ = score_detections(detections, dataset, metric=metric)
    return metrics, report


def score_detections(
    detections: Detections, dataset: WeakDetectionDataset, *, metric: str = "voc07"
) -> tuple[dict[str, float], str, dict[str, float]]:
    """``evaluate_detections``' metrics and report, and the per-class values: ``AP_<class>`` (VOC
    metrics), ``cls_AP_<class>`` (label-only data), none for COCOeval."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric '{metric}': expected one of {METRICS}")
    if not dataset.has_ground_truth:
        return _classification(detections, dataset, metric)
    if metric == "coco":
        if dataset.result_format != "coco":  # a COCO json's dataset: its ground truth and category ids
            raise ValueError(
                f"metric 'coco' needs a COCO json test set, not {type(dataset).__name__}; use voc07 or area"
            )
        results = coco.to_coco_results(detections, dataset.image_ids, dataset.category_ids)
        stats = coco.evaluate_coco(
            results, dataset.coco, image_ids=dataset.image_ids, source=dataset.annotation_file
        )  # the json as the loader normalised it (read once, kept on the dataset), not the raw file
        return dict(stats), coco.format_coco_stats(stats), {}
    annotations = dataset.ground_truth()
    results = voc.evaluate(detections, annotations, dataset.num_classes, metric=metric)
    localisation = voc.corloc(detections, annotations, dataset.num_classes)
    per_class = {f"AP_{name}": ap for name, ap in zip(dataset.classes, results["ap"], strict=True)}
    metrics = {"mAP": results["mAP"], "CorLoc": localisation["CorLoc"], "on_part": localisation["OnPart"]}
    notes = []
    if detections and all("image_scores" in d for d in detections):
        # Whether the detector knows *which* classes an image holds, apart from where they are: a weak
        # detector at chance here has not learnt the classes yet, whatever its boxes.
        cls_map = metrics["cls_mAP"] = _image_classification(detections, dataset, metric)["cls_mAP"]
        notes.append(f"image-level classification mAP (image scores vs labels): {100 * cls_map:.2f}")
    return metrics, voc.format_results(results, dataset.classes, localisation, notes), per_class


def random_baseline_line(chance: dict[str, float]) -> str:
    """The report line of the chance level, in percent; undefined values (COCOeval's -1, NaN) print as
    "-", as the tables above it print them (metrics.json keeps the raw numbers)."""
    values = ", ".join(f"{k} {coco.format_percent(v, missing='-')}" for k, v in chance.items())
    return "random scores over the same proposals: " + values


def _classification(
    detections: Detections, dataset: WeakDetectionDataset, metric: str
) -> tuple[dict[str, float], str, dict[str, float]]:
    """Label-only data: classification mAP of the image scores against the image labels."""
    if len(detections) != len(dataset):
        raise ValueError(f"{len(detections)} images of predictions for a test set of {len(dataset)}")
    missing = sum("image_scores" not in d for d in detections)
    if missing:
        raise ValueError(
            f"{missing} of {len(detections)} predictions hold no image scores (predictions written by an"
            " older wsod?); the label-only test set is scored by them: evaluate without predictions= to"
            " recompute them"
        )
    results = _image_classification(detections, dataset, metric)
    report = NO_BOXES + "\n" + classification.format_classification(results, dataset.classes)
    per_class = {f"cls_AP_{name}": ap for name, ap in zip(dataset.classes, results["ap"], strict=True)}
    return {"cls_mAP": results["cls_mAP"]}, report, per_class


def _image_classification(
    detections: Detections, dataset: WeakDetectionDataset, metric: str
) -> dict[str, Any]:
    """``classification_ap`` of the detections' ``image_scores`` (C,) per image against the dataset's image
    labels, with the devkit's 11-point AP for "voc07", the area under the envelope otherwise."""
    scores = torch.stack([torch.as_tensor(d["image_scores"]).reshape(-1) for d in detections])
    labels = torch.stack([torch.as_tensor(r.labels) for r in dataset.records])
    return classification.classification_ap(scores, labels, "voc07" if metric == "voc07" else "area")


@dataclass
class Evaluation:
    """Detections (on the main process; ``None`` elsewhere under torchrun), metrics and report.

    ``extra``: the random baseline (``random_<metric>``); ``per_class``: ``AP_<class>`` or
    ``cls_AP_<class>``; ``previews``: tensorboard tag -> uint8 (3, H, W) test image with its top
    detections drawn (main process only).
    """

    detections: Detections | None
    metrics: dict[str, float]
    report: str
    extra: dict[str, float] = field(default_factory=dict)
    per_class: dict[str, float] = field(default_factory=dict)
    previews: dict[str, Tensor] = field(default_factory=dict)

    @property
    def values(self) -> dict[str, float]:
        """Everything numeric: the metrics, the per-class values and the random baseline."""
        return {**self.metrics, **self.per_class, **self.extra}


class Evaluator:
    """Predict and score ``dataset`` (built without a transform) with fixed test settings.

    Args:
        scales, max_size, flip: test views (each scale, each flipped too), averaged per ROI.
        batch_size, num_workers: the test loader.
        amp: None (full precision) or "bf16"/"fp16" on CUDA.
        metric: "voc07", "area" or "coco" (see ``evaluate_detections``).
        random_baseline: whether a call without ``random_baseline=`` also scores random scores (computed
            once and kept: they depend on the test set and the model's post-processing settings only).
    """

    def __init__(
        self,
        dataset: WeakDetectionDataset,
        *,
        scales: Sequence[int],
        max_size: int | None,
        flip: bool = False,
        batch_size: int = 1,
        num_workers: int = 2,
        amp: str | None = None,
        metric: str = "voc07",
        device: torch.device | str = "cpu",
        progress: bool = True,
        random_baseline: bool = False,
    ) -> None:
        if metric not in METRICS:
            raise ValueError(f"unknown metric '{metric}': expected one of {METRICS}")
        result_writer(dataset)  # a dataset whose results cannot be written: refused before any prediction
        self.dataset = dataset
        self.scales, self.max_size, self.flip = list(scales), max_size, flip
        self.batch_size, self.num_workers = batch_size, num_workers
        self.amp, self.metric, self.device = amp, metric, torch.device(device)
        self.progress = progress
        self.random_baseline = random_baseline
        self._chance: tuple[tuple, dict[str, float]] | None = None

    @property
    def primary_metric(self) -> str:
        return primary_metric(self.metric, self.dataset.has_ground_truth)

    def __call__(self, model: Detector, *, random_baseline: bool | None = None) -> Evaluation:
        """Predict, then ``score`` (``random_baseline`` None: the evaluator's setting)."""
        detections = predict(
            model, self.dataset, scales=self.scales, max_size=self.max_size, flip=self.flip,
            batch_size=self.batch_size, num_workers=self.num_workers, device=self.device, amp=self.amp,
            progress=self.progress,
        )  # fmt: skip
        return self.score(detections, model, random_baseline=random_baseline)

    def score(
        self,
        detections: Detections | None,
        model: Detector,
        *,
        random_baseline: bool | None = None,
    ) -> Evaluation:
        """Score ``detections`` on the main process (the others pass ``None``) and share the result.
        ``random_baseline``: also score uniformly random class scores over the same proposals through
        the model's post-processing (the chance level), in ``Evaluation.extra`` (None: the evaluator's
        setting)."""
        if random_baseline is None:
            random_baseline = self.random_baseline
        scored = None
        if is_main_process():
            metrics, report, per_class = score_detections(detections, self.dataset, metric=self.metric)
            extra = {}
            if random_baseline:
                chance = self._chance_level(model)
                extra = {f"random_{k}": v for k, v in chance.items()}
                report += "\n" + random_baseline_line(chance)
            scored = (metrics, report, extra, per_class)
        metrics, report, extra, per_class = broadcast_object(scored)
        previews = self._previews(detections) if is_main_process() else {}
        return Evaluation(detections, metrics, report, extra, per_class, previews)

    def _chance_level(self, model: Detector) -> dict[str, float]:
        """The metrics of ``random_detections``, computed once per post-processing setting."""
        key = (model.num_classes, model.detection_settings)
        if self._chance is None or self._chance[0] != key:
            chance, _ = evaluate_detections(
                random_detections(self.dataset, model), self.dataset, metric=self.metric
            )
            self._chance = (key, chance)
        return self._chance[1]

    def _previews(self, detections: Detections) -> dict[str, Tensor]:
        """The first ``PREVIEW_IMAGES`` test images with their ``PREVIEW_DETECTIONS`` best detections
        (and ground-truth boxes in white, where the set has them), under fixed tags."""
        previews = {}
        for index in range(min(PREVIEW_IMAGES, len(self.dataset))):
            item = self.dataset[index]
            image = draw_detections(
                item["image"], detections[index], self.dataset.classes, top=PREVIEW_DETECTIONS,
                ground_truth=item.get("gt_boxes"), max_side=PREVIEW_MAX_SIDE,
            )  # fmt: skip
            previews[f"detections/{index}_{tag_safe(item['image_id'])}"] = image
        return previews


def _write_voc_results(detections: Detections, dataset: WeakDetectionDataset, out_dir: Path) -> None:
    image_ids = [str(i) for i in dataset.image_ids]
    voc.write_voc_results(detections, image_ids, dataset.classes, out_dir / "voc_results")


def _write_coco_results(detections: Detections, dataset: WeakDetectionDataset, out_dir: Path) -> None:
    results = coco.to_coco_results(detections, dataset.image_ids, dataset.category_ids)
    coco.save_coco_results(results, out_dir / "coco_results.json")


def _write_named_results(detections: Detections, dataset: WeakDetectionDataset, out_dir: Path) -> None:
    # tools/predict.py's format: file names, not devkit ids
    results = coco.to_named_results(detections, [str(i) for i in dataset.image_ids], dataset.classes)
    coco.save_coco_results(results, out_dir / "predictions.json")


# A dataset's ``result_format`` (``wsod.data.dataset.RESULT_FORMATS``) -> what writes its detections.
RESULT_WRITERS = {"voc": _write_voc_results, "coco": _write_coco_results, "named": _write_named_results}


def result_writer(dataset: WeakDetectionDataset) -> Callable[[Detections, WeakDetectionDataset, Path], None]:
    """What writes ``dataset``'s detections: the writer of its ``result_format``; one line when the
    dataset names a format no writer has (checked when an ``Evaluator`` is made, not after a run)."""
    writer = RESULT_WRITERS.get(dataset.result_format)
    if writer is None:
        raise ValueError(
            f"{type(dataset).__name__}.result_format is {dataset.result_format!r}; expected one of"
            f" {list(RESULT_FORMATS)} (wsod.data.dataset.RESULT_FORMATS)"
        )
    return writer


def write_evaluation(evaluation: Evaluation, dataset: WeakDetectionDataset, out_dir: str | Path) -> None:
    """On the main process: predictions.pth, metrics.json (with the random baseline), report.txt, and
    the result files of the dataset's ``result_format`` (``RESULT_WRITERS``): VOC devkit result files
    (``voc_results/``), a COCO results json (``coco_results.json``), or ``predictions.json`` under the
    image file names (``coco.to_named_results``, the format of tools/predict.py; a folder dataset's);
    logs the report."""
    if not is_main_process():
        return
    writer = result_writer(dataset)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    detections = evaluation.detections
    save_checkpoint({"detections": detections, "image_ids": dataset.image_ids}, out_dir / "predictions.pth")
    metrics = {**evaluation.metrics, **evaluation.extra}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out_dir / "report.txt").write_text(evaluation.report + "\n")
    writer(detections, dataset, out_dir)
    logger.info("results on %d test images (written to %s):\n%s", len(dataset), out_dir, evaluation.report)
