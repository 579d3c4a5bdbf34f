"""The whole detector: sequential backprop changes nothing but memory; degenerate batches; inference."""

from __future__ import annotations

import pytest
import torch
from torchvision.ops import box_iou

from wsod.modeling import WeaklySupervisedDetector, build_detector

NUM_CLASSES = 3


def _proposals(seed: int, count: int, height: int, width: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x1 = torch.rand(count, generator=g) * (width - 12)
    y1 = torch.rand(count, generator=g) * (height - 12)
    w = torch.rand(count, generator=g) * (width - x1 - 4) + 4
    h = torch.rand(count, generator=g) * (height - y1 - 4) + 4
    return torch.stack([x1, y1, x1 + w, y1 + h], dim=1).to(dtype)


def _batch(dtype=torch.float32, counts=(13, 6), labels=((1, 0, 1), (0, 1, 0))):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(len(counts), 3, 64, 96, generator=g).to(dtype)
    proposals = [_proposals(i, n, 64, 96, dtype) for i, n in enumerate(counts)]
    image_labels = torch.tensor(labels, dtype=dtype)
    return images, proposals, image_labels


def _tiny(chunk_size, fuse_pooling=True, backbone="resnet18", **kw) -> WeaklySupervisedDetector:
    torch.manual_seed(0)
    return build_detector(
        backbone, num_classes=NUM_CLASSES, chunk_size=chunk_size, width=0.25, fuse_pooling=fuse_pooling, **kw
    )


def _losses_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    losses = model(*batch).losses
    sum(losses.values()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach() for k, v in losses.items()}, grads


@pytest.mark.parametrize(
    "backbone,fuse_pooling",
    [("resnet18", True), ("resnet18", False), ("resnet50", True)],
    ids=["r18-fused", "r18-paper", "r50-fused"],
)
def test_sequential_backprop_gives_the_same_losses_and_gradients(backbone, fuse_pooling):
    batch = _batch(torch.double)
    plain = _tiny(None, backbone=backbone).double()
    ref_losses, ref_grads = _losses_and_grads(plain, batch)
    sequential = _tiny(4, fuse_pooling, backbone=backbone).double()
    sequential.load_state_dict(plain.state_dict())
    losses, grads = _losses_and_grads(sequential, batch)
    assert (
        losses.keys()
        == ref_losses.keys()
        == {
            "loss_mil",
            *(f"loss_ref_{kind}_{k}" for kind in ("cls", "box") for k in (1, 2, 3)),
        }
    )
    for name, value in losses.items():
        assert torch.allclose(value, ref_losses[name], rtol=1e-8, atol=0), name
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        ref = ref_grads[name]
        assert (grad - ref).abs().max() <= 1e-8 * ref.abs().max().clamp(min=1e-30), name
    # The comparison is meaningful: the res5 and base gradients are not all zero.
    assert any(g.abs().sum() > 0 for n, g in ref_grads.items() if n.startswith("roi_head"))
    assert any(g.abs().sum() > 0 for n, g in ref_grads.items() if n.startswith("base"))


@pytest.mark.parametrize(
    "counts,labels",
    [
        ((9, 5), ((0, 0, 0), (0, 1, 1))),  # an image with an empty label vector
        ((1, 1), ((1, 0, 0), (0, 0, 1))),  # single proposals
        ((17, 3), ((1, 1, 0), (0, 0, 1))),  # different proposal counts
    ],
    ids=["empty-labels", "single-proposal", "different-counts"],
)
def test_degenerate_batches_give_finite_losses_and_gradients(counts, labels):
    model = _tiny(4)
    model.train()
    losses = model(*_batch(counts=counts, labels=labels)).losses
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name


def test_frozen_stages_get_no_gradient_and_the_rest_do():
    model = _tiny(4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("base.stem", "base.res2")) for n in trainable)
    assert any(n.startswith("base.res3") for n in trainable)
    assert any(n.startswith("roi_head") for n in trainable)


