"""Batching: padding, aspect-ratio grouping, distributed sampling, and the detector's inputs.

A collated batch (``collate``) is a dict, N = B * V rows (B images, V views of each; V = 1 for
plain items):

    images          float32 (N, 3, Hp, Wp), zero-padded (zero = the mean colour after normalisation) at
                    the bottom and right to multiples of ``size_divisor``
    proposals       list of N float32 (R_i, 4) in resized pixels
    image_labels    float32 (N, C) multi-hot
    image_sizes     list of N (h, w) resized, unpadded
    original_sizes  list of N (H, W) on disk
    targets         list of N dicts, each image's supervision (``wsod.data.targets``): "labels" (C,)
                    float32 (its row of image_labels) and any geometric fields as plain tensors in resized
                    (and flipped) pixels, e.g. "points" (P, 2) with "point_labels" (P,) int64; an item
                    without targets (built by hand) gets {"labels": its labels}; and "proposal_ids"
                    (R_i,) int64, each proposal's index in the image's proposal list as the dataset gave
                    it (the item's, ``wsod.data.transforms``; ``arange(R_i)`` for an item without them)
    image_ids       list of N ids
    flipped         list of N bools
    views           V, an int

The views axis (``data.train.views``, ``wsod.data.transforms.MultiViewTransform``): each item is a list
of V views of one image, and the views are flattened image-major, so row ``i * V + v`` of every list
and tensor above is view v of image i (its image id repeated V times). ``split_views(batch[key],
batch["views"])`` gives them back per image: ``[i][v]`` for a list, (B, V, ...) for a tensor. ROI j of
view v and ROI k of view w of one image are the same proposal iff their ``proposal_ids`` are equal (ROI
sampling keeps a different subset per view). With V = 1 the layout is the plain one: row i is image i.

``MODEL_INPUT_KEYS`` (the first six, and ``views``) are the keyword arguments of a detector's training
forward (``wsod.modeling.protocol.Detector``): ``model(**model_inputs(batch))``. Ground-truth boxes for
evaluation are not in a batch: evaluation reads them from the dataset (``WeakDetectionDataset.ground_truth``).

Sampling: every loader draws indices from a ``DistributedSampler`` (with one replica when not
distributed), so an epoch's order is a function of ``seed`` and the epoch number on every rank, and
groups them into batches of one aspect-ratio group (landscape or portrait) so that padding wastes little.
Training should run a number of iterations over ``infinite_batches(loader)``: ranks may form different
numbers of batches per epoch once batches are grouped, and an endless stream keeps them in step.
"""

from __future__ import annotations

import itertools
import math
import signal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

__all__ = [
    "MODEL_INPUT_KEYS",
    "collate",
    "concat_batches",
    "split_views",
    "model_inputs",
    "aspect_ratio_groups",
    "GroupedBatchSampler",
    "build_train_loader",
    "build_test_loader",
    "infinite_batches",
    "ignore_interrupts_in_worker",
]

MODEL_INPUT_KEYS = (
    "images",
    "proposals",
    "image_labels",
    "image_sizes",
    "original_sizes",
    "targets",
    "views",
)
SIZE_DIVISOR = 32

T = TypeVar("T")


def collate(items: Sequence[dict] | Sequence[Sequence[dict]], size_divisor: int = SIZE_DIVISOR) -> dict:
    """Transformed dataset items -> the batch dict of the module docstring. ``items``: B item dicts, or
    B lists of V view dicts each (``MultiViewTransform``), flattened image-major."""
    items, views = _flatten_views(items)
    sizes = [tuple(item["image"].shape[-2:]) for item in items]
    padded_h = math.ceil(max(h for h, _ in sizes) / size_divisor) * size_divisor
    padded_w = math.ceil(max(w for _, w in sizes) / size_divisor) * size_divisor
    images = items[0]["image"].new_zeros(len(items), 3, padded_h, padded_w)
    for image, item, (h, w) in zip(images, items, sizes, strict=True):
        image[:, :h, :w].copy_(item["image"])
    return {
        "images": images,
        "proposals": [item["proposals"] for item in items],
        "image_labels": torch.stack([item["labels"] for item in items]),
        "image_sizes": [tuple(item["image_size"]) for item in items],
        "original_sizes": [tuple(item["original_size"]) for item in items],
        "targets": [_targets(item) for item in items],
        "image_ids": [item["image_id"] for item in items],
        "flipped": [item["flipped"] for item in items],
        "views": views,
    }


