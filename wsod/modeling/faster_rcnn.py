"""The second stage: torchvision's Faster R-CNN (FPN) behind wsod's detector interface.

A fully-supervised detector retrained on the pseudo boxes a weakly-supervised model exported
(``tools/export_pseudo_labels.py``, docs/METHOD.md §11). Anchors, the RPN, the box head, the losses and
the post-processing are torchvision's (``torchvision.models.detection.FasterRCNN``); what this file adds
is the seam to the rest of wsod:

- the batch of ``wsod.data.loader.collate`` goes in as is (``model(**model_inputs(batch))``, the
  training loop's call); the targets are each item's ``boxes`` / ``box_labels`` (the pseudo boxes,
  ``wsod.data.pseudo_boxes``), resized and flipped with the image by wsod's own transforms.
  torchvision's transform therefore neither resizes nor normalises again (``PreparedImageTransform``):
  the data config's scales are the only ones, as for the weakly-supervised model, and the same seeded
  augmentation stream makes a resumed run exact. Proposals in the batch are ignored: the RPN makes its own.
- boxes follow wsod's convention at the boundary (``wsod.data.box_formats``: 0-based inclusive
  ``x2, y2``): a target's ``x2 + 1`` (in resized pixels: ``+ w / W``) is torchvision's continuous corner,
  and detections come back with ``x2 - 1``, in original pixels, so that the devkit scores both stages
  alike. torchvision's labels are 1..C (0 is its background); wsod's 0..C-1.
- it implements the detector contract (``wsod.modeling.protocol.Detector``): ``predict_view`` (one
  view of a batch, torchvision's detections with the caller's ``DetectionSettings``, flips undone) and
  ``merge_views`` (the views' detections merged by NMS) serve ``wsod.engine.inference.predict``;
  ``postprocess`` (per-class NMS of per-ROI scores) serves the random baseline.

The backbone is wsod's ResNet trunk (``wsod.modeling.resnet.build_resnet_trunk``: ImageNet weights by
torchvision name or local file, a width multiplier for the CPU toy, frozen or train-mode BatchNorm)
read through torchvision's ``BackboneWithFPN`` at strides 4 to 32, plus the max-pooled level at 64.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import concat_box_prediction_layers
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from wsod.modeling.detector import per_class_nms, postprocess_rois
from wsod.modeling.frozen_bn import freeze_batchnorm
from wsod.modeling.method import TrainingProgress
from wsod.modeling.protocol import DetectionSettings, TrainingOutput, check_keep, unflip_boxes
from wsod.modeling.resnet import build_resnet_trunk, stage_channels

__all__ = [
    "ARCHITECTURE",
    "FasterRCNNDetector",
    "PreparedImageTransform",
    "build_faster_rcnn",
    "merge_views",
]

# The ``metadata["architecture"]`` of a second-stage checkpoint (``wsod.build.load_detector`` reads it;
# weakly-supervised checkpoints have none).
ARCHITECTURE = "faster_rcnn"


class PreparedImageTransform(GeneralizedRCNNTransform):
    """torchvision's detection transform for images that wsod's data pipeline has already resized and
    normalised: it only batches (pads to a multiple of 32) and maps boxes back, which is the identity
    here. Resizing twice would blur the images, and torchvision's random training scale would be a
    second augmentation outside each item's seeded stream (``wsod.data.loader``)."""

    def normalize(self, image: Tensor) -> Tensor:
        return image

    def resize(self, image: Tensor, target: dict[str, Tensor] | None = None) -> tuple[Tensor, dict | None]:
        return image, target


