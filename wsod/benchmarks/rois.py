"""How many ROIs fit: peak memory and step time of one detector training step versus ROI count.

One measurement is one full training step of the detector with its losses (forward, backward, SGD
step) on a synthetic image with random proposals and labels, for one back-propagation strategy. The
step is the training loop's own, ``wsod.engine.step.train_step``, on a collated batch of that one
image, with the variant's companions (``+dropblock``, ``+gradnorm``, ``+ema``: ``split_variant``) and
``amp="bf16"`` for bf16 rows (resolved as training resolves it, ``wsod.engine.amp.resolve_amp``: CUDA
only). So the measured step includes what training runs around the update: the finiteness checks of
the loss, the gradient norm, the BatchNorm buffers and the updated parameters (a few ``.item()``
synchronisations), and the copy of the buffers that a skipped step restores (a few hundred kilobytes
for ResNet-50). The one exception is ``+gradnorm_retain``, GradNorm in the usual order, which training
never runs: a comparison (``gradnorm_retain_comparison``), not a training step. The strategies:

* ``plain``: plain autograd through ROI pooling and res5;
* ``checkpoint``: ``torch.utils.checkpoint`` around res5 (recomputes all ROIs at once in backward);
* ``paper``: sequential backprop around res5 only, the pooled (R, C4, 14, 14) tensor kept (the paper);
* ``fused``: wsod's sequential backprop with pooling and res5 recomputed together;
* ``ckpt_chunk``, ``offload``, ``compile``, ``vmap_chunk``: the stock PyTorch alternatives around the
  same body (pooling + res5), in ``wsod.benchmarks.stock_backprop``: a non-reentrant checkpoint per chunk
  of ROIs, activation offloading, ``torch.compile`` with an activation memory budget, ``torch.func.vmap``
  with a chunk size;
* ``auto``: ``chunk_size="auto"`` with a budget for the pooling + neck (``auto_budget_gb``; ``None``: on
  CUDA the allocator's available memory less the margin, ``wsod.modeling.chunking``): plain autograd when
  the step's ROIs fit, else fused chunks of the largest size that does. Its rows record the choice
  (``auto_chunk``: ``plain`` or the chunk) and the measured per-ROI cost (``auto_mb_per_roi``).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` minus the memory allocated before the
measured steps; on CPU the peak resident set size of a fresh process per measurement minus its resident
size before the measured step (see ``measure``). Both are reset after the warm-up steps, and the
gradients are released first, so the baseline is what persists between steps (model, batch, optimizer
state, an EMA teacher's copy of the weights). The CPU memory process runs no warm-up step, except for
``compile``, whose first step compiles.
Step time: the median over ``steps`` steps after ``warmup`` steps.
"""

from __future__ import annotations

import csv
import itertools
import math
import multiprocessing
import os
import queue as queue_module
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from wsod.benchmarks.stock_backprop import STOCK_STRATEGIES, StockBackpropBody
from wsod.data.loader import model_inputs
from wsod.engine.adversarial import DropBlockAdversary
from wsod.engine.amp import autocast, resolve_amp
from wsod.engine.balancing import LossBalancer
from wsod.engine.companion import Companion
from wsod.engine.ema import EMATeacher
from wsod.engine.solver import build_scheduler
from wsod.engine.step import train_step
from wsod.modeling.detector import WeaklySupervisedDetector, build_backbone, detector_from_backbone
from wsod.modeling.method import TrainingProgress

__all__ = [
    "STRATEGIES",
    "CHUNKED",
    "VARIANTS",
    "split_variant",
    "MODELS",
    "Measurement",
    "build_benchmark_model",
    "synthetic_batch",
    "gradnorm_retain_comparison",
    "cap_cuda_memory",
    "allocator_peak_mb",
    "measure",
    "linear_fit",
    "find_max_rois",
    "largest_within_budget",
    "strategy_label",
    "predicted_max_rois",
    "summarize",
    "format_table",
    "slopes",
    "write_csv",
    "write_markdown",
    "plot",
]

STRATEGIES = ("plain", "checkpoint", "paper", "fused", "auto", *STOCK_STRATEGIES)
# The strategies that take a chunk size (``--chunk``).
CHUNKED = ("paper", "fused", "ckpt_chunk", "vmap_chunk")
VARIANTS = ("dropblock", "gradnorm", "gradnorm_retain", "ema")
# The DropBlock scorer's hidden width per model, as its config (configs/model/*.yaml) sets it.
DROPBLOCK_HIDDEN = {"r50_c4": 256, "r101_c4": 256}
MODELS = {"r18_c4": "resnet18", "r50_c4": "resnet50", "r101_c4": "resnet101", "vgg16": "vgg16"}
# What each backbone's ROI pooler needs (configs/model/*.yaml): VGG16's fc6 takes RoIPool 7x7.
ROI_POOLING = {"vgg16": {"pooler": "pool", "roi_size": 7}}
NUM_CLASSES = 20