def concat_batches(batches: Sequence[dict]) -> dict:
    """Collated batches of the same ``views`` -> one batch holding their rows in order (images padded
    to the largest, still multiples of the size divisor): how the third stage joins a batch of labelled
    and one of unlabelled images, drawn from two loaders (``wsod.runs.stage3``)."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    views = {batch["views"] for batch in batches}
    if len(views) > 1:
        raise ValueError(f"concat_batches joins batches of the same views, got {sorted(views)}")
    height = max(batch["images"].shape[-2] for batch in batches)
    width = max(batch["images"].shape[-1] for batch in batches)
    images = batches[0]["images"].new_zeros(sum(len(b["images"]) for b in batches), 3, height, width)
    row = 0
    for batch in batches:
        n, _, h, w = batch["images"].shape
        images[row : row + n, :, :h, :w].copy_(batch["images"])
        row += n
    joined = {"images": images, "image_labels": torch.cat([b["image_labels"] for b in batches])}
    for key in ("proposals", "image_sizes", "original_sizes", "targets", "image_ids", "flipped"):
        joined[key] = [value for batch in batches for value in batch[key]]
    joined["views"] = views.pop()
    return joined


def _flatten_views(items: Sequence[dict] | Sequence[Sequence[dict]]) -> tuple[list[dict], int]:
    """B items, or B lists of V views -> the B * V view dicts image-major, and V (1 for plain items)."""
    if not items:
        raise ValueError("collate needs at least one item")
    if all(isinstance(item, Mapping) for item in items):
        return list(items), 1
    if any(isinstance(item, Mapping) for item in items):
        raise TypeError("collate got item dicts mixed with lists of views; give B items or B view lists")
    counts = sorted({len(views) for views in items})
    if counts[0] < 1 or len(counts) > 1:
        raise ValueError(f"every item needs the same number (>= 1) of views to collate, got {counts}")
    return [view for views in items for view in views], counts[0]


def _targets(item: dict) -> dict:
    """The item's targets (its labels alone when it has none) with its ``proposal_ids`` (``arange(R)``
    when it has none): a new dict, so the item is left as it was."""
    targets = item.get("targets", {"labels": item["labels"]})
    ids = item.get("proposal_ids")
    return {**targets, "proposal_ids": torch.arange(len(item["proposals"])) if ids is None else ids}


def split_views(value: Sequence[T] | Tensor, views: int) -> list[list[T]] | Tensor:
    """A batch entry of N = B * V rows (image-major, the module docstring) per image: a list of B lists
    of V (``[i][v]`` is view v of image i), or for a tensor (B * V, ...) its (B, V, ...) view (no copy).
    ``views``: ``batch["views"]``."""
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise ValueError(f"views must be an integer >= 1 (batch['views']), got {views!r}")
    if len(value) % views:
        raise ValueError(f"{len(value)} rows do not split into views of {views}; pass the batch's own views")
    if isinstance(value, Tensor):
        return value.reshape(len(value) // views, views, *value.shape[1:])
    return [list(value[i : i + views]) for i in range(0, len(value), views)]


def model_inputs(batch: dict, device: torch.device | str | None = None) -> dict:
    """The detector's keyword arguments from a batch, moved to ``device`` when given. ``image_labels`` is
    None: the targets carry the same labels, and the detector stacks them (passing both would move them
    twice and make the detector compare them, a device sync, every step)."""
    inputs = {key: batch[key] for key in MODEL_INPUT_KEYS if key != "views"}
    inputs["views"] = batch.get("views", 1)  # a batch collated before views existed has one
    inputs["image_labels"] = None
    if device is not None:
        inputs["images"] = inputs["images"].to(device, non_blocking=True)
        inputs["proposals"] = [p.to(device, non_blocking=True) for p in inputs["proposals"]]
        inputs["targets"] = [
            {name: value.to(device, non_blocking=True) for name, value in targets.items()}
            for targets in inputs["targets"]
        ]
    return inputs


def aspect_ratio_groups(image_sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Group id per image: 0 for landscape or square (W >= H), 1 for portrait."""
    return [int(h > w) for h, w in image_sizes]


class GroupedBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` indices from ``sampler`` that share a group id.

    Indices are buffered per group in sampler order and a batch is emitted as soon as its group has
    ``batch_size`` of them. With ``drop_last`` the incomplete leftovers of an epoch are dropped (training;
    the next epoch's permutation differs), otherwise they come last as smaller batches (evaluation).
    ``set_epoch`` is passed on to the sampler; ``skip_batches(n)`` makes the passes over the current epoch
    start at its n-th batch without loading the ones before (resuming mid-epoch).

    With ``augmentation_seed`` set, each index comes as ``(index, sample_seed)`` with the seed a function
    of (augmentation_seed, epoch, index) alone: the dataset seeds that image's random transform with it,
    so augmentation does not depend on the number of workers, the rank, or where a run was resumed.
    """

    def __init__(
        self,
        sampler: Iterable[int],
        group_ids: Sequence[int],
        batch_size: int,
        drop_last: bool,
        augmentation_seed: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.sampler, self.group_ids = sampler, list(group_ids)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.augmentation_seed = augmentation_seed
        self.epoch = 0
        self._skip = 0

    def __iter__(self) -> Iterator[list[int]]:
        # The skip holds for the whole current epoch rather than for one __iter__ call: a multi-worker
        # DataLoader calls iter() on its batch sampler twice when it starts, and uses the second.
        return itertools.islice(self._batches(), self._skip, None)

    def _batches(self) -> Iterator[list]:
        buffers: dict[int, list] = {}
        for index in self.sampler:
            buffer = buffers.setdefault(self.group_ids[index], [])
            buffer.append(index if self.augmentation_seed is None else (index, self._sample_seed(index)))
            if len(buffer) == self.batch_size:
                yield buffer.copy()
                buffer.clear()
        if not self.drop_last:
            yield from (buffer for buffer in buffers.values() if buffer)

    def __len__(self) -> int:
        """Batches in the current epoch (the sampler's order is fixed by its seed and epoch)."""
        counts: dict[int, int] = {}
        for index in self.sampler:
            counts[self.group_ids[index]] = counts.get(self.group_ids[index], 0) + 1
        rounding = math.floor if self.drop_last else math.ceil
        return sum(rounding(n / self.batch_size) for n in counts.values())

    def _sample_seed(self, index: int) -> int:
        # Two large odd multipliers keep (seed, epoch, index) triples apart; 63 bits fit manual_seed.
        return ((self.augmentation_seed * 1_000_003 + self.epoch) * 998_244_353 + index) % 2**63

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._skip = 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def skip_batches(self, count: int) -> None:
        """Start the passes over the current epoch at its ``count``-th batch (until ``set_epoch``)."""
        self._skip = count


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else torch.distributed's when it is initialised, else a single process."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    return rank, world_size


def ignore_interrupts_in_worker(worker_id: int) -> None:
    """Every loader's ``worker_init_fn``: the worker ignores SIGINT. Ctrl-C reaches every process of the
    terminal's foreground group, and the main process stops cleanly on it (``wsod.engine.interrupt``):
    a worker that died of it would break the step being finished. SIGTERM keeps its default, which the
    loader uses to end a stuck worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _loader(
    dataset: Dataset, batch_sampler: Sampler, num_workers: int, seed: int, pin_memory: bool
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # Workers live across epochs (infinite_batches would otherwise restart them every epoch).
        persistent_workers=num_workers > 0,
        # Fixes the seeds of the workers' random transforms.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=ignore_interrupts_in_worker,  # Ctrl-C is the main process's (a clean stop)
    )


def build_train_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_workers: int = 2,
    seed: int = 0,
    group_by_aspect_ratio: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    pin_memory: bool = False,
) -> DataLoader:
    """Shuffled, aspect-ratio grouped batches of ``batch_size`` images per process; drops leftovers.

    ``dataset`` needs ``image_sizes`` for grouping (``WeakDetectionDataset`` has it). The rank and
    world size default to torch.distributed's; every rank sees a disjoint share of each epoch.
    """
    rank, world_size = _rank_and_world(rank, world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    groups = aspect_ratio_groups(dataset.image_sizes) if group_by_aspect_ratio else [0] * len(dataset)
    batches = GroupedBatchSampler(sampler, groups, batch_size, drop_last=True, augmentation_seed=seed)
    return _loader(dataset, batches, num_workers, seed, pin_memory)


def build_test_loader(
    dataset: Dataset,
    batch_size: int = 1,
    *,
    num_workers: int = 2,
    rank: int | None = None,
    world_size: int | None = None,
    pin_memory: bool = False,
) -> DataLoader:
    """Every image exactly once, in dataset order, split over ranks by striding (no padding duplicates,
    unlike ``DistributedSampler``); batches larger than one are grouped by aspect ratio."""
    rank, world_size = _rank_and_world(rank, world_size)
    indices = range(rank, len(dataset), world_size)
    groups = aspect_ratio_groups(dataset.image_sizes) if batch_size > 1 else [0] * len(dataset)
    batches = GroupedBatchSampler(indices, groups, batch_size, drop_last=False)
    return _loader(dataset, batches, num_workers, 0, pin_memory)


def infinite_batches(loader: DataLoader, start_batch: int = 0) -> Iterator[dict]:
    """Batches without end, epoch after epoch (``set_epoch`` before each, so each is reshuffled).

    ``start_batch``: the stream continues as if that many batches had been drawn already, skipping
    whole epochs and then the first batches of an epoch without loading them (exact resume).
    """
    sampler = loader.batch_sampler
    epoch, skip = 0, start_batch
    while True:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        length = len(sampler)
        if length == 0:
            raise ValueError("the loader forms no batch in an epoch (batch size above the group sizes?)")
        if skip >= length:
            skip, epoch = skip - length, epoch + 1
            continue
        if skip:
            if not hasattr(sampler, "skip_batches"):
                raise TypeError("start_batch needs a batch sampler with skip_batches (GroupedBatchSampler)")
            sampler.skip_batches(skip)
            skip = 0
        yield from loader
        epoch += 1
