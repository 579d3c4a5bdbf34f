"""One optimizer step of training: what the loop (``wsod.engine.train``) and the ROI benchmark
(``wsod.benchmarks.rois``) both run, so that the benchmark measures the step training takes.

``train_step`` = the ``accumulation`` forward and backward passes (each batch's total loss divided by
it; under DDP the gradients are averaged in the last backward only), the finiteness checks, and the
update, with the companions called at the points ``wsod.engine.companion`` draws. A step whose loss,
gradient or updated buffers (BatchNorm statistics) are not finite is skipped: no parameter, buffer or
optimizer state changes. What is around a step (schedules, counters, logging, checkpoints, evaluation)
is the loop's.

A step asked to (``pseudo_label_quality``, the loop's log steps) also scores the pseudo-labels its
forwards trained on against the batch's true boxes (``wsod.engine.pseudo_label_quality``): the forward
keeps its records (``keep`` ``"pseudo_labels"``), they are counted before the backward and dropped, and
the ``pseudo/`` values join the step's ``values``. Nothing the step computes changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsod.data.loader import model_inputs
from wsod.distributed import all_reduce_mean
from wsod.engine.amp import autocast
from wsod.engine.companion import Companion
from wsod.engine.pseudo_label_quality import PseudoLabelQuality
from wsod.modeling.method import TrainingProgress

__all__ = ["StepResult", "NonFiniteParametersError", "train_step", "check_companions"]


@dataclass
class StepResult:
    """What one optimizer step did.

    values: the step's losses (the mean over its batches and over processes), ``loss_total``,
        ``grad_norm`` when measured, the companions' values and, when asked, the ``pseudo/`` quality
        of its pseudo-labels, for the log;
    applied: whether the update was applied;
    problem: why it was skipped (None when applied).
    """

    values: dict[str, float]
    applied: bool
    problem: str | None = None


class NonFiniteParametersError(RuntimeError):
    """The update was applied with finite loss and gradients, but made a parameter non-finite."""


def check_companions(companions: Sequence[Companion]) -> None:
    """Companions have distinct names (their checkpoint keys) and at most one combines the losses."""
    names = [c.name for c in companions]
    if len(set(names)) != len(names):
        raise ValueError(f"companions {names} share a name; each needs its own checkpoint key")
    combiners = [c for c in companions if c.combines_losses]
    if len(combiners) > 1:
        raise ValueError(f"{', '.join(c.name for c in combiners)} all combine the losses; pass at most one")


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict[str, Any]],
    *,
    device: torch.device,
    accumulation: int = 1,
    amp: str | None = None,
    scaler: torch.amp.GradScaler | None = None,
    companions: Sequence[Companion] = (),
    progress: TrainingProgress | None = None,
    pseudo_label_quality: bool = False,
) -> StepResult:
    """One optimizer step of ``model`` (on ``device``, possibly DDP-wrapped) on the next
    ``accumulation`` batches of ``batches`` (``wsod.data.loader.collate`` dicts). ``amp``: the resolved
    precision (None, "bf16", "fp16"; ``wsod.engine.amp.resolve_amp``); ``scaler``: the fp16 GradScaler
    (a disabled one when None); ``progress``: where the training stands, passed to every forward
    (``progress=``) when given; ``pseudo_label_quality``: add the ``pseudo/`` values of its pseudo-labels
    (the module docstring; a collective under DDP, so every process must ask at the same step, and the
    model must keep ``"pseudo_labels"``). Leaves no gradient behind. Raises ``NonFiniteParametersError``
    when an applied update made a parameter non-finite (the caller says which checkpoint holds the last
    finite weights)."""
    scaler = scaler if scaler is not None else torch.amp.GradScaler(device.type, enabled=False)
    buffers = _copy_buffers(model)  # restored if the step is skipped
    quality = PseudoLabelQuality(device) if pseudo_label_quality else None
    losses, inputs = _forward_backward(
        model, batches, device, accumulation, amp, scaler, companions, progress, quality
    )
    values = _reduce_losses(losses)
    if quality is not None:
        values.update(quality.values())
    problem = _step_problem(values, model, optimizer, scaler)
    if problem is None:
        scaler.step(optimizer)
        scaler.update()
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteParametersError("the update made parameters non-finite")
        for companion in companions:
            values.update(companion.after_step(inputs if companion.needs_inputs else []))
    else:
        _restore(buffers)
        for companion in companions:
            companion.skip()
    for companion in companions:
        values.update(companion.log_values())
    optimizer.zero_grad(set_to_none=True)
    return StepResult(values, problem is None, problem)


def _forward_backward(
    model: nn.Module,
    batches: Iterator[dict[str, Any]],
    device: torch.device,
    accumulation: int,
    amp: str | None,
    scaler: torch.amp.GradScaler,
    companions: Sequence[Companion],
    progress: TrainingProgress | None = None,
    quality: PseudoLabelQuality | None = None,
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The ``accumulation`` forward and backward passes of one optimizer step. Returns the step's losses
    (the mean over its batches, detached, plus ``loss_total``) and, when a companion needs them, its
    batches' model inputs with the companions' forward arguments (else none: each batch is freed after
    its backward). ``quality``, when given, counts each forward's pseudo-labels."""
    combiner = next((c for c in companions if c.combines_losses), None)
    keep = combiner.keep if combiner is not None else frozenset()
    if quality is not None:
        keep = frozenset(keep) | {"pseudo_labels"}
    keep_inputs = any(c.needs_inputs for c in companions)
    step_losses: dict[str, torch.Tensor] = {}
    step_inputs = []
    distributed = isinstance(model, nn.parallel.DistributedDataParallel)
    for micro in range(accumulation):
        inputs = model_inputs(next(batches), device)
        if progress is not None:
            inputs["progress"] = progress
        with autocast(device, amp):  # a teacher scores in the step's precision
            for companion in companions:
                inputs.update(companion.before_forward(inputs))
        if keep_inputs:
            step_inputs.append(inputs)
        # Under DDP the gradients are averaged over processes in the step's last backward only.
        sync = micro == accumulation - 1 or not distributed
        with model.no_sync() if not sync else nullcontext(), autocast(device, amp):
            output = model(**inputs, keep=keep)
            losses = output.losses
            if quality is not None:  # before the backward, and the records are dropped with the output
                quality.add(output, inputs.get("targets"))
            total = combiner.combine(output) if combiner is not None else sum(losses.values())
            # Dropped before the backward, which frees the (R, D) ROI features once the heads' gradients
            # are computed: held here, they would stay alive at the neck's peak (kilobytes per ROI).
            del output
        scaler.scale(total / accumulation).backward()
        del total
        for name, value in losses.items():
            step_losses[name] = step_losses.get(name, 0) + value.detach() / accumulation
        del losses
    step_losses["loss_total"] = sum(step_losses.values())
    return step_losses, step_inputs