@dataclass
class Measurement:
    """One row of results.csv. ``peak_mb`` and ``step_ms`` are NaN when the step ran out of memory
    (``status`` "oom") or torch.compile could not build it (``status`` "failed", ``note`` says why);
    ``baseline_mb`` is what model and batch took before the step (not included in ``peak_mb``). For
    ``auto``: ``budget_gb`` (None: found by itself on CUDA), ``auto_chunk`` ("plain" or the chunk it
    chose) and ``auto_mb_per_roi`` (its measured per-ROI cost)."""

    strategy: str
    chunk: int | None
    rois: int
    peak_mb: float
    step_ms: float
    device: str
    model: str
    image_size: str
    dtype: str
    baseline_mb: float
    status: str = "ok"
    budget_gb: float | None = None
    auto_chunk: str = ""
    auto_mb_per_roi: float = math.nan
    auto_budget_mb: float = math.nan
    note: str = ""


class _CheckpointedNeck(nn.Module):
    """``torch.utils.checkpoint`` around a module: activations recomputed for all ROIs at once."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=False)


def split_variant(strategy: str) -> tuple[str, str | None]:
    """``"fused+dropblock"`` -> ``("fused", "dropblock")``; ``"fused"`` -> ``("fused", None)``.

    Variants of a training step, each measured against the same strategy without it:
    ``dropblock``: Concrete DropBlock, plus the adversarial step (a second forward and backward);
    ``gradnorm``: GradNorm in wsod's order (per-loss norms at the ROI features, then one backward);
    ``gradnorm_retain``: GradNorm in the usual order (the full backward with ``retain_graph=True``, then
    one ``create_graph`` gradient per loss), the graph kept alive throughout: a comparison, not a
    training step (``gradnorm_retain_comparison``);
    ``ema``: the EMA teacher (``wsod.engine.ema.EMATeacher``, momentum 0.999, following every module
    group): its no-grad scoring forward before the student's, its update after the step; its copy of
    the weights is made with the model, so it is in the baseline.
    """
    base, _, variant = strategy.partition("+")
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown variant '+{variant}': expected one of {VARIANTS}")
    return base, variant or None


def build_benchmark_model(
    model: str, strategy: str, chunk: int | None, auto_budget_gb: float | None = None
) -> WeaklySupervisedDetector:
    """The detector for one strategy (optionally with a ``+variant``): ``model`` in MODELS, random
    weights, 20 classes; ``auto`` with ``auto_budget_gb``."""
    if model not in MODELS:
        raise ValueError(f"unknown model '{model}': expected one of {sorted(MODELS)}")
    strategy, variant = split_variant(strategy)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy '{strategy}': expected one of {STRATEGIES}")
    backbone = build_backbone(MODELS[model])
    if strategy == "checkpoint":
        backbone = replace(backbone, neck=_CheckpointedNeck(backbone.neck))
    sequential = strategy in ("paper", "fused")
    detector = detector_from_backbone(
        backbone,
        NUM_CLASSES,
        chunk_size="auto" if strategy == "auto" else chunk if sequential else None,
        fuse_pooling=strategy != "paper",
        memory_budget_gb=auto_budget_gb if strategy == "auto" else None,
        **ROI_POOLING.get(model, {}),
        dropblock=variant == "dropblock",
        dropblock_hidden=DROPBLOCK_HIDDEN.get(model),
    )
    if strategy in STOCK_STRATEGIES:  # the same body (pooling + neck), wrapped the stock way
        head = detector.roi_head
        head.body = StockBackpropBody(strategy, head.body.module, chunk)
    return detector


def _optimizers(
    model: WeaklySupervisedDetector, variant: str | None, device: torch.device, amp: str | None = None
) -> tuple[torch.optim.Optimizer, list[Companion]]:
    """The detector's SGD and the companions ``train_step`` runs for the variant: the DropBlock
    adversary (the reference's settings), wsod's GradNorm, the EMA teacher (the defaults of
    ``EMATeacher``), or none (``gradnorm_retain`` is a comparison that keeps its loss weights itself).
    ``amp``: the resolved precision."""
    dropblock = list(model.dropblock.parameters()) if model.dropblock is not None else []
    detector_params = [p for p in model.parameters() if all(p is not q for q in dropblock)]
    optimizer = torch.optim.SGD(detector_params, lr=1e-4, momentum=0.9)
    if variant == "dropblock":
        dropblock_optimizer = torch.optim.SGD(dropblock, lr=1e-4, momentum=0.9, weight_decay=1e-4)
        scheduler = build_scheduler(dropblock_optimizer, milestones=[])
        return optimizer, [DropBlockAdversary(model, dropblock_optimizer, scheduler, amp=amp, device=device)]
    if variant == "gradnorm":
        num_losses = len(model.loss_names)  # the MIL loss, then the refinement method's
        return optimizer, [LossBalancer(num_losses).to(device)]
    if variant == "ema":
        return optimizer, [EMATeacher(model)]
    return optimizer, []


def synthetic_batch(
    image_size: tuple[int, int], rois: int, device: torch.device, seed: int = 0
) -> dict[str, object]:
    """One collated batch (``wsod.data.loader.collate``'s dict, ``views`` 1, the keys ``model_inputs``
    reads) of one image (1, 3, H, W) with ``rois`` random boxes of 16 px or more and two positive
    classes, already on ``device`` (so that no step copies it). Not padded: H and W as given."""
    g = torch.Generator().manual_seed(seed)
    height, width = image_size
    xy = torch.rand(rois, 2, generator=g) * torch.tensor([width - 16.0, height - 16.0])
    max_wh = torch.tensor([width, height]) - xy
    wh = 16 + torch.rand(rois, 2, generator=g) * (max_wh - 16)
    labels = torch.zeros(1, NUM_CLASSES)
    labels[0, [3, 11]] = 1
    labels = labels.to(device)
    return {
        "images": torch.randn(1, 3, height, width, generator=g).to(device),
        "proposals": [torch.cat([xy, xy + wh], dim=1).to(device)],
        "image_labels": labels,
        "image_sizes": [(height, width)],
        "original_sizes": [(height, width)],
        "targets": [{"labels": labels[0], "proposal_ids": torch.arange(rois, device=device)}],
        "views": 1,
    }


def gradnorm_retain_comparison(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, amp: str | None
) -> None:
    """GradNorm in the usual order: a comparison for ``+gradnorm_retain``, **not a training step**
    (training runs wsod's order, the ``LossBalancer`` companion inside ``train_step``; nothing but this
    benchmark runs this function).

    The forward keeps the ROI features; the full backward of the weighted total runs with
    ``retain_graph=True``, then one ``create_graph`` gradient per weighted loss at the ROI features, and
    the weights' gradient; the whole graph stays alive until the end. Then the SGD step. Loss weights
    start at 1 (the first step: every loss at its initial value); no finiteness checks."""
    device = batch["images"].device
    optimizer.zero_grad(set_to_none=True)
    with autocast(device, amp):
        output = model(**model_inputs(batch, device), keep=("roi_features",))
    losses, shared = list(output.losses.values()), output.roi_features
    del output
    weights = torch.ones(len(losses), device=device, requires_grad=True)
    total = sum(w * loss for w, loss in zip(weights, losses, strict=True))
    total.backward(retain_graph=True)
    norms = []
    for w, loss in zip(weights, losses, strict=True):
        (grad,) = torch.autograd.grad(w * loss, shared, retain_graph=True, create_graph=True)
        norms.append(torch.linalg.vector_norm(grad))
    norms = torch.stack(norms)
    ratios = torch.ones_like(norms)  # the first step: every loss at its initial value
    grad_loss = (norms - norms.detach().mean() * ratios).abs().sum()
    (weights.grad,) = torch.autograd.grad(grad_loss, weights)
    del losses, shared, total, norms, grad_loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _measured_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict,
    amp: str | None,
    scaler: torch.amp.GradScaler,
    variant: str | None,
    companions: Sequence[Companion],
) -> None:
    """One measured step: the training loop's ``train_step`` (with ``companions``), or for
    ``gradnorm_retain`` the comparison. A step that training would skip (something not finite) is an
    error: its measurement would not be of an update."""
    if variant == "gradnorm_retain":
        gradnorm_retain_comparison(model, optimizer, batch, amp)
        return
    # Mid-training: a method whose losses follow the schedule runs every part (CBL's multi-seeds).
    result = train_step(
        model, optimizer, itertools.repeat(batch), device=batch["images"].device, amp=amp, scaler=scaler,
        companions=companions, progress=TrainingProgress(1, 2),
    )  # fmt: skip
    if not result.applied:
        raise RuntimeError(f"the benchmark's training step was skipped: a {result.problem} was not finite")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_mb() -> float:
    """The process's peak resident set size in MB: Linux's VmHWM, which ``_reset_peak`` can reset, else
    ``getrusage``'s maximum. (``getrusage`` also keeps the peak of every thread that has exited, which no
    reset clears: after torch.compile's workers exit it stays at the compile's peak.)"""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _reset_peak(device: torch.device) -> float:
    """Start a peak measurement now; returns the baseline, the MB in use at this moment.

    CUDA: the allocator's peak is reset to what is allocated. CPU: the process's peak resident set size
    is reset to its current size by writing 5 to ``/proc/self/clear_refs`` (Linux 4.0 and later; read
    back as VmHWM). Without that file (another OS) the peak cannot be reset: the
    baseline is then the peak so far, which is the resident size before the first step as long as no
    warm-up step ran."""
    if device.type == "cuda":
        _synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
    return _peak_rss_mb()


def allocator_peak_mb(step: Callable[[], object]) -> float:
    """The CPU allocator's peak over ``step()``: the most MB of tensors alive at once, above what was
    alive when it started, from the profiler's memory events (``profile_memory=True``, one event per
    allocation and free, signed sizes in time order).

    It counts what ``torch.cuda.max_memory_allocated`` counts on a GPU, tensor bytes, and unlike the
    resident set size it is the same on every CPU: no allocator caching, page rounding or glibc
    threshold enters it (the fused/plain per-ROI ratio read 0.0021 on an Intel CPU and 0.0034 on an AMD
    one through RSS). The profiler records every op, so a step runs several times slower: for tests and
    short checks, not the benchmark's table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    # The profiler's own record of each event; its public summaries (key_averages) add allocations up
    # per op, which loses the order a peak needs.
    events = profiler.profiler.kineto_results.events()
    changes = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    if not changes:
        raise RuntimeError("the profiler recorded no memory events: this torch build does not report them")
    alive = peak = 0
    for _, nbytes in changes:
        alive += nbytes
        peak = max(peak, alive)
    return peak / 2**20


