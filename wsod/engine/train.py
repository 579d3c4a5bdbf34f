"""The one explicit training loop: iteration based, gradient accumulation, AMP, DDP, resume.

``iteration`` counts optimizer steps. One optimizer step consumes ``accumulation`` batches per process;
the learning-rate schedule, checkpoints, logging and evaluation are all counted in optimizer steps, so a
recipe written for 8 GPUs x 1 image keeps its numbers on 1 GPU with ``accumulation=8``.

What the loop leaves to others: which files are saved, and when, is the ``Checkpointer``'s
(``wsod.engine.checkpoint``: ``model_<iteration>.pth``, ``model_final.pth``, ``model_best.pth``); the
rows of ``metrics.jsonl`` and tensorboard go through the caller's ``RunLog``; the optional extras (the
adversarial DropBlock step, GradNorm) are ``Companion``s called at fixed points of each step
(``wsod.engine.companion`` draws them); the tensorboard images of each student's pseudo-labels are
the optional ``PseudoLabelPreview``'s. The caller writes ``config.yaml`` and ``log.txt`` and runs the
final evaluation (``wsod.runs.train``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from wsod.data.loader import model_inputs
from wsod.distributed import all_reduce_mean, is_main_process
from wsod.engine.amp import autocast, resolve_amp
from wsod.engine.checkpoint import Checkpointer, TrainState, rng_state, set_rng_state
from wsod.engine.companion import Companion
from wsod.engine.evaluate import Evaluator
from wsod.engine.interrupt import StopRequests, TrainingInterrupted
from wsod.engine.pseudo_label_preview import PseudoLabelPreview
from wsod.engine.run_log import RunLog
from wsod.engine.solver import WarmupMultiStepLR, load_optimizer_state

__all__ = ["train", "NonFiniteLossError", "TrainingInterrupted"]

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Raised after too many consecutive optimizer steps with a non-finite loss."""


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: WarmupMultiStepLR,
    make_batches: Callable[[int], Iterator[dict[str, Any]]],
    *,
    max_iter: int,
    device: torch.device,
    checkpointer: Checkpointer,
    run_log: RunLog,
    accumulation: int = 1,
    amp: str | None = None,
    resume_from: tuple[Path, dict[str, Any]] | None = None,
    log_period: int = 20,
    evaluator: Evaluator | None = None,
    eval_period: int = 0,
    companions: Sequence[Companion] = (),
    max_nonfinite: int = 10,
    progress: bool = True,
    preview: PseudoLabelPreview | None = None,
) -> dict[str, Any]:
    """Train ``model`` (already on ``device``, possibly DDP-wrapped) for ``max_iter`` optimizer steps.

    Args:
        make_batches: ``start -> iterator of batches`` for this process, starting at its ``start``-th
            batch, so that a resumed run sees exactly the batches an uninterrupted run would. Batches
            are ``wsod.data.loader.collate`` dicts.
        checkpointer: saves the periodic checkpoints (and one at a stop, whatever its period), the
            final one and ``model_final.pth`` at the end, and ``model_best.pth`` when a periodic
            evaluation beats the recorded best. The final evaluation is the caller's, after
            ``model_final.pth`` exists; it offers its value to the same checkpointer.
        run_log: where the rows go (the caller closes it); on a resume it must have been opened with
            ``purge_after`` at the resumed iteration, so that each iteration is logged once.
        accumulation: batches per optimizer step (gradients summed; each batch's loss divided by it).
        amp: None, "bf16" or "fp16" (fp16 uses a GradScaler); CUDA only, ignored on CPU; bf16 becomes
            fp16 on GPUs without native bfloat16 (``wsod.engine.amp.resolve_amp``).
        resume_from: ``(path, checkpoint)`` of a checkpoint of this run to continue from (see
            ``latest_valid_checkpoint``): weights, optimizer state, RNG states, counters, companions and
            the best evaluation are restored; the optimizer hyperparameters and the learning-rate
            schedule are those of the ``optimizer`` and ``scheduler`` given, placed at the restored
            iteration (so a changed learning rate takes effect).
        evaluator: called on every process (prediction is distributed) every ``eval_period`` steps
            before the last.
        companions: training extras (``DropBlockAdversary``, ``LossBalancer``), called in this order at
            the points ``wsod.engine.companion`` lists; their state is checkpointed under their names.
        max_nonfinite: abort after this many consecutive steps whose loss, gradient or updated
            buffers (BatchNorm running statistics) are not finite. Such a step is skipped: no parameter,
            buffer or optimizer state changes; it is counted and logged. The abort saves a checkpoint of
            the last finite state (whatever the checkpointer's period) and names it. An update that
            makes a parameter non-finite stops the run at once, so that no checkpoint ever holds
            non-finite weights; its message says which checkpoint, if any, holds the last finite ones.
        (Ctrl-C or SIGTERM: the step in progress ends, a checkpoint of it is saved whatever the period,
        and ``TrainingInterrupted`` names it; a second signal raises ``KeyboardInterrupt`` at once, see
        ``wsod.engine.interrupt``. ``resume_from`` that checkpoint continues exactly.)
        preview: tensorboard images of each student's pseudo-labels on a few fixed training images
            (``wsod.engine.pseudo_label_preview``), on the main process after each applied step whose
            iteration is a multiple of ``preview.period`` (a skipped step changed nothing to look at),
            in the step's precision; none at iteration 0 (the untrained heads' labels, and a resumed
            run would log its start twice). It changes nothing in the run: no weight, statistic or
            random state, and its seconds are left out of ``seconds_per_iter``.

    Returns a summary: final iteration, skipped steps, last losses, the last periodic evaluation and
    the best one.
    """
    main = is_main_process()
    amp = resolve_amp(amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    _check_companions(companions)
    payload = partial(_payload, model, optimizer, scaler, companions)
    state = TrainState()
    if resume_from is not None:
        state = checkpointer.resume(resume_from[1])
        _check_purged(run_log, state.iteration)
        _load_payload(resume_from[1], model, optimizer, scaler, companions, state.iteration)
        # The schedule is a function of the iteration: a freshly built one, placed at the restored
        # iteration, applies a changed schedule at once and equals the saved one otherwise.
        scheduler.place(state.iteration)
        logger.info("resumed from %s at iteration %d", resume_from[0], state.iteration)

    batches = make_batches(state.iteration * accumulation)
    model.train()
    consecutive_nonfinite, values = 0, {}
    with _progress_bar(max_iter, state.iteration, shown=main and progress) as bar, StopRequests() as stop:
        step_start, logged_at = time.perf_counter(), state.iteration
        while state.iteration < max_iter:
            buffers = _copy_buffers(model)  # restored if the step is skipped
            losses, inputs = _forward_backward(model, batches, device, accumulation, amp, scaler, companions)
            values = _reduce_losses(losses)
            problem = _step_problem(values, model, optimizer, scaler)
            applied = problem is None
            if applied:
                consecutive_nonfinite, state.last_finite = 0, state.iteration + 1
                scaler.step(optimizer)
                scaler.update()
                _check_parameters(model, state.iteration + 1, checkpointer)
                for companion in companions:
                    values.update(companion.after_step(inputs if companion.needs_inputs else []))
            else:
                consecutive_nonfinite += 1
                state.skipped_steps += 1
                _restore(buffers)
                for companion in companions:
                    companion.skip()
                logger.warning(
                    "non-finite %s at iteration %d (%s): step skipped, weights and statistics unchanged"
                    " (%d skipped in total)", problem, state.iteration + 1, values, state.skipped_steps,
                )  # fmt: skip
            for companion in companions:
                values.update(companion.log_values())
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used, for the log
            scheduler.step()
            state.iteration += 1
            bar.update(1)

            if main and (state.iteration % log_period == 0 or state.iteration == max_iter):
                # Per step of this window: the last one (at max_iter) may be shorter than log_period.
                seconds = (time.perf_counter() - step_start) / (state.iteration - logged_at)
                _log_step(run_log, bar, state.iteration, max_iter, values, lr, seconds, device)
                step_start, logged_at = time.perf_counter(), state.iteration
            if main and applied and preview is not None and state.iteration % preview.period == 0:
                started = time.perf_counter()
                with autocast(device, amp):  # the features the step's own pseudo-labels came from
                    preview(model, state.iteration, run_log)
                step_start += time.perf_counter() - started  # not the steps' time
            if consecutive_nonfinite >= max_nonfinite:  # after logging the step
                # Skipped steps changed nothing: the model and optimizer hold the last finite step's
                # state. Saved now, whatever the period says, so that the stop loses no work.
                checkpointer.periodic(state, payload, force=True)
                raise NonFiniteLossError(_stop_message(consecutive_nonfinite, state, checkpointer))
            checkpointer.periodic(state, payload)
            periodic = eval_period and state.iteration % eval_period == 0
            if evaluator is not None and periodic and state.iteration < max_iter:
                _periodic_evaluation(model, evaluator, state, run_log, checkpointer, payload)
            if stop.requested_anywhere(device):  # after the step's checkpoint and evaluation
                checkpointer.periodic(state, payload, force=True)
                raise TrainingInterrupted(_interrupted_message(stop.name, state, max_iter, checkpointer))
        checkpointer.periodic(state, payload, force=True)  # the last state, whatever the period
        checkpointer.final(_unwrap(model).state_dict(), state.iteration)
    return {
        "iteration": state.iteration,
        "skipped_steps": state.skipped_steps,
        "losses": values,
        "eval": state.last_eval,
        "best": checkpointer.best,
    }


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _check_companions(companions: Sequence[Companion]) -> None:
    names = [c.name for c in companions]
    if len(set(names)) != len(names):
        raise ValueError(f"train(): companions {names} share a name; each needs its own checkpoint key")
    combiners = [c for c in companions if c.combines_losses]
    if len(combiners) > 1:
        names = ", ".join(c.name for c in combiners)
        raise ValueError(f"train(): {names} all combine the losses; pass at most one of them")


def _payload(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    companions: Sequence[Companion],
) -> dict[str, Any]:
    """What the loop adds to a checkpoint (the checkpointer adds the counters and metadata)."""
    return {
        "model": _unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rng_state(),
        **{c.name: c.state_dict() for c in companions},
    }


def _load_payload(
    checkpoint: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    companions: Sequence[Companion],
    iteration: int,
) -> None:
    """Restore ``_payload``'s part of ``checkpoint``. A companion the checkpoint has no state for (one
    switched on at the resume) starts fresh."""
    _unwrap(model).load_state_dict(checkpoint["model"])
    load_optimizer_state(optimizer, checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
    set_rng_state(checkpoint["rng"])
    for companion in companions:
        if companion.name in checkpoint:
            companion.load_state_dict(checkpoint[companion.name], iteration)


def _check_purged(run_log: RunLog, iteration: int) -> None:
    if run_log.enabled and run_log.purge_after != iteration:
        raise ValueError(
            f"train(): resuming at iteration {iteration} with a RunLog opened with purge_after="
            f"{run_log.purge_after}: open it with purge_after={iteration}, or rows after it repeat"
        )


@contextmanager
def _progress_bar(total: int, initial: int, shown: bool) -> Iterator[tqdm]:
    bar = tqdm(total=total, initial=initial, desc="train", disable=not shown, dynamic_ncols=True)
    try:
        # Log lines go through tqdm.write while the bar is shown, not tearing it.
        with logging_redirect_tqdm() if shown else nullcontext():
            yield bar
    finally:
        bar.close()


def _forward_backward(
    model: nn.Module,
    batches: Iterator[dict[str, Any]],
    device: torch.device,
    accumulation: int,
    amp: str | None,
    scaler: torch.amp.GradScaler,
    companions: Sequence[Companion],
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The ``accumulation`` forward and backward passes of one optimizer step. Returns the step's losses
    (the mean over its batches, detached, plus ``loss_total``) and, when a companion needs them, its
    batches' model inputs (else none: each batch is freed after its backward)."""
    combiner = next((c for c in companions if c.combines_losses), None)
    keep_inputs = any(c.needs_inputs for c in companions)
    step_losses: dict[str, torch.Tensor] = {}
    step_inputs = []
    for micro in range(accumulation):
        inputs = model_inputs(next(batches), device)
        if keep_inputs:
            step_inputs.append(inputs)
        # Under DDP the gradients are averaged over processes in the step's last backward only.
        sync = micro == accumulation - 1 or not isinstance(model, nn.parallel.DistributedDataParallel)
        with model.no_sync() if not sync else nullcontext(), autocast(device, amp):
            if combiner is None:
                losses = model(**inputs)
                total = sum(losses.values())
            elif combiner.needs_loss_scales:  # GradNorm's rates read each loss's pseudo-label weight
                losses, roi_features, scales = model(**inputs, return_features=True, return_loss_scales=True)
                total = combiner.combine(losses, roi_features, scales)
            else:  # GradNorm measures at the ROI features, before the one backward
                losses, roi_features = model(**inputs, return_features=True)
                total = combiner.combine(losses, roi_features)
                # Dropped before the backward, which frees the (R, D) features once the heads' gradients
                # are computed: held here, they would stay alive at the neck's peak (kilobytes per ROI).
                del roi_features
        scaler.scale(total / accumulation).backward()
        for name, value in losses.items():
            step_losses[name] = step_losses.get(name, 0) + value.detach() / accumulation
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


def _short(value: float) -> str:
    """A log number: 4 decimals, or 3 significant digits for small ones (a learning rate of 3e-5)."""
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3e}"


def _log_step(
    run_log: RunLog,
    bar: tqdm,
    iteration: int,
    max_iter: int,
    values: dict[str, float],
    lr: float,
    seconds: float,
    device: torch.device,
) -> None:
    """One ``train`` row (the step's values, learning rate, seconds per step, peak memory) and log line."""
    row = {**values, "lr": lr, "seconds_per_iter": seconds}
    if device.type == "cuda":
        row["max_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    run_log.record("train", iteration, row)
    bar.set_postfix(loss=f"{values['loss_total']:.4f}", lr=f"{lr:.2e}")
    logger.info(
        "iter %d/%d  %s  lr %.3e  %.2f s/it", iteration, max_iter,
        "  ".join(f"{k} {_short(v)}" for k, v in values.items()), lr, seconds,
    )  # fmt: skip


def _periodic_evaluation(
    model: nn.Module,
    evaluator: Evaluator,
    state: TrainState,
    run_log: RunLog,
    checkpointer: Checkpointer,
    payload: Callable[[], dict[str, Any]],
) -> None:
    """A periodic evaluation: logged, kept as ``state.last_eval`` and offered as the best."""
    model.eval()
    with torch.no_grad():
        result = evaluator(_unwrap(model))
    model.train()
    state.last_eval = result.metrics
    run_log.evaluation(state.iteration, result)  # metrics, per-class APs, images of detections
    if is_main_process():
        logger.info("evaluation at iteration %d: %s", state.iteration, result.metrics)
    metric = evaluator.primary_metric
    contents = lambda: checkpointer.checkpoint(state, payload())  # built only when it is the best
    checkpointer.offer_best(metric, result.metrics.get(metric), state.iteration, contents)


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


def _saved_weights(checkpointer: Checkpointer) -> str:
    """Where the last finite weights are, for the message of a run stopped by an overflowing update."""
    newest = checkpointer.newest()
    if newest is None:
        return "no checkpoint was saved before it (checkpoint_period), so no weights of this run are kept"
    return f"the newest checkpoint, {newest}, holds finite weights"


def _check_parameters(model: nn.Module, iteration: int, checkpointer: Checkpointer) -> None:
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise NonFiniteLossError(
            f"training stopped: the update of iteration {iteration} made parameters non-finite (the loss"
            " and gradients were finite: the step was too large). Lower solver.lr;"
            f" {_saved_weights(checkpointer)}"
        )


def _interrupted_message(
    signal_name: str | None, state: TrainState, max_iter: int, checkpointer: Checkpointer
) -> str:
    by = signal_name or "a signal to another process"
    return (
        f"interrupted by {by} after iteration {state.iteration}/{max_iter}: saved"
        f" {checkpointer.path(state.iteration)}; resume=true continues the run from it"
    )


def _stop_message(consecutive: int, state: TrainState, checkpointer: Checkpointer) -> str:
    last = state.last_finite
    return (
        f"training stopped: {consecutive} consecutive steps (up to iteration"
        f" {state.iteration}) had a non-finite loss, gradient or BatchNorm statistic; the"
        f" last finite step was {'iteration ' + str(last) if last else 'none of this run'}."
        " Lower solver.lr, lengthen solver.warmup_iters, or check the data. Its weights are"
        f" saved in {checkpointer.path(state.iteration)} (resume=true with a"
        " lower solver.lr continues from them)"
    )
