"""wsod/modeling/faster_rcnn.py: torchvision's Faster R-CNN behind wsod's inputs and outputs: box
conventions at the boundary, training losses of a collated batch, detections in original pixels, the
merge of test views, and checkpoints that load_detector rebuilds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from wsod.build import build_stage2_model, load_detector
from wsod.engine.checkpoint import save_checkpoint
from wsod.modeling.faster_rcnn import (
    ARCHITECTURE,
    FasterRCNNDetector,
    _to_continuous,
    _to_inclusive,
    build_faster_rcnn,
    merge_views,
)

TOY = {
    "backbone": "resnet18", "width": 0.25, "weights": None, "norm": "bn", "freeze_at": 0, "fpn_channels": 16,
    "anchor_sizes": [16, 32, 64, 128, 256], "representation_size": 32, "box_batch_size_per_image": 32,
    "rpn_post_nms_top_n_train": 100, "rpn_post_nms_top_n_test": 50,
}  # fmt: skip


def _batch():
    torch.manual_seed(0)
    images = torch.zeros(2, 3, 96, 128)
    images[0, :, :80, :120] = torch.randn(3, 80, 120)
    images[1, :, :96, :100] = torch.randn(3, 96, 100)
    targets = [
        {"labels": torch.tensor([1.0, 0, 1]), "boxes": torch.tensor([[10.0, 10, 50, 60], [60, 5, 110, 70]]),
         "box_labels": torch.tensor([0, 2])},
        {"labels": torch.tensor([0, 1.0, 0]), "boxes": torch.tensor([[5.0, 5, 90, 90]]),
         "box_labels": torch.tensor([1])},
    ]  # fmt: skip
    return {
        "images": images, "proposals": None, "image_labels": None, "image_sizes": [(80, 120), (96, 100)],
        "original_sizes": [(160, 240), (96, 100)], "targets": targets,
    }  # fmt: skip


def test_boxes_cross_the_boundary_in_each_convention_and_back():
    boxes = torch.tensor([[0.0, 0, 9, 19], [4, 6, 4, 6]])  # wsod: inclusive pixels of a 100 x 200 image
    continuous = _to_continuous(boxes * 0.5, (50, 100), (100, 200))  # resized by 1/2
    assert continuous.tolist() == [[0.0, 0.0, 5.0, 10.0], [2.0, 3.0, 2.5, 3.5]]  # one original pixel on
    back = _to_inclusive(continuous, (50, 100), (100, 200))
    torch.testing.assert_close(back, boxes)
    thin = _to_inclusive(torch.tensor([[10.0, 10, 10.2, 10.2]]), (50, 100), (50, 100))
    assert thin[0, 2] >= thin[0, 0] and thin[0, 3] >= thin[0, 1]  # x2 >= x1 even below a pixel


def test_a_collated_batch_trains_with_torchvision_losses_and_every_trainable_weight_gets_a_gradient():
    model = build_faster_rcnn(3, **TOY).train()
    losses = model(**_batch()).losses
    assert set(losses) == set(FasterRCNNDetector.loss_names)
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    without = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not without  # DDP needs no find_unused_parameters
    with pytest.raises(ValueError, match="no boxes/box_labels targets"):
        model(**{**_batch(), "targets": [{"labels": torch.ones(3)}] * 2})
    with pytest.raises(ValueError, match="keeps nothing besides its losses"):  # no ROI features to give
        model(**_batch(), keep=("roi_features",))
    with pytest.raises(RuntimeError, match="predict_view predicts"):
        model.eval()(**_batch())


def test_without_the_stem_pooling_the_fpn_levels_halve_their_strides_and_still_train():
    model = build_faster_rcnn(3, **TOY, stem_pool=False).train()
    levels = model.detector.backbone(torch.zeros(1, 3, 96, 128))
    assert [tuple(v.shape[-2:]) for v in levels.values()] == [(48, 64), (24, 32), (12, 16), (6, 8), (3, 4)]
    losses = model(**_batch()).losses
    assert all(torch.isfinite(v) for v in losses.values())


def test_images_are_neither_resized_nor_normalised_again():
    model = build_faster_rcnn(3, **TOY)
    image = torch.randn(3, 80, 120)
    out, _ = model.detector.transform([image])
    assert out.image_sizes == [(80, 120)] and out.tensors.shape[-2:] == (96, 128)  # padded to 32 only
    torch.testing.assert_close(out.tensors[0, :, :80, :120], image)


def test_detections_are_wsod_boxes_in_original_pixels_with_labels_from_zero():
    torch.manual_seed(0)
    model = build_faster_rcnn(3, **{**TOY, "detections_per_image": 7}).eval()
    batch = _batch()
    found = model.detect(batch["images"], batch["image_sizes"], batch["original_sizes"])
    assert len(found) == 2 and model.training is False
    first = found[0]
    assert 0 < len(first["boxes"]) <= 7
    assert first["labels"].min() >= 0 and first["labels"].max() <= 2
    # Within the original 160 x 240 image (twice the resized one), inclusive.
    assert (
        first["boxes"][:, 2].max() <= 239 and first["boxes"][:, 3].max() <= 159 and first["boxes"].min() >= 0
    )
    assert first["boxes"][:, 2].max() > 120  # not left in resized pixels
    # A caller's settings (the export's cap) apply to that call alone: the model keeps its own.
    own = model.detection_settings
    assert own.detections_per_image == 7
    capped = model.predict_view(batch, [False, True], replace(own, detections_per_image=2))
    assert all(0 < len(image["boxes"]) <= 2 for image in capped)
    assert model.detection_settings == own and model.detector.roi_heads.detections_per_img == 7
    torch.testing.assert_close(capped[0]["boxes"], first["boxes"][:2])  # the best two, unflipped


def test_views_merge_by_per_class_nms_and_give_each_class_its_best_score():
    a = {
        "boxes": torch.tensor([[0.0, 0, 10, 10], [50, 50, 60, 60]]),
        "scores": torch.tensor([0.9, 0.3]),
        "labels": torch.tensor([0, 1]),
    }
    b = {"boxes": torch.tensor([[0.0, 0, 10, 11], [0, 0, 10, 10]]), "scores": torch.tensor([0.8, 0.6]),
         "labels": torch.tensor([0, 2])}  # fmt: skip
    merged = merge_views([a, b], nms_iou=0.5, detections_per_image=10, num_classes=4)
    assert merged["scores"].tolist() == pytest.approx([0.9, 0.6, 0.3])  # b's class-0 box suppressed
    assert merged["labels"].tolist() == [0, 2, 1]
    assert merged["image_scores"].tolist() == pytest.approx([0.9, 0.3, 0.6, 0.0])
    single = merge_views([a], nms_iou=0.5, detections_per_image=10, num_classes=4)
    assert single["scores"].tolist() == pytest.approx([0.9, 0.3])


def test_a_second_stage_checkpoint_rebuilds_with_its_weights(tmp_path):
    torch.manual_seed(3)
    model = build_stage2_model({"name": "faster_rcnn", **TOY}, 3)
    metadata = {
        "architecture": ARCHITECTURE,
        "model": {"name": "faster_rcnn", **TOY},
        "classes": ["a", "b", "c"],
    }
    path = save_checkpoint({"model": model.state_dict(), "metadata": metadata}, tmp_path / "m.pth")
    loaded, meta = load_detector(path)
    assert (
        isinstance(loaded, FasterRCNNDetector) and not loaded.training and meta["classes"] == ["a", "b", "c"]
    )
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="the second stage has one detector"):
        build_stage2_model({"name": "retinanet"}, 3)


def test_freeze_at_freezes_the_stem_and_stages_as_the_weak_detector_does():
    frozen = build_faster_rcnn(3, **{**TOY, "freeze_at": 2})
    trunk = frozen.detector.backbone.body
    assert not any(p.requires_grad for p in trunk.conv1.parameters())
    assert not any(p.requires_grad for p in trunk.layer1.parameters())
    assert all(p.requires_grad for p in trunk.layer2.parameters())
    with pytest.raises(ValueError, match="one size per FPN level"):
        build_faster_rcnn(3, **{**TOY, "anchor_sizes": [16, 32]})