def test_train_mode_batchnorm_in_the_neck_is_refused_but_allowed_in_the_base():
    model = _tiny(4, norm="bn", neck_norm="gn", freeze_at=0)
    losses = model(*_batch()).losses
    sum(losses.values()).backward()
    bad = _tiny(4, norm="bn")
    with pytest.raises(ValueError, match="train-mode BatchNorm"):
        bad(*_batch())
    assert _tiny(None, norm="bn")(*_batch()).losses["loss_mil"].isfinite()  # plain autograd: allowed


def test_training_without_labels_is_an_error():
    images, proposals, _ = _batch()
    with pytest.raises(ValueError, match="image_labels"):
        _tiny(4)(images, proposals)
    with pytest.raises(ValueError, match="image 1"):
        _tiny(4)(images, [proposals[0], proposals[1][:0]], _batch()[2])


def test_inference_returns_nms_detections_in_original_pixels():
    model = _tiny(4).eval()
    # Sharper heads so that scores and deltas are far from uniform.
    for student in model.students:
        torch.nn.init.normal_(student.cls_score.weight, std=0.5)
        torch.nn.init.normal_(student.bbox_pred.weight, std=0.1)
    images, proposals, _ = _batch(counts=(120, 40))
    image_sizes = [(60, 90), (64, 80)]
    original_sizes = [(120, 180), (32, 40)]
    with torch.no_grad():
        detections = model(images, proposals, image_sizes=image_sizes, original_sizes=original_sizes)
    assert len(detections) == 2
    for det, (h, w) in zip(detections, original_sizes, strict=True):
        assert det.keys() == {"boxes", "scores", "labels"}
        n = det["boxes"].shape[0]
        assert 0 < n <= 100 and det["scores"].shape == (n,) and det["labels"].shape == (n,)
        assert det["labels"].min() >= 0 and det["labels"].max() < NUM_CLASSES
        assert (det["scores"][:-1] >= det["scores"][1:]).all()
        boxes = det["boxes"]
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= w).all()
        assert (boxes[:, 1] >= 0).all() and (boxes[:, 3] <= h).all()
        for c in det["labels"].unique():
            same = boxes[det["labels"] == c]
            iou = box_iou(same, same).fill_diagonal_(0)
            assert (iou <= 0.3 + 1e-6).all()
    # Per-ROI predictions scale with the image: doubling the original size doubles every box.
    with torch.no_grad():
        features = model.roi_features(images, proposals)
        small = model.predict_rois(features, proposals, image_sizes, image_sizes)
        large = model.predict_rois(features, proposals, image_sizes, [(2 * h, 2 * w) for h, w in image_sizes])
    for (s_scores, s_boxes), (l_scores, l_boxes) in zip(small, large, strict=True):
        assert torch.equal(s_scores, l_scores)
        assert torch.allclose(2 * s_boxes, l_boxes)
        assert torch.allclose(s_scores.sum(dim=1), torch.ones(len(s_scores)))


@pytest.mark.parametrize(
    "labels",
    [((0, 0, 0),), ((0, 0, 0), (0, 0, 0)), ((0, 0, 0), (1, 0, 1))],
    ids=["one-image-no-positive", "two-images-no-positive", "mixed"],
)
def test_one_training_step_on_images_without_a_positive_class(labels):
    # VOC image labels skip difficult objects: an image whose objects are all difficult has none.
    counts = (2, 7)[: len(labels)]
    model = _tiny(4)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = model(*_batch(counts=counts, labels=labels)).losses
    assert all(torch.isfinite(v) for v in losses.values())
    student_losses = {k: v for k, v in losses.items() if k.startswith("loss_ref")}
    if not any(any(row) for row in labels):
        # The MIL loss alone: every student has only zero-weight background ROIs.
        assert losses["loss_mil"] > 0 and all(v == 0 for v in student_losses.values())
    else:
        assert losses["loss_ref_cls_1"] > 0
    sum(losses.values()).backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_any_pseudo_labeller_plugs_in_without_touching_the_detector():
    calls = []

    def all_background(proposals, scores, image_labels):
        """Every ROI background with weight 1: the students learn to say 'nothing here'."""
        calls.append((proposals.shape, scores.shape, image_labels.shape))
        count = len(proposals)
        return torch.zeros(count, dtype=torch.int64), torch.ones(count), torch.zeros(count, 4)

    model = _tiny(4, labeler=all_background)
    images, proposals, labels = _batch()
    features = model.roi_features(images, proposals)
    losses = model.losses(features, proposals, labels)
    # Called per image and per student with the foreground columns of the source scores.
    per_image = [((n, 4), (n, NUM_CLASSES), (NUM_CLASSES,)) for n in (13, 6)]
    assert calls == per_image * 3
    for k, student in enumerate(model.students, start=1):
        logits, _ = student(features)
        expected = torch.stack(
            [
                torch.nn.functional.cross_entropy(part, torch.zeros(len(part), dtype=torch.int64))
                for part in logits.split([13, 6])
            ]
        ).mean()
        assert torch.allclose(losses[f"loss_ref_cls_{k}"], (3.0 if k == 1 else 1.0) * expected)
        assert losses[f"loss_ref_box_{k}"] == 0