def _run_measurement(
    model_name: str,
    strategy: str,
    chunk: int | None,
    rois: int,
    image_size: tuple[int, int],
    device_name: str,
    steps: int,
    warmup: int,
    amp: bool,
    threads: int | None,
    memory_limit_mb: float | None = None,
    auto_budget_gb: float | None = None,
) -> tuple[float, float, float, str, dict]:
    """Build, step, measure in this process: (peak MB above baseline, median step ms, baseline MB,
    status, what ``auto`` chose). On CUDA, ``memory_limit_mb`` caps the caching allocator so that
    exceeding it is a real out-of-memory error, as on a smaller card."""
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        device = cap_cuda_memory(device, memory_limit_mb)
    torch.manual_seed(0)
    model = build_benchmark_model(model_name, strategy, chunk, auto_budget_gb).to(device).train()
    variant = split_variant(strategy)[1]
    amp_mode = resolve_amp("bf16" if amp else None, device)  # as training resolves it: CUDA only
    scaler = torch.amp.GradScaler(device.type, enabled=amp_mode == "fp16")
    optimizer, companions = _optimizers(model, variant, device, amp_mode)
    batch = synthetic_batch(image_size, rois, device)
    times = []
    baseline = _reset_peak(device)
    try:
        for step in range(warmup + steps):
            if step == warmup and warmup:  # the measured steps start from what persists between steps
                optimizer.zero_grad(set_to_none=True)
                baseline = _reset_peak(device)
            _synchronize(device)
            start = time.perf_counter()
            _measured_step(model, optimizer, batch, amp_mode, scaler, variant, companions)
            _synchronize(device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError:  # the CUDA name: present in every torch this package supports
        del model, optimizer, companions, batch
        torch.cuda.empty_cache()
        return math.nan, math.nan, baseline, "oom", {}
    except Exception as error:  # noqa: BLE001  only where torch.compile builds the step: a row, not a crash
        if split_variant(strategy)[0] != "compile":
            raise
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        return math.nan, math.nan, math.nan, "failed", {"note": f"torch.compile failed: {reason}"[:300]}
    auto = _auto_choice(model) if split_variant(strategy)[0] == "auto" else {}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20 - baseline
        del model, optimizer, companions, batch
        torch.cuda.empty_cache()
    else:
        peak = _peak_rss_mb() - baseline
    return peak, 1000 * statistics.median(times), baseline, "ok", auto


def _auto_choice(model: WeaklySupervisedDetector) -> dict:
    """What ``chunk_size="auto"`` chose in the last step, its per-ROI cost and its budget."""
    head = model.roi_head
    (cost,) = head.costs.values()
    return {
        "auto_chunk": "plain" if head.last_chunk is None else str(head.last_chunk),
        "auto_mb_per_roi": round(cost.per_roi / 2**20, 4),
        "auto_budget_mb": round(head.budget.bytes / 2**20, 1),
    }


def cap_cuda_memory(device: torch.device, memory_limit_mb: float | None) -> torch.device:
    """Cap the caching allocator of CUDA ``device`` at ``memory_limit_mb`` (``None``: the whole card),
    so that exceeding it raises a real out-of-memory error, as on a smaller card. Returns the device
    with its index made explicit ("cuda" -> "cuda:N"): ``set_per_process_memory_fraction`` takes an
    index or an indexed device, never a bare "cuda"."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = 1.0 if memory_limit_mb is None else min(1.0, memory_limit_mb * 2**20 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return torch.device("cuda", index)


def _child(queue: multiprocessing.Queue, args: tuple) -> None:
    try:
        queue.put(_run_measurement(*args))
    except BaseException as error:  # report, never hang the parent
        queue.put(error)


def _in_fresh_process(
    args: tuple, env: dict[str, str], target: Callable = _child
) -> tuple[float, float, float, str, dict]:
    """Run ``_run_measurement(*args)`` in a new interpreter with extra environment variables (``target``
    puts its result or error on the queue: ``_child``, or a stand-in in the tests)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(queue, args))
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # a spawned child copies the environment when it starts
    try:
        process.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    # Polled, so that a child that dies without reporting (killed for memory, or unable to start) is an
    # error rather than a parent waiting forever.
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except queue_module.Empty:
            if not process.is_alive() and queue.empty():
                process.join()
                raise RuntimeError(
                    f"the measurement process exited with code {process.exitcode} before reporting a result"
                    f" ({args[1]} at {args[3]} ROIs); was it killed for memory?"
                ) from None
    process.join()
    if isinstance(result, BaseException):
        raise result
    return result


