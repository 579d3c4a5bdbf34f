"""Detection metrics: PASCAL VOC AP / mAP and CorLoc (``voc``), COCO through pycocotools (``coco``)."""