class FasterRCNNDetector(nn.Module):
    """``detector`` (a torchvision ``FasterRCNN`` of ``num_classes + 1`` classes) with wsod's inputs and
    outputs (the module docstring)."""

    loss_names = ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg")

    def __init__(self, detector: FasterRCNN, num_classes: int) -> None:
        super().__init__()
        self.detector = detector
        self._num_classes = num_classes

    @property
    def num_classes(self) -> int:
        return self._num_classes

    @property
    def detection_settings(self) -> DetectionSettings:
        """Its own post-processing settings: torchvision's ``box_score_thresh``, ``box_nms_thresh`` and
        ``box_detections_per_img``."""
        heads = self.detector.roi_heads
        return DetectionSettings(heads.score_thresh, heads.nms_thresh, heads.detections_per_img)

    # Its region proposal network makes the boxes: prediction needs none from the data.
    makes_proposals = True

    def module_groups(self) -> dict[str, list[nn.Module]]:
        """The EMA teacher's groups: the ResNet trunk, the FPN, and the RPN with the box head."""
        backbone = self.detector.backbone
        return {
            "backbone": [backbone.body],
            "neck": [backbone.fpn],
            "heads": [self.detector.rpn, self.detector.roi_heads],
        }

    def teacher_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """As a teacher: nothing (a second-stage student reads no teacher output; the third stage's
        ``SemiSupervisedFasterRCNN`` gives its detections here)."""
        return {}

    def forward(
        self,
        images: Tensor,
        proposals: Sequence[Tensor] | None = None,
        image_labels: Tensor | None = None,
        image_sizes: Sequence[tuple[int, int]] | None = None,
        original_sizes: Sequence[tuple[int, int]] | None = None,
        targets: Sequence[dict[str, Tensor]] | None = None,
        views: int = 1,
        *,
        progress: TrainingProgress | None = None,
        keep: Collection[str] = (),
    ) -> TrainingOutput:
        """Training losses of a collated batch: images (B, 3, Hp, Wp) padded, ``image_sizes`` their
        unpadded (h, w), ``original_sizes`` (H, W) on disk, ``targets`` with ``boxes`` (G, 4) in resized
        pixels and ``box_labels`` (G,) in 0..C-1. ``proposals`` and ``image_labels`` are not used; each
        of ``views`` views is an image of its own; ``progress`` is not used either (its losses follow no
        schedule). ``keep``: torchvision's heads expose no ROI features, so only ``()`` is accepted."""
        self._check_training_call(keep, targets, image_sizes, original_sizes)
        missing = [i for i, t in enumerate(targets) if "boxes" not in t or "box_labels" not in t]
        if missing:
            raise ValueError(
                f"images {missing} of the batch have no boxes/box_labels targets: the second stage trains"
                " on the pseudo boxes of tools/export_pseudo_labels.py (pseudo_labels=...)"
            )
        rows = range(len(targets))
        return TrainingOutput(
            self._losses(
                images,
                image_sizes,
                self._torchvision_targets(targets, image_sizes, original_sizes, rows),
                rows,
            )
        )

    def _check_training_call(
        self,
        keep: Collection[str],
        targets: Sequence[dict[str, Tensor]] | None,
        image_sizes: Sequence[tuple[int, int]] | None,
        original_sizes: Sequence[tuple[int, int]] | None,
    ) -> None:
        """What every training forward of this detector refuses: a ``keep`` (torchvision's heads expose
        no ROI features), eval mode, a batch without sizes or targets."""
        name = type(self).__name__
        if check_keep(keep):
            raise ValueError(f"{name} keeps nothing besides its losses, asked for {sorted(keep)}")
        if not self.training:
            raise RuntimeError(f"{name}.forward computes training losses; predict_view predicts")
        if targets is None or image_sizes is None or original_sizes is None:
            raise ValueError(f"{name}.forward needs image_sizes, original_sizes and targets")

    @staticmethod
    def _torchvision_targets(
        targets: Sequence[dict[str, Tensor]],
        image_sizes: Sequence[tuple[int, int]],
        original_sizes: Sequence[tuple[int, int]],
        rows: Sequence[int],
    ) -> list[dict[str, Tensor]]:
        """The wsod targets of batch ``rows`` (``boxes`` in resized pixels, ``box_labels`` 0..C-1) as
        torchvision's (continuous boxes, labels 1..C)."""
        return [
            {
                "boxes": _to_continuous(targets[r]["boxes"], image_sizes[r], original_sizes[r]),
                "labels": targets[r]["box_labels"].long() + 1,
            }
            for r in rows
        ]

    def _losses(
        self,
        images: Tensor,
        image_sizes: Sequence[tuple[int, int]],
        targets: Sequence[dict[str, Tensor]],
        rows: Sequence[int],
    ) -> dict[str, Tensor]:
        """torchvision's four training losses on batch ``rows`` with their torchvision ``targets``."""
        unpadded = [images[r, :, : image_sizes[r][0], : image_sizes[r][1]] for r in rows]  # views, no copy
        return self.detector(unpadded, list(targets))

    @torch.no_grad()
    def detect(
        self,
        images: Tensor,
        image_sizes: Sequence[tuple[int, int]],
        original_sizes: Sequence[tuple[int, int]],
        settings: DetectionSettings | None = None,
    ) -> list[dict[str, Tensor]]:
        """One view's detections per image: ``boxes`` (D, 4) wsod boxes in original pixels, ``scores``
        (D,), ``labels`` (D,) in 0..C-1, after torchvision's per-class NMS and score threshold
        (``settings``; its own when None)."""
        was_training = self.training
        self.eval()
        with _roi_heads_settings(self.detector.roi_heads, settings or self.detection_settings):
            outputs = self.detector(_unpadded(images, image_sizes))
        self.train(was_training)
        return [
            {
                "boxes": _to_inclusive(out["boxes"], size, original),
                "scores": out["scores"],
                "labels": out["labels"] - 1,
            }
            for out, size, original in zip(outputs, image_sizes, original_sizes, strict=True)
        ]

    @torch.no_grad()
    def propose(
        self,
        images: Tensor,
        image_sizes: Sequence[tuple[int, int]],
        original_sizes: Sequence[tuple[int, int]],
        *,
        pre_nms_top_n: int,
        post_nms_top_n: int,
        nms_iou: float,
    ) -> list[dict[str, Tensor]]:
        """The region proposal network's class-agnostic boxes of one view per image: ``boxes`` (P, 4) wsod
        boxes in original pixels, best first, ``scores`` (P,) their objectness probabilities. torchvision's
        own steps (``RegionProposalNetwork.forward`` up to ``filter_proposals``, which returns the scores
        its forward drops): the ``pre_nms_top_n`` best anchors per FPN level, NMS at ``nms_iou`` per
        level, the ``post_nms_top_n`` best of the image; the RPN's own settings are restored after."""
        rpn = self.detector.rpn
        was_training = self.training
        saved = (dict(rpn._pre_nms_top_n), dict(rpn._post_nms_top_n), rpn.nms_thresh)
        self.eval()
        try:
            rpn._pre_nms_top_n["testing"], rpn._post_nms_top_n["testing"] = pre_nms_top_n, post_nms_top_n
            rpn.nms_thresh = nms_iou
            image_list, _ = self.detector.transform(_unpadded(images, image_sizes))
            features = list(self.detector.backbone(image_list.tensors).values())
            objectness, deltas = rpn.head(features)
            anchors = rpn.anchor_generator(image_list, features)
            per_level = [o[0].numel() for o in objectness]
            objectness, deltas = concat_box_prediction_layers(objectness, deltas)
            proposals = rpn.box_coder.decode(deltas, anchors).view(len(anchors), -1, 4)
            boxes, scores = rpn.filter_proposals(proposals, objectness, image_list.image_sizes, per_level)
        finally:
            rpn._pre_nms_top_n, rpn._post_nms_top_n, rpn.nms_thresh = saved
            self.train(was_training)
        found = []
        for box, score, size, original in zip(boxes, scores, image_sizes, original_sizes, strict=True):
            order = torch.argsort(score, descending=True, stable=True)  # per-level NMS leaves levels apart
            found.append({"boxes": _to_inclusive(box[order], size, original), "scores": score[order]})
        return found

    def predict_view(
        self, inputs: Mapping[str, Any], flipped: Sequence[bool], settings: DetectionSettings
    ) -> list[dict[str, Tensor]]:
        """One test view of a batch -> per image its detections (``detect``), flips mirrored back."""
        found = self.detect(inputs["images"], inputs["image_sizes"], inputs["original_sizes"], settings)
        return [
            {**det, "boxes": unflip_boxes(det["boxes"].float(), size[1]) if flip else det["boxes"].float(),
             "scores": det["scores"].float()}
            for det, size, flip in zip(found, inputs["original_sizes"], flipped, strict=True)
        ]  # fmt: skip

    def merge_views(
        self, views: Sequence[dict[str, Tensor]], settings: DetectionSettings
    ) -> dict[str, Tensor]:
        """One image's detections of every view -> one set (``merge_views``: union, per-class NMS)."""
        return merge_views(
            views, nms_iou=settings.nms_iou, detections_per_image=settings.detections_per_image,
            num_classes=self.num_classes,
        )  # fmt: skip

    def postprocess(
        self, scores: Tensor, boxes: Tensor, settings: DetectionSettings | None = None
    ) -> dict[str, Tensor]:
        """Per-ROI scores (R, C+1) and boxes (R, C+1, 4) -> detections, with ``settings`` (its own,
        torchvision's rules, when None; the evaluator's chance level calls it)."""
        settings = settings or self.detection_settings
        return postprocess_rois(
            scores, boxes, score_threshold=settings.score_threshold, nms_iou=settings.nms_iou,
            detections_per_image=settings.detections_per_image,
        )  # fmt: skip


