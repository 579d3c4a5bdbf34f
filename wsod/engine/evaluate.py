"""Score detections on a dataset: VOC mAP + CorLoc (VOC layout, toy) or COCO AP (COCO json)."""

from __future__ import annotations

from torch import Tensor
from torch.utils.data import Dataset

from wsod.data.coco import CocoDataset
from wsod.engine.inference import annotations_of
from wsod.evaluation import coco, voc

__all__ = ["evaluate_detections"]


def evaluate_detections(
    detections: list[dict[str, Tensor]], dataset: Dataset, *, metric: str = "voc07"
) -> tuple[dict[str, float], str]:
    """Metrics of ``detections`` (dataset order, original pixels) and a printable report.

    VOC-layout datasets: ``mAP`` (devkit AP, ``metric`` "voc07" or "area", IoU >= 0.5) and ``CorLoc``
    (IoU > 0.5), with a per-class table and a ``copypaste:`` line. COCO datasets: the 12 COCOeval stats
    (``AP``, ``AP50``, ...) through pycocotools.
    """
    if isinstance(dataset, CocoDataset):
        results = coco.to_coco_results(detections, dataset.image_ids, dataset.category_ids)
        stats = coco.evaluate_coco(results, dataset.annotation_file, image_ids=dataset.image_ids)
        return dict(stats), coco.format_coco_stats(stats)
    annotations = annotations_of(dataset)
    results = voc.evaluate(detections, annotations, dataset.num_classes, metric=metric)
    localisation = voc.corloc(detections, annotations, dataset.num_classes)
    report = voc.format_results(results, dataset.classes, localisation)
    return {"mAP": results["mAP"], "CorLoc": localisation["CorLoc"]}, report