def measure(
    model: str,
    strategy: str,
    chunk: int | None,
    rois: int,
    *,
    image_size: tuple[int, int] = (600, 1000),
    device: str = "cpu",
    steps: int = 3,
    warmup: int = 1,
    amp: bool = False,
    threads: int | None = None,
    timed: bool = True,
    memory_limit_gb: float | None = None,
    auto_budget_gb: float | None = None,
) -> Measurement:
    """One measurement (``timed=False``: memory only, one step); ``auto_budget_gb`` for ``auto``;
    ``amp``: bf16, as training sets it (CUDA only, fp16 on a GPU without native bfloat16).

    On CPU, two fresh processes: one measures peak RSS with glibc's mmap threshold pinned to 64 KiB, so
    that every freed tensor goes back to the system and RSS follows live tensors rather than allocator
    fragmentation (with the default dynamic threshold, freed chunks stay resident and the per-ROI slope
    of the fused strategy reads 10x too high); the other times the steps with the default allocator,
    since an mmap per tensor would slow them down.
    """
    if amp and torch.device(device).type != "cuda":
        raise ValueError(
            "amp (bf16) is CUDA only: training runs no autocast on a CPU (wsod.engine.amp.resolve_amp),"
            " so a CPU bf16 row would measure float32"
        )
    limit_mb = None if memory_limit_gb is None else memory_limit_gb * 1024
    auto_budget_gb = auto_budget_gb if split_variant(strategy)[0] == "auto" else None
    args = (model, strategy, chunk, rois, image_size, device, steps, warmup, amp, threads, limit_mb)
    args += (auto_budget_gb,)
    # One step, or for compile a compiling step first (its peak is reset before the measured one).
    memory_warmup = 1 if split_variant(strategy)[0] == "compile" else 0
    memory_args = (*args[:6], 1, memory_warmup, amp, threads, limit_mb, auto_budget_gb)
    if torch.device(device).type == "cpu":
        pinned = {"MALLOC_MMAP_THRESHOLD_": "65536"}
        peak, _, baseline, status, details = _in_fresh_process(memory_args, pinned)
        # Timed only when the step ran: a step that failed to compile would fail again.
        step_ms = _in_fresh_process(args, {})[1] if timed and status == "ok" else math.nan
        result = (peak, step_ms, baseline, status, details)
    else:
        result = _run_measurement(*(args if timed else memory_args))
    peak, step_ms, baseline, status, details = result
    return Measurement(
        strategy=strategy,
        chunk=chunk if split_variant(strategy)[0] in CHUNKED else None,
        rois=rois,
        peak_mb=round(peak, 1),
        step_ms=round(step_ms, 1),
        device=_device_label(device),
        model=model,
        image_size=f"{image_size[0]}x{image_size[1]}",
        dtype=resolve_amp("bf16", device) if amp else "fp32",  # fp16 on a GPU without native bf16
        baseline_mb=round(baseline, 1),
        status=status,
        budget_gb=auto_budget_gb,
        auto_chunk=details.get("auto_chunk", ""),
        auto_mb_per_roi=details.get("auto_mb_per_roi", math.nan),
        auto_budget_mb=details.get("auto_budget_mb", math.nan),
        note=details.get("note", ""),
    )


