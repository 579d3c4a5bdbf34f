"""The one evaluation path, for the end of training, periodic evaluation and tools/eval.py alike.

``Evaluator(dataset, ...)(model)`` predicts the test set with the configured test-time augmentation and
precision, scores it once (on the main process under torchrun) and returns detections, metrics and a
printable report; ``write_evaluation`` puts them on disk. Which scoring applies is decided here, by the
metric the data config names: ``voc07`` (11-point AP, VOC 2007) or ``area`` (VOC 2010 and later) give
devkit AP + CorLoc on the dataset's ground truth; ``coco`` gives the COCOeval numbers of its json.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from wsod.data.coco import CocoDataset
from wsod.data.dataset import WeakDetectionDataset
from wsod.distributed import broadcast_object, is_main_process
from wsod.engine.checkpoint import save_checkpoint
from wsod.engine.inference import predict, random_detections
from wsod.evaluation import coco, voc
from wsod.modeling.detector import WeaklySupervisedDetector

__all__ = [
    "METRICS",
    "Evaluation",
    "Evaluator",
    "evaluate_detections",
    "primary_metric",
    "write_evaluation",
]

logger = logging.getLogger(__name__)

METRICS = (*voc.METRICS, "coco")
Detections = list[dict[str, Tensor]]


def primary_metric(metric: str) -> str:
    """The metric name that ranks checkpoints (``model_best.pth``) for a data config's ``metric``."""
    return "AP" if metric == "coco" else "mAP"


def evaluate_detections(
    detections: Detections, dataset: WeakDetectionDataset, *, metric: str = "voc07"
) -> tuple[dict[str, float], str]:
    """Metrics of ``detections`` (dataset order, original pixels) and a printable report.

    ``metric`` "voc07" or "area": devkit AP at IoU >= 0.5 (``mAP``) and CorLoc at IoU > 0.5 (``CorLoc``),
    with a per-class table and a ``copypaste:`` line. "coco": the 12 COCOeval stats (``AP``, ``AP50``,
    ...) through pycocotools, for a ``CocoDataset``.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric '{metric}': expected one of {METRICS}")
    if metric == "coco":
        if not isinstance(dataset, CocoDataset):
            raise ValueError(
                f"metric 'coco' needs a COCO json test set, not {type(dataset).__name__}; use voc07 or area"
            )
        results = coco.to_coco_results(detections, dataset.image_ids, dataset.category_ids)
        stats = coco.evaluate_coco(results, dataset.annotation_file, image_ids=dataset.image_ids)
        return dict(stats), coco.format_coco_stats(stats)
    annotations = dataset.ground_truth()
    results = voc.evaluate(detections, annotations, dataset.num_classes, metric=metric)
    localisation = voc.corloc(detections, annotations, dataset.num_classes)
    report = voc.format_results(results, dataset.classes, localisation)
    return {"mAP": results["mAP"], "CorLoc": localisation["CorLoc"]}, report


@dataclass
class Evaluation:
    """Detections (on the main process; ``None`` elsewhere under torchrun), metrics and report."""

    detections: Detections | None
    metrics: dict[str, float]
    report: str
    extra: dict[str, float] = field(default_factory=dict)


class Evaluator:
    """Predict and score ``dataset`` (built without a transform) with fixed test settings.

    Args:
        scales, max_size, flip: test views (each scale, each flipped too), averaged per ROI.
        batch_size, num_workers: the test loader.
        amp: None (full precision) or "bf16"/"fp16" on CUDA.
        metric: "voc07", "area" or "coco" (see ``evaluate_detections``).
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
    ) -> None:
        if metric not in METRICS:
            raise ValueError(f"unknown metric '{metric}': expected one of {METRICS}")
        self.dataset = dataset
        self.scales, self.max_size, self.flip = list(scales), max_size, flip
        self.batch_size, self.num_workers = batch_size, num_workers
        self.amp, self.metric, self.device = amp, metric, torch.device(device)
        self.progress = progress

    @property
    def primary_metric(self) -> str:
        return primary_metric(self.metric)

    def __call__(self, model: WeaklySupervisedDetector, *, random_baseline: bool = False) -> Evaluation:
        """Predict, then ``score``."""
        detections = predict(
            model, self.dataset, scales=self.scales, max_size=self.max_size, flip=self.flip,
            batch_size=self.batch_size, num_workers=self.num_workers, device=self.device, amp=self.amp,
            progress=self.progress,
        )  # fmt: skip
        return self.score(detections, model, random_baseline=random_baseline)

    def score(
        self, detections: Detections | None, model: WeaklySupervisedDetector, *, random_baseline: bool = False
    ) -> Evaluation:
        """Score ``detections`` on the main process (the others pass ``None``) and share the result.
        ``random_baseline``: also score uniformly random class scores over the same proposals through
        the model's post-processing (the chance level), in ``Evaluation.extra``."""
        scored = None
        if is_main_process():
            metrics, report = evaluate_detections(detections, self.dataset, metric=self.metric)
            extra = {}
            if random_baseline:
                chance, _ = evaluate_detections(
                    random_detections(self.dataset, model), self.dataset, metric=self.metric
                )
                extra = {f"random_{k}": v for k, v in chance.items()}
                report += "\nrandom scores over the same proposals: " + ", ".join(
                    f"{k} {100 * v:.2f}" for k, v in chance.items()
                )
            scored = (metrics, report, extra)
        metrics, report, extra = broadcast_object(scored)
        return Evaluation(detections, metrics, report, extra)


def write_evaluation(evaluation: Evaluation, dataset: WeakDetectionDataset, out_dir: str | Path) -> None:
    """On the main process: predictions.pth, metrics.json (with the random baseline), report.txt, and
    VOC devkit result files (``voc_results/``) or a COCO results json; logs the report."""
    if not is_main_process():
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    detections = evaluation.detections
    save_checkpoint({"detections": detections, "image_ids": dataset.image_ids}, out_dir / "predictions.pth")
    metrics = {**evaluation.metrics, **evaluation.extra}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out_dir / "report.txt").write_text(evaluation.report + "\n")
    if isinstance(dataset, CocoDataset):
        results = coco.to_coco_results(detections, dataset.image_ids, dataset.category_ids)
        coco.save_coco_results(results, out_dir / "coco_results.json")
    else:
        image_ids = [str(i) for i in dataset.image_ids]
        voc.write_voc_results(detections, image_ids, dataset.classes, out_dir / "voc_results")
    logger.info("results on %d test images (written to %s):\n%s", len(dataset), out_dir, evaluation.report)