def _reduce_losses(losses: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean of each loss over processes (for logging only)."""
    names = sorted(losses)
    values = all_reduce_mean(torch.stack([losses[n].detach().float() for n in names]))
    return dict(zip(names, values.tolist(), strict=True))


def _step_problem(
    values: dict[str, float], model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> str | None:
    """Why this step cannot be applied, or None; adds ``grad_norm`` to ``values`` when it is measured.

    The same answer on every process: losses are averaged over processes, DDP has made the gradients
    identical, and the statistics check is reduced. fp16's scaler skips overflowing gradients itself
    (routinely), so their norm is not checked under it.
    """
    if not math.isfinite(values["loss_total"]):
        return "loss or gradient"
    if not scaler.is_enabled():
        values["grad_norm"] = _gradient_norm(optimizer)
        if not math.isfinite(values["grad_norm"]):
            return "loss or gradient"
    if not _buffers_finite(model):
        return "BatchNorm statistic (finite loss and gradient)"
    return None


def _copy_buffers(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) of every buffer (BatchNorm running statistics and counters, a few kilobytes): a
    forward pass updates them even when its loss turns out non-finite."""
    return [(b, b.detach().clone()) for b in model.buffers()]


def _restore(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


def _gradient_norm(optimizer: torch.optim.Optimizer) -> float:
    """The L2 norm of all gradients the optimizer would apply (inf or nan if any is not finite)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return 0.0
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()


def _buffers_finite(model: nn.Module) -> bool:
    """Whether every floating-point buffer (BatchNorm running statistics) is finite on every process.

    A step's forward passes update the running statistics before its loss is known, and weights that
    are huge but finite can overflow them (a variance of 1e20-sized activations is inf in float32)
    while the loss and gradients stay finite: such a step is as unusable as one with a NaN loss.
    Reduced over processes: each DDP rank updates its statistics from its own batches, and every rank
    must make the same decision.
    """
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers:
        return True  # the same answer on every process: they hold the same model
    local = torch.stack([torch.isfinite(b).all() for b in buffers]).all()  # on the model's device (NCCL)
    return all_reduce_mean(local.float().reshape(1)).item() == 1.0