def _device_label(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} threads)"


def linear_fit(rois: Sequence[float], peaks: Sequence[float]) -> tuple[float, float]:
    """Least-squares line peak = slope * rois + intercept (MB per ROI, MB)."""
    if len(rois) < 2:
        raise ValueError("a linear fit needs at least two ROI counts")
    mean_x, mean_y = statistics.fmean(rois), statistics.fmean(peaks)
    var = sum((x - mean_x) ** 2 for x in rois)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(rois, peaks, strict=True)) / var
    return slope, mean_y - slope * mean_x


def find_max_rois(fits: Callable[[int], bool], start: int, limit: int = 1 << 20) -> int:
    """Largest ROI count n with ``fits(n)``: doubling from ``start`` to bracket, then bisection.

    ``fits`` runs a real step (CUDA: catches out-of-memory) and compares its peak with the budget.
    Returns 0 when even one ROI does not fit, and ``limit`` when ``limit`` ROIs fit.
    """
    low, high = 0, min(max(1, start), limit)
    while fits(high):
        if high == limit:
            return limit  # the search stops here: the true maximum is at least this
        low, high = high, min(2 * high, limit)
    while high - low > max(1, low // 64):  # 1.5 % resolution is plenty for a capacity figure
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def write_csv(measurements: Iterable[Measurement], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(Measurement)])
        writer.writeheader()
        for m in measurements:
            writer.writerow(asdict(m))


