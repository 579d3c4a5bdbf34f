"""The third stage's detector: the teacher's pseudo-label filter against a naive loop, its boxes in the
weak view's resized frame, zero gradient from a zero-weight loss on unlabelled images, the rows each
loss trains on, and an EMA teacher of it that follows the exact average."""

from __future__ import annotations

import pytest
import torch

from wsod.engine.ema import EMATeacher
from wsod.modeling.faster_rcnn import FasterRCNNDetector, build_faster_rcnn
from wsod.modeling.focal_roi_heads import FocalRoIHeads
from wsod.modeling.semi_supervised_rcnn import SemiSupervisedFasterRCNN, teacher_targets

SOS_WEIGHTS = {"loss_classifier": 2.0, "loss_box_reg": 0.0, "loss_objectness": 2.0, "loss_rpn_box_reg": 0.0}


def _model(weights=None, threshold=0.7, seed=0) -> SemiSupervisedFasterRCNN:
    torch.manual_seed(seed)
    base = build_faster_rcnn(
        3, backbone="resnet18", width=0.125, weights=None, norm="bn", freeze_at=0, fpn_channels=16,
        representation_size=32, rpn_batch_size_per_image=32, box_batch_size_per_image=32,
        rpn_post_nms_top_n_train=50, rpn_post_nms_top_n_test=50,
    )  # fmt: skip
    return SemiSupervisedFasterRCNN(
        base.detector, 3, unlabelled_weights=weights or SOS_WEIGHTS, score_threshold=threshold
    )


def _batch(labelled: list[bool], seed: int = 3) -> dict:
    """Weak/strong pairs (rows 2i, 2i+1) of 64 x 80 images; labelled ones carry two pseudo boxes."""
    g = torch.Generator().manual_seed(seed)
    targets, rows = [], 2 * len(labelled)
    for flag in labelled:
        labels = torch.tensor([1.0, 0.0, 1.0])
        target = {"labels": labels}
        if flag:
            target["boxes"] = torch.tensor([[4.0, 6.0, 30.0, 40.0], [20.0, 10.0, 58.0, 50.0]])
            target["box_labels"] = torch.tensor([0, 2])
        targets += [target, dict(target)]
    return {
        "images": torch.rand(rows, 3, 64, 96, generator=g),
        "proposals": [torch.zeros(1, 4)] * rows,
        "image_labels": None,
        "image_sizes": [(64, 80)] * rows,
        "original_sizes": [(32, 40)] * rows,
        "targets": targets,
        "views": 2,
    }


def _naive_filter(detections, image_labels, threshold, by_labels):
    out = []
    for found, labels in zip(detections, image_labels, strict=True):
        boxes, kept = [], []
        for box, score, label in zip(found["boxes"], found["scores"], found["labels"], strict=True):
            if not float(score) > threshold:
                continue
            if by_labels and labels[int(label) - 1] == 0:  # torchvision's 1..C
                continue
            boxes.append(box)
            kept.append(int(label))
        out.append((torch.stack(boxes) if boxes else torch.zeros(0, 4), kept))
    return out


@pytest.mark.parametrize("by_labels", [True, False])
def test_the_pseudo_label_filter_matches_a_naive_loop(by_labels):
    g = torch.Generator().manual_seed(1)
    detections = []
    for count in (7, 0, 12):
        scores = torch.rand(count, generator=g)
        if count:
            scores[0] = 0.7  # exactly the threshold: dropped, as the reference's strict ">"
        detections.append(
            {"boxes": torch.rand(count, 4, generator=g) * 50, "scores": scores,
             "labels": torch.randint(1, 4, (count,), generator=g)}
        )  # fmt: skip
    image_labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    got = teacher_targets(detections, image_labels, score_threshold=0.7, filter_by_image_labels=by_labels)
    want = _naive_filter(detections, image_labels, 0.7, by_labels)
    assert len(got) == len(want)
    for mine, (boxes, labels) in zip(got, want, strict=True):
        torch.testing.assert_close(mine["boxes"], boxes.float().reshape(-1, 4))
        assert mine["labels"].tolist() == labels and mine["labels"].dtype == torch.int64
    assert any(len(t["labels"]) for t in got)  # the case holds boxes to keep
    if by_labels:
        assert all(image_labels[i][t["labels"] - 1].all() for i, t in enumerate(got))


def test_the_teachers_boxes_are_torchvision_targets_in_the_weak_views_resized_frame():
    model = _model(threshold=0.0).eval()
    batch = _batch([False, False])
    found = model.teacher_inputs(batch)["teacher_targets"]
    assert len(found) == 2  # one per unlabelled image, from its weak view (rows 0 and 2)
    detections = model.detect(batch["images"][[0, 2]], batch["image_sizes"][:2], batch["original_sizes"][:2])
    for mine, detected in zip(found, detections, strict=True):
        assert len(mine["boxes"]) > 0
        assert mine["labels"].min() >= 1  # torchvision's labels, wsod's + 1
        filtered = detected["labels"][detected["scores"] > 0.0] + 1
        keep = torch.tensor([True, False, True])[filtered - 1]  # the image's labels: classes 0 and 2
        assert mine["labels"].tolist() == filtered[keep].tolist()
        # detect() gives wsod boxes in original pixels: the teacher's, mapped there, are the same.
        scale = torch.tensor([40 / 80, 32 / 64] * 2)
        in_original = mine["boxes"] * scale - torch.tensor([0.0, 0.0, 1.0, 1.0])
        in_original[:, 2:] = torch.maximum(in_original[:, 2:], in_original[:, :2])
        torch.testing.assert_close(in_original, detected["boxes"][detected["scores"] > 0.0][keep])
        assert (mine["boxes"][:, 2] <= 80).all() and (mine["boxes"][:, 3] <= 64).all()


