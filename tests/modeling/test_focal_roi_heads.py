"""The focal ROI loss against its formula, gradient included (float64), and the box head that uses it
against torchvision's own at gamma 0."""

from __future__ import annotations

import pytest
import torch

from wsod.modeling.faster_rcnn import build_faster_rcnn
from wsod.modeling.focal_roi_heads import FocalRoIHeads, softmax_focal_loss


def _formula(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """Row by row: p = softmax, p_t its label's entry, (1 - p_t)^gamma x -log p_t, then the mean."""
    terms = []
    for row, label in zip(logits, labels.tolist(), strict=True):
        p = torch.exp(row) / torch.exp(row).sum()
        terms.append((1 - p[label]) ** gamma * -torch.log(p[label]))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("gamma", [0.0, 1.5, 2.0])
def test_the_focal_loss_and_its_gradient_match_the_formula_in_float64(gamma):
    g = torch.Generator().manual_seed(int(gamma * 10))
    logits = (torch.randn(40, 6, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    labels = torch.randint(0, 6, (40,), generator=g)
    got = softmax_focal_loss(logits, labels, gamma)
    want = _formula(logits, labels, gamma)
    (got_grad,) = torch.autograd.grad(got, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)


def test_a_confident_right_row_weighs_less_than_its_cross_entropy():
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0])
    focal = torch.stack([softmax_focal_loss(logits[i : i + 1], labels[i : i + 1], 1.5) for i in range(2)])
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert (focal / ce)[0] < (focal / ce)[1] < 1  # (1 - p_t)^1.5: 0.013 for p_t 0.987, 0.54 for 1/3


def _toy_detector(gamma):
    torch.manual_seed(0)
    model = build_faster_rcnn(
        3, backbone="resnet18", width=0.125, weights=None, norm="bn", freeze_at=0, fpn_channels=16,
        representation_size=32, rpn_batch_size_per_image=32, box_batch_size_per_image=32,
    )  # fmt: skip
    if gamma is not None:
        model.detector.roi_heads = FocalRoIHeads.from_heads(model.detector.roi_heads, focal_gamma=gamma)
    return model.double().train()


def _losses(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = [torch.rand(3, 64, 64, generator=g, dtype=torch.float64)]
    targets = [
        {"boxes": torch.tensor([[8.0, 8.0, 40.0, 40.0]], dtype=torch.float64), "labels": torch.tensor([2])}
    ]
    torch.manual_seed(1)  # the samplers draw from the global stream
    return model.detector(images, targets)


def test_at_gamma_0_the_focal_head_trains_as_torchvisions():
    plain, focal = _losses(_toy_detector(None)), _losses(_toy_detector(0.0))
    assert plain.keys() == focal.keys()
    for name in plain:
        torch.testing.assert_close(focal[name], plain[name], rtol=1e-12, atol=1e-14)
    assert _losses(_toy_detector(1.5))["loss_classifier"] < plain["loss_classifier"]


def test_the_focal_head_keeps_torchvisions_settings_and_evaluates_as_it():
    model = _toy_detector(None).eval()
    plain = model.detector.roi_heads
    focal = FocalRoIHeads.from_heads(plain, focal_gamma=1.5)
    assert focal.focal_gamma == 1.5 and focal.box_predictor is plain.box_predictor
    assert focal.fg_bg_sampler.batch_size_per_image == 32 and focal.box_coder.weights == (
        10.0,
        10.0,
        5.0,
        5.0,
    )
    assert (focal.nms_thresh, focal.score_thresh, focal.detections_per_img) == (
        plain.nms_thresh, plain.score_thresh, plain.detections_per_img,
    )  # fmt: skip
    with pytest.raises(ValueError, match="focal_gamma must be >= 0"):
        FocalRoIHeads.from_heads(plain, focal_gamma=-1.0)
    images = [torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)]
    with torch.no_grad():
        expected = model.detector(images)
        model.detector.roi_heads = focal.eval()
        got = model.detector(images)
    for name in ("boxes", "labels", "scores"):
        assert torch.equal(got[0][name], expected[0][name])