def strategy_label(
    strategy: str, chunk: int | None, amp: bool | str, auto_budget_gb: float | None = None
) -> str:
    """``amp``: True for bf16, or the dtype a row ran in ("fp32" and False add nothing)."""
    dtype = "bf16" if amp is True else amp if amp and amp != "fp32" else ""
    suffix = f" {dtype}" if dtype else ""
    if strategy == "auto":  # its chunk is a choice per step, not a setting
        budget = "free memory" if auto_budget_gb is None else f"{auto_budget_gb:g} GB"
        return f"auto ({budget})" + suffix
    return f"{strategy}" + (f" (chunk {chunk})" if chunk else "") + suffix


def _label_of(m: Measurement) -> str:
    return strategy_label(m.strategy, m.chunk, m.dtype, m.budget_gb)


def _by_label(measurements: Sequence[Measurement], ok_only: bool = False) -> dict[str, list[Measurement]]:
    """Measurements grouped by strategy label (strategy, chunk, dtype), each group sorted by ROI count."""
    grouped: dict[str, list[Measurement]] = {}
    for m in measurements:
        if m.status == "ok" or not ok_only:
            grouped.setdefault(_label_of(m), []).append(m)
    return {label: sorted(ms, key=lambda m: m.rois) for label, ms in grouped.items()}


def _cells(measurements: Sequence[Measurement], ok: Callable[[Measurement], str], missing: str) -> dict:
    """Per label, one cell per ROI count of the whole table: ``ok(m)``, the status in capitals, or
    ``missing`` where that count was not measured."""
    rois = sorted({m.rois for m in measurements})
    table = {}
    for label, ms in _by_label(measurements).items():
        by_rois = {m.rois: m for m in ms}
        table[label] = [
            missing
            if r not in by_rois
            else ok(by_rois[r])
            if by_rois[r].status == "ok"
            else by_rois[r].status.upper()
            for r in rois
        ]
    return table


def format_table(measurements: Sequence[Measurement]) -> str:
    """Plain-text table: one row per (strategy, chunk, dtype), one column pair per ROI count."""
    rois = sorted({m.rois for m in measurements})
    header = f"{'strategy':<24}" + "".join(f"{f'{r} ROIs MB':>14}{'ms':>9}" for r in rois)
    cells = _cells(measurements, lambda m: f"{m.peak_mb:>14.1f}{m.step_ms:>9.0f}", "")
    lines = [header, "-" * len(header)]
    lines += [f"{label:<24}" + "".join(f"{cell:>23}" for cell in row) for label, row in cells.items()]
    return "\n".join(lines)