def _gradients(model, batch, teacher):
    model.train().zero_grad()
    output = model(**batch, teacher_targets=teacher)
    sum(output.losses.values()).backward()
    heads = model.detector
    return output, {
        "roi box": heads.roi_heads.box_predictor.bbox_pred.weight.grad,
        "roi cls": heads.roi_heads.box_predictor.cls_score.weight.grad,
        "rpn box": heads.rpn.head.bbox_pred.weight.grad,
        "rpn cls": heads.rpn.head.cls_logits.weight.grad,
    }


def _teacher_boxes(count: int) -> list[dict]:
    boxes = torch.tensor([[6.0, 8.0, 40.0, 44.0], [30.0, 12.0, 70.0, 60.0]])
    return [{"boxes": boxes.clone(), "labels": torch.tensor([1, 3])} for _ in range(count)]


def test_a_zero_weight_sends_no_gradient_from_the_unlabelled_images():
    batch = _batch([False, False])  # unlabelled only: every gradient comes from their losses
    output, grads = _gradients(_model(), batch, _teacher_boxes(2))
    unlabelled = {name for name in output.losses if name.endswith("_unlabelled")}
    assert unlabelled == {"loss_classifier_unlabelled", "loss_objectness_unlabelled"}
    assert all(
        not output.losses[name].requires_grad for name in FasterRCNNDetector.loss_names
    )  # no labelled row
    for name in ("roi box", "rpn box"):  # only the box regressions reach these layers
        assert grads[name] is None or not grads[name].any(), name
    for name in ("roi cls", "rpn cls"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    # The same batch with a weight on the box losses: the box layers do get a gradient (the test can fail).
    weights = dict.fromkeys(SOS_WEIGHTS, 1.0)
    _, grads = _gradients(_model(weights), batch, _teacher_boxes(2))
    assert grads["roi box"].abs().sum() > 0 and grads["rpn box"].abs().sum() > 0


def test_each_loss_trains_on_its_rows_with_its_weight():
    """Labelled images: both views against their own boxes, weight 1; unlabelled: the strong view
    against the teacher's, times the weight; as torchvision's detector computes them alone."""
    batch = _batch([True, False, True])
    teacher = _teacher_boxes(1)
    model = _model(weights=dict.fromkeys(SOS_WEIGHTS, 0.5)).train()
    torch.manual_seed(11)
    got = model(**batch, teacher_targets=teacher).losses
    assert list(got) == [
        *FasterRCNNDetector.loss_names,
        *(f"{n}_unlabelled" for n in FasterRCNNDetector.loss_names),
    ]
    torch.manual_seed(11)  # the samplers draw in the same order: labelled rows first, then unlabelled
    rows = [0, 1, 4, 5]
    scale = torch.tensor([0.0, 0.0, 80 / 40, 64 / 32])
    labelled = [
        {"boxes": batch["targets"][r]["boxes"] + scale, "labels": batch["targets"][r]["box_labels"] + 1}
        for r in rows
    ]
    want = model.detector([batch["images"][r][:, :64, :80] for r in rows], labelled)
    want_u = model.detector([batch["images"][3][:, :64, :80]], teacher)
    for name in FasterRCNNDetector.loss_names:
        torch.testing.assert_close(got[name], want[name])
        torch.testing.assert_close(got[f"{name}_unlabelled"], 0.5 * want_u[name])


def test_an_unlabelled_image_without_the_teachers_boxes_is_refused():
    model = _model().train()
    with pytest.raises(ValueError, match="teacher's boxes"):
        model(**_batch([True, False]))
    with pytest.raises(ValueError, match="views=2"):
        model(**{**_batch([True]), "views": 1})


def test_the_box_head_is_focal_and_a_checkpoint_loads_into_the_plain_detector():
    model = _model()
    assert isinstance(model.detector.roi_heads, FocalRoIHeads) and model.detector.roi_heads.focal_gamma == 1.5
    plain = build_faster_rcnn(
        3, backbone="resnet18", width=0.125, weights=None, norm="bn", freeze_at=0, fpn_channels=16,
        representation_size=32,
    )  # fmt: skip
    plain.load_state_dict(model.state_dict())  # the names tools/eval.py rebuilds
    with pytest.raises(ValueError, match="each of"):
        SemiSupervisedFasterRCNN(plain.detector, 3, unlabelled_weights={"loss_classifier": 1.0})


@torch.no_grad()
def test_the_teacher_of_the_third_stage_follows_the_ema_exactly():
    """Two updates at momentum m: teacher = m^2 t0 + m (1 - m) s1 + (1 - m) s2 for every floating
    tensor, BatchNorm statistics included; integer counters are the student's."""
    student = _model()
    m = 0.9
    teacher = EMATeacher(student, momentum=m, follow=("backbone", "neck", "heads"), eval_weights="teacher")
    teacher.state_dict()  # its first use, as a run's first step: the student's weights now
    start = {k: v.clone() for k, v in student.state_dict().items()}
    snapshots = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for value in student.state_dict().values():
            if value.is_floating_point():
                value.add_(torch.randn(value.shape, generator=g, dtype=torch.float64).to(value.dtype))
            else:
                value.add_(1)
        snapshots.append({k: v.clone() for k, v in student.state_dict().items()})
        teacher.update()
    got = teacher.teacher.state_dict()
    for name, t0 in start.items():
        if not t0.is_floating_point():
            assert torch.equal(got[name], snapshots[1][name]), name
            continue
        want = (
            m * m * t0.double()
            + m * (1 - m) * snapshots[0][name].double()
            + (1 - m) * snapshots[1][name].double()
        )
        torch.testing.assert_close(got[name].double(), want, rtol=1e-5, atol=1e-5, msg=name)
    assert any("running_mean" in name for name in start)