@contextmanager
def _roi_heads_settings(heads: RoIHeads, settings: DetectionSettings) -> Iterator[None]:
    """torchvision's box head post-processes with its own attributes: set for one call, then restored,
    so that a caller's settings (the export's cap) never outlive the call."""
    saved = (heads.score_thresh, heads.nms_thresh, heads.detections_per_img)
    heads.score_thresh, heads.nms_thresh = settings.score_threshold, settings.nms_iou
    heads.detections_per_img = settings.detections_per_image
    try:
        yield
    finally:
        heads.score_thresh, heads.nms_thresh, heads.detections_per_img = saved


def merge_views(
    views: Sequence[dict[str, Tensor]], *, nms_iou: float, detections_per_image: int, num_classes: int
) -> dict[str, Tensor]:
    """One image's detections of several test views (each in original pixels, flips undone) -> one set:
    per-class NMS over their union, the best ``detections_per_image``; ``image_scores`` (C,) is each
    class's best score (0 where it has none), the image-level score a label-only test set is scored by."""
    boxes = torch.cat([v["boxes"] for v in views])
    scores = torch.cat([v["scores"] for v in views])
    labels = torch.cat([v["labels"] for v in views])
    # One view's detections passed the same NMS already: NMS again keeps them all.
    merged = per_class_nms(boxes, scores, labels, None, nms_iou, detections_per_image)
    image_scores = torch.zeros(num_classes, dtype=scores.dtype, device=scores.device)
    image_scores.scatter_reduce_(0, merged["labels"], merged["scores"], reduce="amax")
    merged["image_scores"] = image_scores
    return merged