def slopes(measurements: Sequence[Measurement]) -> dict[str, tuple[float, float]]:
    """Per strategy label: (MB per extra ROI, intercept MB) from a linear fit of the ok rows."""
    return {
        label: linear_fit([m.rois for m in ms], [m.peak_mb for m in ms])
        for label, ms in _by_label(measurements, ok_only=True).items()
        if len({m.rois for m in ms}) >= 2
    }


def predicted_max_rois(slope: float, intercept: float, baseline_mb: float, budget_gb: float) -> float:
    """ROI count at which the linear fit reaches ``budget_gb`` with ``baseline_mb`` already taken."""
    return max(0, int((budget_gb * 1024 - baseline_mb - intercept) / slope)) if slope > 0 else math.inf


def summarize(measurements: Sequence[Measurement]) -> list[str]:
    """Lines for the report: per-ROI slope and intercept of each strategy, the ROI counts they predict
    for 16, 24 and 80 GB, and each strategy's step time relative to plain autograd."""
    first = measurements[0]
    lines = [
        f"Peak memory above baseline and median step time; {first.model}, image {first.image_size},"
        f" {first.device}.",
        "",
        "Per-ROI memory slope (linear fit):",
    ]
    baseline = max(m.baseline_mb for m in measurements)
    for label, (slope, intercept) in slopes(measurements).items():
        predicted = ", ".join(
            f"{gb} GB: {predicted_max_rois(slope, intercept, baseline, gb)}" for gb in (16, 24, 80)
        )
        lines.append(
            f"- {label}: {slope:.4f} MB/ROI, intercept {intercept:.0f} MB; predicted max ROIs {predicted}"
        )
    plain_ms = {
        (m.dtype, m.rois): m.step_ms for m in measurements if m.strategy == "plain" and m.status == "ok"
    }
    for m in measurements:
        if m.strategy != "plain" and m.status == "ok" and (m.dtype, m.rois) in plain_ms:
            ratio = m.step_ms / plain_ms[(m.dtype, m.rois)]
            if math.isnan(ratio):  # memory only (--steps 0)
                continue
            lines.append(f"- time ratio {_label_of(m)} / plain at {m.rois} ROIs {m.dtype}: {ratio:.2f}")
    step_ms = {(m.strategy, m.chunk, m.dtype, m.rois): m.step_ms for m in measurements if m.status == "ok"}
    peak_mb = {(m.strategy, m.chunk, m.dtype, m.rois): m.peak_mb for m in measurements if m.status == "ok"}
    for m in measurements:
        base, variant = split_variant(m.strategy)
        key = (base, m.chunk, m.dtype, m.rois)
        if variant and m.status == "ok" and key in step_ms:
            time_ratio = m.step_ms / step_ms[key]
            timed = "" if math.isnan(time_ratio) else f"time {time_ratio:.2f}, "  # memory only: --steps 0
            # A CPU peak is the step's rise of the process's maximum RSS: 0 when the step stayed below
            # the maximum an earlier one reached (tiny models), where no ratio exists.
            memory = f"{m.peak_mb / peak_mb[key]:.2f}" if peak_mb[key] > 0 else "n/a (no rise without it)"
            compared = f"- {_label_of(m)} / without +{variant} at {m.rois} ROIs"
            lines.append(f"{compared}: {timed}peak memory {memory}")
    lines += [f"- {_label_of(m)} at {m.rois} ROIs: {m.note}" for m in measurements if m.note]
    return lines + _auto_lines(measurements)


