"""Detection metrics: PASCAL VOC AP / mAP and CorLoc (``voc``), COCO through pycocotools (``coco``)."""

from wsod.evaluation.voc import METRICS as VOC_METRICS

__all__ = ["METRICS"]

# Every value of data.test.metric: the devkit's two AP rules (``voc``), and COCO's AP (``coco``). Here,
# with the metrics, so that the config checks can name them without importing the evaluation engine.
METRICS = (*VOC_METRICS, "coco")