def _unpadded(images: Tensor, image_sizes: Sequence[tuple[int, int]]) -> list[Tensor]:
    return [image[:, :h, :w] for image, (h, w) in zip(images, image_sizes, strict=True)]


def _to_continuous(boxes: Tensor, size: tuple[int, int], original: tuple[int, int]) -> Tensor:
    """wsod boxes in resized pixels (inclusive ``x2, y2`` of the original grid, scaled) -> continuous
    corners: one original pixel (``w / W`` resized pixels) past the last covered column and row."""
    step = boxes.new_tensor([0.0, 0.0, size[1] / original[1], size[0] / original[0]])
    return boxes.float().reshape(-1, 4) + step


def _to_inclusive(boxes: Tensor, size: tuple[int, int], original: tuple[int, int]) -> Tensor:
    """torchvision's continuous boxes in resized pixels -> wsod boxes in original pixels."""
    scale = boxes.new_tensor([original[1] / size[1], original[0] / size[0]] * 2)
    out = boxes * scale - boxes.new_tensor([0.0, 0.0, 1.0, 1.0])
    # A box narrower than one pixel keeps x2 >= x1 (the devkit's width x2 - x1 + 1 stays positive).
    out[:, 2:] = torch.maximum(out[:, 2:], out[:, :2])
    return out