def _auto_lines(measurements: Sequence[Measurement]) -> list[str]:
    """Per ``auto`` row: its choice, the neck memory its cost predicts against its budget, and the neck
    memory measured: its peak above the fused step with the smallest chunk k measured at the same ROI
    count and dtype (whose only per-ROI neck memory is one chunk) plus that chunk's k x cost. The neck is
    the ROI pooling + neck, what the budget covers."""
    smallest: dict[tuple[int, str], Measurement] = {}
    for m in measurements:
        if m.strategy == "fused" and m.status == "ok":
            key = (m.rois, m.dtype)
            if key not in smallest or m.chunk < smallest[key].chunk:
                smallest[key] = m
    plain = {(m.rois, m.dtype): m for m in measurements if m.strategy == "plain" and m.status == "ok"}
    autos = [m for m in measurements if m.strategy == "auto" and m.status == "ok"]
    lines = ["", "chunk_size=auto (neck = ROI pooling + neck, what the budget covers):"] if autos else []
    for m in autos:
        chunk = m.rois if m.auto_chunk == "plain" else int(m.auto_chunk)
        choice = "plain autograd" if m.auto_chunk == "plain" else f"chunks of {chunk}"
        line = (
            f"- {_label_of(m)} at {m.rois} ROIs: {choice}; measured cost {m.auto_mb_per_roi:.3f} MB/ROI,"
            f" {chunk} x cost = {chunk * m.auto_mb_per_roi:.0f} MB of a {m.auto_budget_mb:.0f} MB budget"
        )
        if (m.rois, m.dtype) in smallest:
            ref = smallest[(m.rois, m.dtype)]
            neck = m.peak_mb - ref.peak_mb + ref.chunk * m.auto_mb_per_roi
            within = "within" if neck <= m.auto_budget_mb else "OVER"
            line += (
                f"; measured neck {neck:.0f} MB ({within} the budget: peak {m.peak_mb - ref.peak_mb:.0f} MB"
                f" above fused (chunk {ref.chunk}) + {ref.chunk} x cost)"
            )
        if (m.rois, m.dtype) in plain:
            line += f"; peak {m.peak_mb - plain[(m.rois, m.dtype)].peak_mb:+.0f} MB vs plain"
        lines.append(line)
    return lines


def largest_within_budget(
    model: str,
    strategy: str,
    chunk: int | None,
    amp: bool,
    *,
    budget_gb: float,
    max_rois: int,
    start: int,
    auto_budget_gb: float | None = None,
    **options,
) -> int:
    """The most ROIs whose training step fits ``budget_gb``, model and batch included, by binary search
    over real steps (``find_max_rois``); ``max_rois`` when even that many fit. On CUDA the allocator is
    capped at the budget, so not fitting is a real out-of-memory error."""

    def fits(rois: int) -> bool:
        m = measure(
            model, strategy, chunk, rois, amp=amp, memory_limit_gb=budget_gb, auto_budget_gb=auto_budget_gb,
            **{**options, "timed": False},
        )  # fmt: skip
        ok = m.status == "ok" and m.peak_mb + m.baseline_mb <= budget_gb * 1024
        label = strategy_label(strategy, chunk, amp, auto_budget_gb)
        print(
            f"  probe {label} rois={rois}: {m.peak_mb + m.baseline_mb:.0f} MB "
            f"{'fits' if ok else 'does not fit'}",
            flush=True,
        )
        return ok

    return find_max_rois(fits, min(start, max_rois), limit=max_rois)


def write_markdown(measurements: Sequence[Measurement], path: Path, extra: str = "") -> None:
    """Markdown table (peak MB / step ms per ROI count) and the per-ROI slope of each strategy."""
    rois = sorted({m.rois for m in measurements})
    fit = slopes(measurements)
    lines = [
        "| strategy | " + " | ".join(f"{r} ROIs: MB / ms" for r in rois) + " | MB per ROI |",
        "|---" * (len(rois) + 2) + "|",
    ]
    cell = lambda m: f"{m.peak_mb:.0f} / " + ("-" if math.isnan(m.step_ms) else f"{m.step_ms:.0f}")
    for label, row in _cells(measurements, cell, "").items():
        slope = f"{fit[label][0]:.3f}" if label in fit else ""
        lines.append(f"| {label} | " + " | ".join(row) + f" | {slope} |")
    Path(path).write_text("\n".join(lines) + "\n" + (f"\n{extra}\n" if extra else ""))


def plot(measurements: Sequence[Measurement], path: Path) -> None:
    """Two panels, a line per strategy: peak memory vs ROIs and step time vs ROIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any(not math.isnan(m.step_ms) for m in measurements)  # else memory only (--steps 0)
    figure, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4.2), squeeze=False)
    memory_axis, time_axis = axes[0][0], axes[0][-1] if timed else None
    for index, (label, ms) in enumerate(_by_label(measurements, ok_only=True).items()):
        x = [m.rois for m in ms]
        style = dict(marker="os^vD<>"[index % 7], label=label)  # equal lines stay visible
        memory_axis.plot(x, [m.peak_mb for m in ms], **style)
        if timed:
            time_axis.plot(x, [m.step_ms for m in ms], **style)
    first = measurements[0]
    title = f"{first.model}, {first.image_size}, {first.device}"
    memory_axis.set(xlabel="ROIs per image", ylabel="peak memory above baseline (MB)", title=title)
    if timed:
        time_axis.set(xlabel="ROIs per image", ylabel="training step (ms)", title=title)
    for axis in axes[0]:
        axis.grid(alpha=0.3)
    memory_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
