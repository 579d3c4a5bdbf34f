"""Datasets (VOC, COCO, label-only json, a folder of your own images, the toy set), proposal files,
transforms and batching. ``DATASET_FORMATS`` (``wsod.data.formats``) names each ``data.kind``;
``register_dataset_format`` adds one.

Conventions (written once, here and in ``box_formats``): boxes are float32 ``x1 y1 x2 y2`` pixels,
0-based inclusive for VOC-style data and proposals; image labels are (C,) float32 multi-hot over the
foreground classes 0..C-1; ground-truth labels index the same classes. Each image's training
supervision travels as one ``targets`` dict (``labels`` plus optional points, scribbles and boxes, moved
with the image by every transform): the field convention is ``wsod.data.targets``'s.
"""

from wsod.data.coco import CocoDataset
from wsod.data.dataset import ConcatWeakDataset, ImageRecord, WeakDetectionDataset
from wsod.data.folder import FolderDataset
from wsod.data.formats import DATASET_FORMATS, DatasetFormat, register_dataset_format
from wsod.data.loader import build_test_loader, build_train_loader, collate, infinite_batches, model_inputs
from wsod.data.proposals import (
    MissingProposalsError,
    ProposalSet,
    ProposalStore,
    convert_proposals,
    load_proposals,
    save_proposals,
)
from wsod.data.toy import TOY_CLASSES, ToyDataset, ensure_toy_dataset
from wsod.data.transforms import DetectionTransform, test_transform, train_transform
from wsod.data.voc import VOC_CLASSES, VOCDataset

__all__ = [
    "CocoDataset",
    "ConcatWeakDataset",
    "DATASET_FORMATS",
    "DatasetFormat",
    "DetectionTransform",
    "FolderDataset",
    "ImageRecord",
    "MissingProposalsError",
    "ProposalSet",
    "ProposalStore",
    "TOY_CLASSES",
    "ToyDataset",
    "VOCDataset",
    "VOC_CLASSES",
    "WeakDetectionDataset",
    "build_test_loader",
    "build_train_loader",
    "collate",
    "convert_proposals",
    "ensure_toy_dataset",
    "infinite_batches",
    "load_proposals",
    "model_inputs",
    "register_dataset_format",
    "save_proposals",
    "test_transform",
    "train_transform",
]