def _near_duplicates(count=300, seed=0):
    """One box jittered by under half a pixel and one ROI feature plus 1e-3 noise: the proposals of a
    Selective Search cluster, whose scores differ only in their last few significant bits."""
    g = torch.Generator().manual_seed(seed)
    proposals = torch.tensor([10.0, 10.0, 50.0, 50.0]) + torch.rand(count, 4, generator=g) * 0.5
    noise = 1e-3 * torch.randn(count, 128, generator=g)
    features = torch.randn(1, 128, generator=g).expand(count, -1) + noise
    return proposals, features


def test_heads_pseudo_labels_and_losses_run_in_float32_under_autocast():
    from wsod.modeling.refinement import MISTLabeler

    seen = []

    def recording_mist(proposals, scores, image_labels):
        seen.append(scores.clone())
        return MISTLabeler()(proposals, scores, image_labels)

    model = _tiny(None, labeler=recording_mist)
    with torch.no_grad():  # sharper heads than the N(0, 0.001) init, so that ranks matter
        for name, p in model.named_parameters():
            if name.startswith(("mil_head", "students")) and name.endswith("weight"):
                p.normal_(std=0.3)
    proposals, features = _near_duplicates()
    labels = torch.tensor([[1.0, 1.0, 0.0]])
    # The case bites: in bf16 these 300 scores collapse to a handful of values and the top box changes.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_scores = model.mil_head(features, [len(features)])
    fp32_scores = model.mil_head(features, [len(features)])
    # float32 keeps them apart, all but a few: not all 300 for certain, because the exact (float64)
    # scores of the closest neighbours lie 5 float32 ulps apart while the head's float32 rounding errors
    # reach 23 ulps here, so on another CPU (another matmul kernel) a close pair may round to one value.
    # 23 pairs lie within 100 ulps (twice the largest error difference): at least 277 values stay.
    assert bf16_scores.dtype == torch.bfloat16 and fp32_scores[:, 1].unique().numel() >= 277
    assert bf16_scores[:, 1].unique().numel() < 30
    assert bf16_scores[:, 1].float().argmax() != fp32_scores[:, 1].argmax()

    plain = model.losses(features, [proposals], labels)
    plain_scores, seen[:] = list(seen), []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = model.losses(features, [proposals], labels)
        # Reduced-precision ROI features (what the neck gives under autocast) are cast up, not kept.
        from_bf16 = model.losses(features.bfloat16(), [proposals], labels)
    assert amp.keys() == plain.keys()
    for name in plain:
        assert amp[name].dtype == torch.float32 and torch.equal(amp[name], plain[name]), name
        assert from_bf16[name].dtype == torch.float32
    assert len(seen) == 2 * len(plain_scores) == 6
    for ours, reference in zip(seen[:3], plain_scores, strict=True):
        assert ours.dtype == torch.float32 and torch.equal(ours, reference)
    torch.testing.assert_close(seen[0], fp32_scores[:, 1:].detach(), rtol=0, atol=0)

    # Inference too: per-ROI predictions and NMS in float32 whatever the caller's context.
    sizes = [(64, 96)]
    with torch.no_grad():
        plain_rois = model.predict_rois(features, [proposals], sizes, sizes)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp_rois = model.predict_rois(features, [proposals], sizes, sizes)
            detections = model.postprocess(*amp_rois[0])
    for (s1, b1), (s2, b2) in zip(plain_rois, amp_rois, strict=True):
        assert s2.dtype == b2.dtype == torch.float32 and torch.equal(s1, s2) and torch.equal(b1, b2)
    assert detections["scores"].dtype == torch.float32