def build_faster_rcnn(
    num_classes: int,
    *,
    backbone: str = "resnet50",
    width: float = 1.0,
    weights: str | None = "IMAGENET1K_V1",
    norm: str = "frozen_bn",
    neck_norm: str | None = None,
    freeze_at: int = 2,
    stem_pool: bool = True,
    fpn_channels: int = 256,
    anchor_sizes: Sequence[int] = (32, 64, 128, 256, 512),
    aspect_ratios: Sequence[float] = (0.5, 1.0, 2.0),
    rpn_pre_nms_top_n_train: int = 2000,
    rpn_post_nms_top_n_train: int = 2000,
    rpn_pre_nms_top_n_test: int = 1000,
    rpn_post_nms_top_n_test: int = 1000,
    rpn_batch_size_per_image: int = 256,
    rpn_positive_fraction: float = 0.5,
    box_batch_size_per_image: int = 512,
    representation_size: int = 1024,
    nms_iou: float = 0.5,
    score_threshold: float = 0.0,
    detections_per_image: int = 100,
) -> FasterRCNNDetector:
    """Faster R-CNN with an FPN on a ResNet (``configs/detector/``), for ``num_classes`` foreground classes.

    ``backbone`` resnet18/34/50/101; ``width``, ``weights``, ``norm`` and ``neck_norm`` (res5's; None:
    ``norm``'s) and ``stem_pool`` (False: the FPN's levels at half their strides, as the toy_voc base
    was trained) as ``build_resnet_trunk``'s
    (ImageNet weights with frozen BatchNorm for real data; ``width=0.25, weights=None, norm=bn`` for the
    toy on CPU); ``freeze_at`` as the weak detector's (2: stem and res2 frozen, torchvision's
    ``trainable_backbone_layers=3``). ``anchor_sizes``: one size per FPN level (P2..P6). The rest are
    torchvision's ``FasterRCNN`` arguments: ``representation_size`` is the box head's MLP width,
    ``nms_iou`` / ``score_threshold`` / ``detections_per_image`` its ``box_nms_thresh`` /
    ``box_score_thresh`` / ``box_detections_per_img``.
    """
    if backbone not in {"resnet18", "resnet34", "resnet50", "resnet101"}:
        raise ValueError(
            f"detector.backbone: unknown '{backbone}', expected resnet18, resnet34, resnet50 or resnet101"
        )
    if not 0 <= freeze_at <= 5:
        raise ValueError(f"detector.freeze_at must be in 0..5, got {freeze_at}")
    if len(anchor_sizes) != 5:
        raise ValueError(
            f"detector.anchor_sizes: one size per FPN level P2..P6 (5), got {list(anchor_sizes)}"
        )
    trunk = build_resnet_trunk(
        int(backbone.removeprefix("resnet")),
        width=width,
        weights=weights,
        norm=norm,
        neck_norm=neck_norm,
        stem_pool=stem_pool,
    )
    frozen = [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]][:freeze_at]
    for names in frozen:  # frozen in their BatchNorm statistics too, as detectron2's ResNet.freeze
        for name in names:
            setattr(trunk, name, freeze_batchnorm(getattr(trunk, name)).requires_grad_(False))
    stages = [trunk.layer1, trunk.layer2, trunk.layer3, trunk.layer4]
    body = BackboneWithFPN(
        trunk,
        return_layers={"layer1": "0", "layer2": "1", "layer3": "2", "layer4": "3"},
        in_channels_list=[stage_channels(s) for s in stages],
        out_channels=fpn_channels,
    )
    anchors = AnchorGenerator(
        sizes=tuple((int(s),) for s in anchor_sizes),
        aspect_ratios=(tuple(aspect_ratios),) * len(anchor_sizes),
    )
    # torchvision's box head for an FPN (its MultiScaleRoIAlign at 7 x 7, two fully-connected layers),
    # built here only for its width: FasterRCNN's default head is 1,024 wide, too heavy for the CPU toy.
    resolution = 7
    box_head = TwoMLPHead(fpn_channels * resolution**2, representation_size)
    detector = FasterRCNN(
        body,
        rpn_anchor_generator=anchors,
        box_head=box_head,
        box_predictor=FastRCNNPredictor(representation_size, num_classes + 1),
        rpn_pre_nms_top_n_train=rpn_pre_nms_top_n_train,
        rpn_post_nms_top_n_train=rpn_post_nms_top_n_train,
        rpn_pre_nms_top_n_test=rpn_pre_nms_top_n_test,
        rpn_post_nms_top_n_test=rpn_post_nms_top_n_test,
        rpn_batch_size_per_image=rpn_batch_size_per_image,
        rpn_positive_fraction=rpn_positive_fraction,
        box_batch_size_per_image=box_batch_size_per_image,
        box_nms_thresh=nms_iou,
        box_score_thresh=score_threshold,
        box_detections_per_img=detections_per_image,
    )
    # The images come resized and normalised by wsod's transforms (PreparedImageTransform).
    detector.transform = PreparedImageTransform(
        min_size=1, max_size=1, image_mean=[0.0] * 3, image_std=[1.0] * 3
    )
    return FasterRCNNDetector(detector, num_classes)
