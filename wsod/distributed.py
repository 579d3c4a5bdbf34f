"""Everything wsod does across processes, in one place: who am I, wait for each other, share a value.

Every function works unchanged in a single process (torch.distributed not initialised): rank 0 of a
world of 1, barriers return at once, broadcasts return their argument. Under ``torchrun`` the process
group is joined by ``setup_distributed`` (NCCL on CUDA with this process's GPU, gloo on CPU).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "setup_distributed",
    "cleanup_distributed",
    "is_distributed",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "barrier",
    "main_process_first",
    "broadcast_object",
    "gather_to_main",
    "all_reduce_mean",
]

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def setup_distributed() -> tuple[int, int]:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1); returns (rank, world).

    On CUDA each process takes the GPU ``LOCAL_RANK`` and passes it to ``init_process_group`` as its
    ``device_id``, so NCCL binds the communicator to that GPU at once instead of guessing it later.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not is_distributed():
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return get_rank(), get_world_size()


def cleanup_distributed() -> None:
    """Leave the process group (every torchrun process must, or the job ends with warnings or hangs)."""
    if is_distributed():
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (e.g. downloads weights, generates data into a cache);
    the others wait for it, then run the block themselves and find the result in place."""
    if not is_main_process():
        barrier()
    try:
        yield
    finally:
        if is_main_process():
            barrier()


def broadcast_object(value: T, src: int = 0) -> T:
    """``value`` as the process ``src`` holds it, on every process (any picklable object)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_to_main(value: T) -> list[T] | None:
    """Each process's ``value``, in rank order, on the main process; ``None`` on the others."""
    if not is_distributed():
        return [value]
    gathered: list[Any] | None = [None] * get_world_size() if is_main_process() else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over processes (a new tensor; the input is left alone)."""
    values = values.clone()
    if is_distributed():
        dist.all_reduce(values)
        values /= get_world_size()
    return values