def test_each_backbone_brings_its_own_roi_pooling_and_a_config_may_still_choose():
    from torch.nn.modules.utils import _pair
    from torchvision.ops import RoIAlign, RoIPool

    def pooler(model):
        return model.roi_head.body.module.pooler

    resnet = _tiny(4)
    assert isinstance(pooler(resnet), RoIAlign) and _pair(pooler(resnet).output_size) == (14, 14)
    assert pooler(resnet).spatial_scale == 1 / 16
    chosen = _tiny(4, pooler="pool", roi_size=10)
    assert isinstance(pooler(chosen), RoIPool) and _pair(pooler(chosen).output_size) == (10, 10)


def test_each_images_targets_reach_the_method_unchanged_and_name_the_losses():
    from wsod.modeling.refinement import MISTMethod

    seen = []

    class RecordingMIST(MISTMethod):
        def pseudo_labels(self, student, proposals, scores, targets):
            seen.append((student, targets))
            return super().pseudo_labels(student, proposals, scores, targets)

    images, proposals, labels = _batch()
    # Supervision beyond the labels travels in each image's dict to the method: a field MIST does not
    # read here (its partial labels, "points" and the rest, change its pseudo-labels: test_partial_labels).
    points = {"hint_points": torch.tensor([[5.0, 6.0]]), "hint_labels": torch.tensor([0])}
    targets = [{"labels": row, **points} for row in labels]
    model = _tiny(4, method=RecordingMIST())
    from_targets = model(images, proposals, targets=targets).losses
    assert [(k, id(t)) for k, t in seen] == [(k, id(t)) for k in (1, 2, 3) for t in targets]
    assert tuple(from_targets) == model.loss_names == (
        "loss_mil", *(f"loss_ref_{kind}_{k}" for k in (1, 2, 3) for kind in ("cls", "box"))
    )  # fmt: skip
    # image_labels alone, or both in agreement, give the same losses.
    for call in (dict(image_labels=labels), dict(image_labels=labels, targets=targets)):
        losses = model(images, proposals, **call).losses
        assert all(torch.equal(losses[k], from_targets[k]) for k in from_targets)
    with pytest.raises(ValueError, match="disagree"):
        model(images, proposals, labels.flip(0), targets=targets)
    with pytest.raises(ValueError, match=r"targets\[1\]\['labels'\]"):
        model(images, proposals, targets=[targets[0], {"hint_points": targets[1]["hint_points"]}])


def test_a_method_and_a_labeller_or_loss_weight_together_are_refused():
    from wsod.modeling.refinement import MISTLabeler, OICRMethod

    with pytest.raises(ValueError, match="either a method or a labeler"):
        _tiny(4, method=OICRMethod(), labeler=MISTLabeler())
    with pytest.raises(ValueError, match="either a method or a labeler"):
        _tiny(4, method=OICRMethod(), first_student_loss_weight=1.0)
    weighted = _tiny(4, labeler=MISTLabeler(), first_student_loss_weight=1.0)
    assert weighted.method.first_student_loss_weight == 1.0 and weighted.labeler == MISTLabeler()


def test_a_method_whose_losses_differ_from_its_loss_names_is_an_error():
    from wsod.modeling.refinement import MISTMethod

    class Misnamed(MISTMethod):
        def loss_names(self, num_students):
            return tuple(f"loss_{k}" for k in range(1, num_students + 1))

    with pytest.raises(RuntimeError, match="make the two agree"):
        _tiny(4, method=Misnamed())(*_batch())
