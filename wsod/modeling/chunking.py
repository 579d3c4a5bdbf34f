"""``chunk_size="auto"``: plain autograd when a step's ROIs fit a memory budget, else the largest chunk.

Sequential backprop (``wsod.sequential_backprop``) trades one extra forward of the per-ROI neck for
memory. When the memory is there, that trade is pure loss. The auto mode decides per step, from the
step's ROI count R and a per-ROI cost c of the neck measured once:

* ``R x c <= budget``: plain autograd (the body is called directly, no autograd Function): zero time
  overhead, the same peak and gradients as ``chunk_size=None``;
* else sequential backprop with ``chunk = floor(budget / c)`` ROIs (at least 1): the same gradients as
  that fixed chunk size, and the neck's memory stays within the budget.

**What the budget covers**: the memory of the ROI head's body, i.e. what ``SequentialBackprop`` wraps
(ROI pooling + neck when ``fuse_pooling``, the neck alone otherwise): its activations kept for backward
(of all ROIs with plain autograd, of one chunk when chunked) and its backward's transient gradients. Not
the base, its feature map, the heads, the losses, parameters, gradients or optimizer state.

**The per-ROI cost** (``measure_neck_cost``) comes from one forward of the body on two small probes
(4 and 8 ROIs taken from the step) under ``torch.autograd.graph.saved_tensors_hooks``, in the step's
precision (autocast), without a backward:

* saved: the bytes autograd keeps for backward per ROI (storages counted once, parameters excluded):
  the slope between the two probes, so fixed costs such as autocast's weight casts cancel;
* transient: twice the largest single saved tensor per ROI: in backward, the gradient of an activation
  and the gradient of its producer's input are alive at once, on top of what is still saved.

The estimate is deterministic and the same on every device; it needs no backward (so no gradient is
touched and DistributedDataParallel's hooks never fire) and no allocator statistics (CPU has none). It
was checked against real peaks (MB = 2^20 bytes): ResNet-50 res5 with fused 14x14 RoIAlign, float32, on
CPU: estimate 2.78 + 1.53 = 4.31 MB per ROI, against 4.32 MB per ROI of peak resident memory for the
body's forward + backward alone and for a whole plain-autograd training step (docs/BENCHMARKS.md). In
bf16 the estimate is conservative (1.77 + 1.53 = 3.30 against 2.15 MB per ROI measured for plain
autograd: RoIAlign's output stays float32 under autocast). CUDA's own peak (``max_memory_allocated`` around a
probe's forward and backward) is not used: it would need a backward through the neck's parameters at
start-up and depends on cuDNN's workspace choices for 8 ROIs rather than thousands; the GPU check
(``tools/gpu_check.sh``) reports auto's real peaks against its budget instead.

**The budget** (``resolve_budget``): ``memory_budget_gb`` when given. Otherwise, on CUDA, the memory
the caching allocator can still hand out when the first forward runs (the device's free memory plus
what the allocator holds unused, capped by ``torch.cuda.set_per_process_memory_fraction``) minus a
margin of a quarter of it, at least 2 GiB. The margin is for what the budget does not cover and is not
allocated yet at that moment: parameter gradients and optimizer state (first allocated by the first
backward and step), the heads and losses of all ROIs, a larger image later in training (the VOC recipe
draws shorter sides from 480 to 1200 px: up to 6x the base's activations of the first image), cuDNN
workspaces and allocator fragmentation. On CPU there is no reliable free-memory figure for a process,
so training needs an explicit budget (``ValueError`` naming ``model.memory_budget_gb``); inference
without one runs in chunks of ``INFERENCE_FALLBACK_CHUNK`` ROIs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "AUTO",
    "AutoChunk",
    "Budget",
    "NeckCost",
    "measure_neck_cost",
    "precision_key",
    "resolve_budget",
    "GIB",
    "MIB",
    "CUDA_MARGIN_FRACTION",
    "CUDA_MARGIN_MIN_BYTES",
    "INFERENCE_FALLBACK_CHUNK",
    "PROBE_ROIS",
]

AUTO = "auto"
GIB = 2**30
MIB = 2**20
# Margin below the CUDA memory the allocator can still hand out (module docstring): 25 %, >= 2 GiB.
CUDA_MARGIN_FRACTION = 0.25
CUDA_MARGIN_MIN_BYTES = 2 * GIB
# Inference on CPU without a budget: chunks of this many ROIs (the recipes' training chunk).
INFERENCE_FALLBACK_CHUNK = 256
# The two probe sizes of the cost measurement (ROIs); a saved tensor whose first dimension equals the
# larger one is taken as per-ROI when looking for the largest.
PROBE_ROIS = (4, 8)


@dataclass(frozen=True)
class NeckCost:
    """Bytes per ROI of the body's memory: ``saved`` (kept for backward) + ``transient`` (backward's
    gradient buffers), measured in ``dtype`` (the autocast dtype, or the inputs' dtype)."""

    saved: float
    transient: float
    dtype: str

    @property
    def per_roi(self) -> float:
        return self.saved + self.transient

    def describe(self) -> str:
        return (
            f"{self.per_roi / MIB:.3f} MB per ROI in {self.dtype} (saved activations"
            f" {self.saved / MIB:.3f} + backward transient {self.transient / MIB:.3f})"
        )


@dataclass(frozen=True)
class Budget:
    """``bytes`` the body may use and how that number was found (for the log)."""

    bytes: float
    source: str


@dataclass(frozen=True)
class AutoChunk:
    """The auto policy: ``choose(R)`` is ``None`` (plain autograd) when ``R x per_roi_bytes`` fits
    ``budget_bytes``, else the chunk ``floor(budget_bytes / per_roi_bytes)``, at least 1."""

    budget_bytes: float
    per_roi_bytes: float

    def __post_init__(self) -> None:
        if not self.budget_bytes >= 0 or not self.per_roi_bytes >= 0:
            raise ValueError(
                f"AutoChunk needs budget_bytes >= 0 and per_roi_bytes >= 0, got {self.budget_bytes},"
                f" {self.per_roi_bytes}"
            )

    @property
    def max_rois(self) -> int | float:
        """The most ROIs whose body fits the budget at once (``inf`` for a cost of zero)."""
        return math.inf if self.per_roi_bytes == 0 else math.floor(self.budget_bytes / self.per_roi_bytes)

    def choose(self, num_rois: int) -> int | None:
        if num_rois * self.per_roi_bytes <= self.budget_bytes:
            return None
        return max(1, int(self.max_rois))


def _storage(t: Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _saved_bytes(
    module: nn.Module, inputs: Sequence[Any], num_rois: int, parameters: set[int]
) -> tuple[int, int]:
    """One forward of ``module`` with gradients on: (bytes autograd saves, counted once per storage and
    without parameters; bytes of the largest saved tensor whose first dimension is ``num_rois``)."""
    saved: dict[int, int] = {}
    largest = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal largest
        pointer, nbytes = _storage(t)
        if pointer not in parameters and nbytes:
            saved[pointer] = nbytes
            if t.dim() and t.shape[0] == num_rois:
                largest = max(largest, nbytes)
        # Kept as autograd would keep it, so that no storage is freed and its address reused during the
        # forward; detached, because a saved output returned as itself would hold its own grad_fn: a
        # reference cycle through C++ autograd nodes that no garbage collection frees.
        return t.detach()

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    del out  # the graph and what it saved go with it: nothing is back-propagated
    return sum(saved.values()), largest


def measure_neck_cost(
    module: nn.Module,
    inputs: Sequence[Any],
    *,
    split: Sequence[int],
    grad_inputs: Sequence[int] = (0,),
    probe: tuple[int, int] = PROBE_ROIS,
) -> NeckCost:
    """The per-ROI memory cost of ``module`` (module docstring): forwards on ``probe[0]`` and
    ``probe[1]`` ROIs drawn from ``inputs`` (the split tensor inputs at positions ``split`` indexed by
    ROI, repeated when the step has fewer; other inputs passed whole), with the inputs at positions
    ``grad_inputs`` requiring grad as in training. The RNG state is restored afterwards, so that the
    probes draw nothing from the stream training uses (dropout)."""
    small, large = probe
    tensors = [x for x in inputs if isinstance(x, Tensor)]
    device = tensors[0].device
    num_rois = inputs[split[0]].shape[0]
    dtype = precision_key(device, inputs[grad_inputs[0]])
    parameters = {_storage(p)[0] for p in module.parameters()}

    def probe_inputs(count: int) -> list[Any]:
        index = torch.arange(count, device=device) % max(num_rois, 1)
        out = []
        for i, x in enumerate(inputs):
            if isinstance(x, Tensor):
                x = x.detach()[index] if i in split else x.detach()
                x = x.requires_grad_(i in grad_inputs and x.is_floating_point())
            out.append(x)
        return out

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        saved_small, _ = _saved_bytes(module, probe_inputs(small), small, parameters)
        saved_large, largest = _saved_bytes(module, probe_inputs(large), large, parameters)
    saved = max(0.0, (saved_large - saved_small) / (large - small))
    return NeckCost(saved=saved, transient=2 * largest / large, dtype=dtype)


def precision_key(device: torch.device, x: Tensor) -> str:
    """The precision a forward on ``device`` computes in (a measured cost holds for it alone):
    autocast's dtype when autocast is on, else the dtype of ``x`` (the feature map or pooled features)."""
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x.dtype
    return str(dtype).replace("torch.", "")


def _cuda_available_bytes(device: torch.device) -> tuple[float, str]:
    """What the caching allocator of CUDA ``device`` can still hand out: the device's free memory plus
    the allocator's reserved-but-unused blocks, capped by the per-process memory fraction."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    reserved = torch.cuda.memory_reserved(index)
    available = free + (reserved - allocated)
    how = f"free {free / GIB:.2f} GB + cached {(reserved - allocated) / GIB:.2f} GB"
    fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction_of is not None:
        cap = fraction_of(index) * total - allocated
        if cap < available:
            available, how = cap, f"{how}, capped by the per-process memory fraction at {cap / GIB:.2f} GB"
    return available, how


def resolve_budget(memory_budget_gb: float | None, device: torch.device) -> Budget | None:
    """The body's budget (module docstring): the given GB, or on CUDA the allocator's available memory
    minus the margin; ``None`` on other devices without a given budget."""
    if memory_budget_gb is not None:
        return Budget(memory_budget_gb * GIB, f"memory_budget_gb={memory_budget_gb:g}")
    if device.type != "cuda":
        return None
    available, how = _cuda_available_bytes(device)
    margin = max(CUDA_MARGIN_MIN_BYTES, CUDA_MARGIN_FRACTION * available)
    budget = max(0.0, available - margin)
    return Budget(
        budget,
        f"{device}: {how} = {available / GIB:.2f} GB available at the first forward, minus a margin of"
        f" {margin / GIB:.2f} GB (max of 2 GB and 25 %)",
    )
