"""The loss split against a naive per-image loop: each image scored alone by torchvision's detector with
the samplers' fractions set by hand, sorted by (loss, position); the model left as it was."""

from __future__ import annotations

import pytest
import torch
from torchvision.models.detection.faster_rcnn import FasterRCNN

from wsod.engine.loss_split import ImageLoss, image_losses, lowest_loss
from wsod.modeling.faster_rcnn import build_faster_rcnn


def _detector():
    torch.manual_seed(0)
    return build_faster_rcnn(
        3, backbone="resnet18", width=0.125, weights=None, norm="bn", freeze_at=0, fpn_channels=16,
        representation_size=32, rpn_batch_size_per_image=32, box_batch_size_per_image=32,
    )  # fmt: skip


def _batches(count: int):
    g = torch.Generator().manual_seed(4)
    batches = []
    for i in range(count):
        boxes = (
            torch.tensor([[4.0, 6.0, 30.0, 40.0], [20.0, 10.0, 58.0, 50.0]])
            + torch.rand(2, 4, generator=g) * 4
        )
        labels = torch.randint(0, 3, (2,), generator=g)
        batches.append(
            {
                "images": torch.rand(1, 3, 64, 64, generator=g),
                "proposals": [boxes.clone()],
                "image_labels": torch.zeros(1, 3),
                "image_sizes": [(64, 64)],
                "original_sizes": [(64, 64)],
                "targets": [{"labels": torch.zeros(3), "boxes": boxes, "box_labels": labels}],
                "views": 1,
                "image_ids": [f"img{i}"],
            }
        )
    return batches


def _naive(model, batches, seed):
    """One image at a time: positive fractions 1.0 and BatchNorm in eval mode by hand, the global
    generator seeded per image and put back, the four losses summed."""
    detector: FasterRCNN = model.detector
    state = torch.random.get_rng_state()
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.eval()
    detector.rpn.fg_bg_sampler.positive_fraction = 1.0
    detector.roi_heads.fg_bg_sampler.positive_fraction = 1.0
    scores = []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            torch.manual_seed(seed + i)
            out = model(
                batch["images"], image_sizes=batch["image_sizes"], original_sizes=batch["original_sizes"],
                targets=batch["targets"],
            )  # fmt: skip
            scores.append((sum(float(v) for v in out.losses.values()), i))
    torch.random.set_rng_state(state)
    return [f"img{i}" for _, i in sorted(scores)], [s for s, _ in scores]


def test_the_split_matches_a_naive_per_image_loop_and_leaves_the_model_as_it_was():
    batches = _batches(6)
    model = _detector().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    stream = torch.rand(3)
    torch.manual_seed(123)
    scores = image_losses(model, batches, seed=7)
    assert torch.equal(torch.rand(3), stream)  # the caller's generator is untouched
    assert not model.training and model.detector.rpn.fg_bg_sampler.positive_fraction == 0.5
    assert model.detector.roi_heads.fg_bg_sampler.positive_fraction == 0.25
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # no BatchNorm statistic moved
    assert [s.image_id for s in scores] == [f"img{i}" for i in range(6)]
    assert all(len(s.losses) == 4 and s.loss == pytest.approx(sum(s.losses.values())) for s in scores)

    order, naive_losses = _naive(_detector(), batches, seed=7)
    assert [s.loss for s in scores] == pytest.approx(naive_losses, rel=1e-6)
    assert lowest_loss(scores, 6) == order and lowest_loss(scores, 2) == order[:2]
    assert len(set(naive_losses)) == 6  # the images differ: the order is a real one


def test_equal_losses_keep_the_images_order_and_k_is_checked():
    scores = [ImageLoss(name, loss, {}) for name, loss in (("a", 2.0), ("b", 1.0), ("c", 2.0), ("d", 1.0))]
    assert lowest_loss(scores, 3) == ["b", "d", "a"]
    assert lowest_loss(scores, 0) == []
    with pytest.raises(ValueError, match="k must be in 0..4"):
        lowest_loss(scores, 5)


def test_a_batch_of_two_images_is_refused():
    batches = _batches(2)
    pair = {**batches[0], "image_ids": ["a", "b"]}
    with pytest.raises(ValueError, match="one image per batch"):
        image_losses(_detector(), [pair])
