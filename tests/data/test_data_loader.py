"""Batches: padding, the detector's keyword arguments, aspect-ratio grouping, distributed sampling."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from wsod.benchmarks.loader import measure_loader_throughput
from wsod.data.dataset import ConcatWeakDataset
from wsod.data.loader import (
    MODEL_INPUT_KEYS,
    GroupedBatchSampler,
    aspect_ratio_groups,
    build_test_loader,
    build_train_loader,
    collate,
    concat_batches,
    infinite_batches,
    model_inputs,
)
from wsod.data.transforms import test_transform, train_transform
from wsod.modeling import WeaklySupervisedDetector, build_detector


def _item(height, width, image_id, num_proposals=3, with_gt=True):
    item = {
        "image": torch.full((3, height, width), 1.0),
        "image_id": image_id,
        "labels": torch.tensor([0.0, 1.0]),
        "proposals": torch.tensor([[0.0, 0.0, 4.0, 4.0]]).repeat(num_proposals, 1),
        "image_size": (height, width),
        "original_size": (height * 2, width * 2),
        "flipped": False,
    }
    if with_gt:
        item.update(
            gt_boxes=torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
            gt_labels=torch.tensor([1]),
            gt_difficult=torch.tensor([False]),
        )
    return item


def test_collate_pads_to_the_size_divisor_and_keeps_per_image_fields():
    batch = collate([_item(40, 70, "a", 3), _item(65, 20, "b", 5, with_gt=False)])
    assert batch["images"].shape == (2, 3, 96, 96)
    assert batch["images"][0, :, :40, :70].eq(1).all() and batch["images"][0, :, 40:].eq(0).all()
    assert batch["images"][0, :, :, 70:].eq(0).all() and batch["images"][1, :, :65, :20].eq(1).all()
    assert [p.shape[0] for p in batch["proposals"]] == [3, 5]
    assert batch["image_labels"].shape == (2, 2) and batch["image_labels"].dtype == torch.float32
    assert batch["image_sizes"] == [(40, 70), (65, 20)] and batch["original_sizes"] == [(80, 140), (130, 40)]
    assert batch["image_ids"] == ["a", "b"] and batch["flipped"] == [False, False]
    # Items built without targets get their labels and ROI ids as targets; ground truth is not a batch field.
    assert [set(t) for t in batch["targets"]] == [{"labels", "proposal_ids"}] * 2
    assert "annotations" not in batch and batch["views"] == 1
    torch.testing.assert_close(batch["targets"][1]["labels"], batch["image_labels"][1])
    assert collate([_item(64, 32, "c")])["images"].shape == (1, 3, 64, 32)


def test_model_inputs_are_exactly_the_detector_keyword_arguments():
    parameters = inspect.signature(WeaklySupervisedDetector.forward).parameters
    options = {"self", "teacher_scores", "progress", "keep"}  # what the step adds (teacher, progress, extras)
    assert set(MODEL_INPUT_KEYS) == set(parameters) - options
    batch = collate([_item(40, 70, "a")])
    inputs = model_inputs(batch, device="cpu")
    assert set(inputs) == set(MODEL_INPUT_KEYS) and inputs["images"] is not None


def test_grouped_batches_share_an_aspect_ratio_and_cover_every_index():
    sizes = [(10, 20), (20, 10), (10, 10), (30, 10), (5, 50), (40, 10), (10, 11)]
    groups = aspect_ratio_groups(sizes)
    assert groups == [0, 1, 0, 1, 0, 1, 0]
    sampler = GroupedBatchSampler(range(7), groups, batch_size=2, drop_last=False)
    batches = list(sampler)
    assert batches == [[0, 2], [1, 3], [4, 6], [5]] and len(sampler) == 4
    assert all(len({groups[i] for i in b}) == 1 for b in batches)
    dropped = GroupedBatchSampler(range(7), groups, batch_size=2, drop_last=True)
    assert list(dropped) == [[0, 2], [1, 3], [4, 6]] and len(dropped) == 3


def test_distributed_ranks_see_disjoint_shares(tiny_toy):
    dataset = tiny_toy.dataset("trainval", transform=train_transform((64,), 128))
    seen = []
    for rank in range(2):
        loader = build_train_loader(dataset, 2, num_workers=0, rank=rank, world_size=2, seed=3)
        assert isinstance(loader.batch_sampler.sampler, DistributedSampler)
        seen.append([i for batch in loader.batch_sampler for i in batch])
    assert not set(seen[0]) & set(seen[1]) and len(seen[0]) == len(seen[1]) == 4  # 5 each, 1 left over
    test_shares = [
        [
            i
            for b in build_test_loader(dataset, 3, num_workers=0, rank=r, world_size=2).batch_sampler
            for i in b
        ]
        for r in range(2)
    ]
    assert sorted(test_shares[0] + test_shares[1]) == list(range(len(dataset)))


def test_epochs_are_reshuffled_reproducible_and_resumable(tiny_toy):
    dataset = tiny_toy.dataset("trainval", transform=train_transform((64,), 128))

    def stream(start=0, count=6):
        loader = build_train_loader(dataset, 3, num_workers=0, seed=1)  # 3 batches of 3 per epoch of 10
        return [b["image_ids"] for b in itertools.islice(infinite_batches(loader, start), count)]

    full = stream(count=8)
    assert full[:6] == stream() and full[:3] != full[3:6]
    # Resuming after 4 batches (mid second epoch) continues the very same stream.
    assert stream(start=4, count=4) == full[4:]
    assert stream(start=6, count=2) == full[6:]


def test_augmentation_is_seeded_per_image_not_per_worker_or_resume(tiny_toy):
    # Scale, flip and lighting noise: every random draw of the training transform.
    transform = train_transform((48, 64, 80), 200, flip_prob=0.5, lighting_std=0.1)
    dataset = tiny_toy.dataset("trainval", transform=transform)

    def stream(workers, start=0, count=5, data=dataset):
        loader = build_train_loader(data, 2, num_workers=workers, seed=3)
        return list(itertools.islice(infinite_batches(loader, start), count))

    reference = stream(0)
    assert len({b["images"].shape for b in reference}) > 1 and any(any(b["flipped"]) for b in reference)
    # The lighting noise is there (the same stream without it differs in pixels only).
    no_lighting = train_transform((48, 64, 80), 200, flip_prob=0.5, lighting_std=0.0)
    plain = stream(0, data=tiny_toy.dataset("trainval", transform=no_lighting))
    for ours, theirs in zip(plain, reference, strict=True):
        assert ours["flipped"] == theirs["flipped"] and ours["images"].shape == theirs["images"].shape
        assert not torch.equal(ours["images"], theirs["images"])
    for batches in (stream(2), [*reference[:2], *stream(2, start=2, count=3)]):
        for ours, theirs in zip(batches, reference, strict=True):
            assert ours["image_ids"] == theirs["image_ids"] and ours["flipped"] == theirs["flipped"]
            torch.testing.assert_close(ours["images"], theirs["images"], rtol=0, atol=0)
            torch.testing.assert_close(ours["proposals"], theirs["proposals"], rtol=0, atol=0)
    # The training process's own random stream is left alone.
    torch.manual_seed(0)
    stream(0, count=1)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), after)


def test_loader_batches_run_through_the_detector(tiny_toy):
    dataset = tiny_toy.dataset("test", transform=test_transform(96, 200))
    batch = next(iter(build_test_loader(dataset, batch_size=2, num_workers=0)))
    assert batch["images"].shape == (2, 3, 96, 96)
    assert batch["image_labels"].shape == (2, len(tiny_toy.classes))
    torch.manual_seed(0)
    model = build_detector("resnet18", num_classes=len(tiny_toy.classes), chunk_size=None, width=0.25)
    losses = model.train()(**model_inputs(batch)).losses
    assert torch.isfinite(sum(losses.values()))
    detections = model.eval()(**model_inputs(batch))
    for result, (height, width) in zip(detections, batch["original_sizes"], strict=True):
        assert (height, width) == (160, 160)
        assert (result["boxes"][:, 2] <= width).all() and (result["boxes"][:, 3] <= height).all()


def test_two_workers_deliver_the_same_batches_as_none(tiny_toy):
    dataset = tiny_toy.dataset("trainval", transform=test_transform(64, 128))
    loaders = [build_train_loader(dataset, 2, num_workers=n, seed=5) for n in (0, 2)]
    batches = [list(loader) for loader in loaders]
    assert [b["image_ids"] for b in batches[0]] == [b["image_ids"] for b in batches[1]]
    torch.testing.assert_close(batches[0][-1]["images"], batches[1][-1]["images"])
    torch.testing.assert_close(batches[0][-1]["proposals"], batches[1][-1]["proposals"])


def test_throughput_measurement_counts_images(tiny_toy):
    dataset = tiny_toy.dataset("trainval", transform=test_transform(64, 128))
    result = measure_loader_throughput(build_train_loader(dataset, 2, num_workers=0), num_batches=7)
    assert result.images == 14 and result.batches == 7 and result.images_per_second > 0
    assert result.proposals_per_image > 10


def test_concatenated_datasets_keep_sizes_ids_and_seeded_indexing(tiny_toy):
    transform = train_transform((48, 64, 80), 200, flip_prob=0.5)
    first, second = (
        tiny_toy.dataset("trainval", transform=transform),
        tiny_toy.dataset("test", transform=transform),
    )
    both = ConcatWeakDataset([first, second])
    assert len(both) == len(first) + len(second) and both.num_classes == first.num_classes
    assert both.image_ids == first.image_ids + second.image_ids
    assert both.image_sizes == first.image_sizes + second.image_sizes
    last = len(first) + 1
    ours, theirs = both[(last, 77)], second[(1, 77)]
    assert ours["image_id"] == theirs["image_id"] == second.image_ids[1]
    torch.testing.assert_close(ours["image"], theirs["image"], rtol=0, atol=0)
    batch = next(iter(build_train_loader(both, 2, num_workers=0, seed=0)))
    assert batch["images"].shape[0] == 2


def test_concat_batches_joins_two_batches_row_for_row():
    first = collate([[_view_item(20, 30, 1), _view_item(20, 30, 2)]])
    second = collate(
        [[_view_item(40, 70, 3), _view_item(40, 70, 4)], [_view_item(40, 50, 5), _view_item(40, 50, 6)]]
    )
    joined = concat_batches([first, second])
    assert joined["views"] == 2 and joined["images"].shape == (6, 3, 64, 96)
    assert joined["image_ids"] == first["image_ids"] + second["image_ids"]
    assert joined["image_sizes"] == first["image_sizes"] + second["image_sizes"]
    torch.testing.assert_close(joined["images"][:2, :, :32, :32], first["images"])
    assert not joined["images"][:2, :, 32:].any() and not joined["images"][:2, :, :, 32:].any()  # padding
    torch.testing.assert_close(joined["images"][2:], second["images"][:, :, :64, :96])
    torch.testing.assert_close(
        joined["image_labels"], torch.cat([first["image_labels"], second["image_labels"]])
    )
    with pytest.raises(ValueError, match="same views"):
        concat_batches([first, collate([_view_item(20, 30, 7)])])


def _view_item(h: int, w: int, value: int) -> dict:
    return {
        "image": torch.full((3, h, w), float(value)),
        "proposals": torch.tensor([[0.0, 0.0, 5.0, 5.0]]),
        "labels": torch.tensor([1.0, 0.0]),
        "image_size": (h, w),
        "original_size": (h, w),
        "image_id": f"img{value}",
        "flipped": False,
    }
