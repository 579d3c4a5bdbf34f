"""Data-loader throughput: how many images per second a loader delivers, with nothing consuming them."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from torch.utils.data import DataLoader

from wsod.data.loader import infinite_batches

__all__ = ["LoaderThroughput", "measure_loader_throughput"]


@dataclass(frozen=True)
class LoaderThroughput:
    images: int
    batches: int
    seconds: float
    proposals_per_image: float

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else float("inf")


def measure_loader_throughput(
    loader: DataLoader, num_batches: int, warmup_batches: int = 2
) -> LoaderThroughput:
    """Time ``num_batches`` batches after ``warmup_batches`` (worker start-up and first prefetch excluded).

    Batches come from ``infinite_batches``, so ``num_batches`` may exceed one epoch.
    """
    stream = infinite_batches(loader)
    for _ in itertools.islice(stream, warmup_batches):
        pass
    images = proposals = 0
    start = time.perf_counter()
    for batch in itertools.islice(stream, num_batches):
        images += len(batch["image_ids"])
        proposals += sum(len(p) for p in batch["proposals"])
    seconds = time.perf_counter() - start
    return LoaderThroughput(images, num_batches, seconds, proposals / max(images, 1))
