"""The one explicit training loop: iteration based, gradient accumulation, AMP, DDP, resume.

``iteration`` counts optimizer steps. One optimizer step consumes ``accumulation`` batches per process;
the learning-rate schedule, checkpoints, logging and evaluation are all counted in optimizer steps, so a
recipe written for 8 GPUs x 1 image keeps its numbers on 1 GPU with ``accumulation=8``.

What the loop leaves to others: which files are saved, and when, is the ``Checkpointer``'s
(``wsod.engine.checkpoint``: ``model_<iteration>.pth``, ``model_final.pth``, ``model_best.pth``); the
rows of ``metrics.jsonl`` and tensorboard go through the caller's ``RunLog``; one optimizer step is
``wsod.engine.step.train_step`` (the ROI benchmark runs the same); the optional extras (the adversarial
DropBlock step, GradNorm, the EMA teacher) are ``Companion``s called at fixed points of each step
(``wsod.engine.companion`` draws them); the tensorboard images of each student's pseudo-labels are
the optional ``PseudoLabelPreview``'s; the ``pseudo/`` precision of the pseudo boxes in the log rows is
``wsod.engine.pseudo_label_quality``'s (``pseudo_label_quality``). The caller writes ``config.yaml``
and ``log.txt`` and runs the final evaluation (``wsod.runs.train``).
"""

from __future__ import annotations

import logging
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

from wsod.distributed import is_main_process
from wsod.engine.amp import autocast, resolve_amp
from wsod.engine.checkpoint import Checkpointer, TrainState, rng_state, set_rng_state
from wsod.engine.companion import Companion, evaluation_model
from wsod.engine.evaluate import Evaluator
from wsod.engine.interrupt import StopRequests, TrainingInterrupted
from wsod.engine.pseudo_label_preview import PseudoLabelPreview
from wsod.engine.run_log import RunLog
from wsod.engine.solver import WarmupMultiStepLR, load_optimizer_state
from wsod.engine.step import NonFiniteParametersError, check_companions, train_step
from wsod.modeling.method import TrainingProgress
from wsod.progress import bars_shown

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
    pseudo_label_quality: bool = False,
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
        companions: training extras (``DropBlockAdversary``, ``LossBalancer``, ``EMATeacher``), called in
            this order at the points ``wsod.engine.companion`` lists; their state is checkpointed under
            their names; evaluations use the model ``evaluation_model`` gives (the teacher's, say), and
            ``model_final.pth`` holds their ``final_weights`` too.
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
        pseudo_label_quality: at every logged step (each multiple of ``log_period``, and the last), the
            step's forwards keep the pseudo-labels they trained on and its row gets their precision
            against the batch's true boxes (``pseudo/precision_k``, ``pseudo/boxes_k``,
            ``pseudo/precision_teacher``; ``wsod.engine.pseudo_label_quality``), on every process (the
            counts are summed over them). No key when the batch's images carry no true boxes. It
            changes nothing in the run. The model must keep ``"pseudo_labels"`` (the weakly-supervised
            detector; not the second stage's Faster R-CNN).

    Returns a summary: final iteration, skipped steps, last losses, the last periodic evaluation and
    the best one.
    """
    main = is_main_process()
    amp = resolve_amp(amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    check_companions(companions)
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
            # Decided from the iteration alone, the same on every process (its counts are summed).
            measure = pseudo_label_quality and _logged(state.iteration + 1, log_period, max_iter)
            try:
                step = train_step(
                    model, optimizer, batches, device=device, accumulation=accumulation, amp=amp,
                    scaler=scaler, companions=companions,
                    progress=TrainingProgress(state.iteration, max_iter), pseudo_label_quality=measure,
                )  # fmt: skip
            except NonFiniteParametersError as error:
                raise NonFiniteLossError(_parameters_message(state.iteration + 1, checkpointer)) from error
            values = step.values
            if step.applied:
                consecutive_nonfinite, state.last_finite = 0, state.iteration + 1
            else:
                consecutive_nonfinite += 1
                state.skipped_steps += 1
                logger.warning(
                    "non-finite %s at iteration %d (%s): step skipped, weights and statistics unchanged"
                    " (%d skipped in total)", step.problem, state.iteration + 1, values, state.skipped_steps,
                )  # fmt: skip
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used, for the log
            scheduler.step()
            state.iteration += 1
            bar.update(1)

            if main and _logged(state.iteration, log_period, max_iter):
                # Per step of this window: the last one (at max_iter) may be shorter than log_period.
                seconds = (time.perf_counter() - step_start) / (state.iteration - logged_at)
                _log_step(run_log, bar, state.iteration, max_iter, values, lr, seconds, device)
                step_start, logged_at = time.perf_counter(), state.iteration
            if main and step.applied and preview is not None and state.iteration % preview.period == 0:
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
                _periodic_evaluation(model, evaluator, state, run_log, checkpointer, payload, companions)
            if stop.requested_anywhere(device):  # after the step's checkpoint and evaluation
                checkpointer.periodic(state, payload, force=True)
                raise TrainingInterrupted(_interrupted_message(stop.name, state, max_iter, checkpointer))
        checkpointer.periodic(state, payload, force=True)  # the last state, whatever the period
        extra = {name: value for c in companions for name, value in c.final_weights().items()}
        checkpointer.final(_unwrap(model).state_dict(), state.iteration, extra)
    return {
        "iteration": state.iteration,
        "skipped_steps": state.skipped_steps,
        "losses": values,
        "eval": state.last_eval,
        "best": checkpointer.best,
    }


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _logged(iteration: int, log_period: int, max_iter: int) -> bool:
    """Whether the step that ends at ``iteration`` gets a log row: each multiple of ``log_period``, and
    the last."""
    return iteration % log_period == 0 or iteration == max_iter


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
    shown = bars_shown(shown)
    bar = tqdm(total=total, initial=initial, desc="train", disable=not shown, dynamic_ncols=True)
    try:
        # Log lines go through tqdm.write while the bar is shown, not tearing it.
        with logging_redirect_tqdm() if shown else nullcontext():
            yield bar
    finally:
        bar.close()


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
    companions: Sequence[Companion],
) -> None:
    """A periodic evaluation (of the model the companions say, ``evaluation_model``): logged, kept as
    ``state.last_eval`` and offered as the best."""
    model.eval()
    with torch.no_grad():
        result = evaluator(evaluation_model(model, companions))
    model.train()
    state.last_eval = result.metrics
    run_log.evaluation(state.iteration, result)  # metrics, per-class APs, images of detections
    if is_main_process():
        logger.info("evaluation at iteration %d: %s", state.iteration, result.metrics)
    metric = evaluator.primary_metric
    contents = lambda: checkpointer.checkpoint(state, payload())  # built only when it is the best
    checkpointer.offer_best(metric, result.metrics.get(metric), state.iteration, contents)


def _saved_weights(checkpointer: Checkpointer) -> str:
    """Where the last finite weights are, for the message of a run stopped by an overflowing update."""
    newest = checkpointer.newest()
    if newest is None:
        return "no checkpoint was saved before it (checkpoint_period), so no weights of this run are kept"
    return f"the newest checkpoint, {newest}, holds finite weights"


def _parameters_message(iteration: int, checkpointer: Checkpointer) -> str:
    return (
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
