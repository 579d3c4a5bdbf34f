"""The one explicit training loop: iteration based, gradient accumulation, AMP, DDP, resume.

``iteration`` counts optimizer steps. One optimizer step consumes ``accumulation`` batches per process;
the learning-rate schedule, checkpoints, logging and evaluation are all counted in optimizer steps, so a
recipe written for 8 GPUs x 1 image keeps its numbers on 1 GPU with ``accumulation=8``.

Every run directory holds: ``config.yaml`` (written by the caller), ``log.txt``, ``metrics.jsonl`` (one
JSON object per logged iteration or evaluation), tensorboard events under ``tb/``, and checkpoints
``model_<iteration>.pth`` (the last ``keep_checkpoints``), ``model_final.pth`` and ``model_best.pth``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from wsod.data.loader import model_inputs
from wsod.distributed import all_reduce_mean, is_main_process
from wsod.engine.amp import autocast, resolve_amp
from wsod.engine.checkpoint import (
    latest_valid_checkpoint,
    list_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from wsod.engine.evaluate import Evaluator
from wsod.engine.run_log import RunLog

__all__ = ["train", "NonFiniteLossError"]

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Raised after too many consecutive optimizer steps with a non-finite loss."""


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _reduce_losses(losses: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean of each loss over processes (for logging only)."""
    names = sorted(losses)
    values = all_reduce_mean(torch.stack([losses[n].detach().float() for n in names]))
    return dict(zip(names, values.tolist(), strict=True))


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    make_batches: Callable[[int], Iterator[dict[str, Any]]],
    *,
    max_iter: int,
    run_dir: str | Path,
    device: torch.device,
    accumulation: int = 1,
    amp: str | None = None,
    resume: bool = False,
    checkpoint_period: int = 1000,
    keep_checkpoints: int = 3,
    log_period: int = 20,
    eval_period: int = 0,
    evaluator: Evaluator | None = None,
    max_nonfinite: int = 10,
    progress: bool = True,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``model`` (already on ``device``, possibly DDP-wrapped) for ``max_iter`` optimizer steps.

    Args:
        make_batches: ``start -> iterator of batches`` for this process, starting at its ``start``-th
            batch, so that a resumed run sees exactly the batches an uninterrupted run would. Batches
            are ``wsod.data.loader.collate`` dicts.
        accumulation: batches per optimizer step (gradients summed; each batch's loss divided by it).
        amp: None, "bf16" or "fp16" (fp16 uses a GradScaler); CUDA only, ignored on CPU; bf16 becomes
            fp16 on GPUs without native bfloat16 (``wsod.engine.amp.resolve_amp``).
        resume: continue from the newest readable checkpoint in ``run_dir`` (a fresh start if none).
        evaluator: called on every process (prediction is distributed) every ``eval_period`` steps
            before the last; the checkpoint with the highest value of its primary metric is kept as
            ``model_best.pth``. The final evaluation is the caller's, after ``model_final.pth`` exists.
        max_nonfinite: abort after this many consecutive steps whose loss is not finite (each such step
            is skipped, counted and logged).
        metadata: stored in every checkpoint under "metadata" (e.g. the model config and class names,
            so that evaluation can rebuild the model from the checkpoint alone).

    Returns a summary: final iteration, skipped steps, last losses and the last evaluation.
    """
    run_dir = Path(run_dir)
    main = is_main_process()
    amp = resolve_amp(amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    state = {"iteration": 0, "skipped_steps": 0, "best": None, "last_eval": None}

    # Loaded to host memory: load_state_dict copies each tensor to its parameter's device, and the RNG
    # states must stay CPU byte tensors.
    if resume and (found := latest_valid_checkpoint(run_dir, map_location="cpu")) is not None:
        path, checkpoint = found
        _unwrap(model).load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        set_rng_state(checkpoint["rng"])
        state.update(checkpoint["trainer"])
        logger.info("resumed from %s at iteration %d", path, state["iteration"])
    elif resume:
        logger.info("resume requested but no checkpoint in %s: starting from scratch", run_dir)

    run_log = RunLog(run_dir, enabled=main)

    def record(kind: str, values: dict[str, Any]) -> None:
        run_log.record(kind, state["iteration"], values)

    def checkpoint_state() -> dict[str, Any]:
        return {
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_state(),
            "trainer": dict(state),
            "metadata": metadata or {},
        }

    def save_periodic() -> None:
        save_checkpoint(checkpoint_state(), run_dir / f"model_{state['iteration']:07d}.pth")
        for old in list_checkpoints(run_dir)[keep_checkpoints:]:
            old.unlink(missing_ok=True)

    def run_evaluation() -> None:
        model.eval()
        with torch.no_grad():
            metrics = evaluator(_unwrap(model)).metrics
        model.train()
        state["last_eval"] = metrics
        value = metrics.get(evaluator.primary_metric)
        is_best = value is not None and (state["best"] is None or value > state["best"]["value"])
        if is_best:
            state["best"] = {"value": value, "iteration": state["iteration"]}
        if main:
            record("eval", metrics)
            logger.info("evaluation at iteration %d: %s", state["iteration"], metrics)
            if is_best:
                save_checkpoint(checkpoint_state(), run_dir / "model_best.pth")

    batches = make_batches(state["iteration"] * accumulation)
    model.train()
    consecutive_nonfinite = 0
    last_losses: dict[str, float] = {}
    bar = tqdm(
        total=max_iter,
        initial=state["iteration"],
        desc="train",
        disable=not (main and progress),
        dynamic_ncols=True,
    )
    step_start = time.perf_counter()
    cleanup = ExitStack()
    if main and progress:  # log lines go through tqdm.write while the bar is shown, not tearing it
        cleanup.enter_context(logging_redirect_tqdm())
    try:
        while state["iteration"] < max_iter:
            step_losses: dict[str, torch.Tensor] = {}
            for micro in range(accumulation):
                inputs = model_inputs(next(batches), device)
                sync = micro == accumulation - 1 or not isinstance(model, nn.parallel.DistributedDataParallel)
                with model.no_sync() if not sync else nullcontext(), autocast(device, amp):
                    losses = model(**inputs)
                    total = sum(losses.values())
                scaler.scale(total / accumulation).backward()
                for name, value in losses.items():
                    step_losses[name] = step_losses.get(name, 0) + value.detach() / accumulation
            step_losses["loss_total"] = sum(step_losses.values())
            reduced = _reduce_losses(step_losses)
            finite = math.isfinite(reduced["loss_total"])  # the same decision on every process
            if finite:
                consecutive_nonfinite = 0
                scaler.step(optimizer)
                scaler.update()
            else:
                consecutive_nonfinite += 1
                state["skipped_steps"] += 1
                logger.warning(
                    "non-finite loss at iteration %d (%s): step skipped (%d skipped in total)",
                    state["iteration"], reduced, state["skipped_steps"],
                )  # fmt: skip
                if consecutive_nonfinite >= max_nonfinite:
                    raise NonFiniteLossError(
                        f"{consecutive_nonfinite} consecutive steps had a non-finite loss (last: {reduced});"
                        " lower the learning rate, enable warm-up, or check the data (empty proposals?)"
                    )
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            state["iteration"] += 1
            last_losses = reduced
            bar.update(1)

            if main and (state["iteration"] % log_period == 0 or state["iteration"] == max_iter):
                seconds = (time.perf_counter() - step_start) / log_period
                values = {**reduced, "lr": optimizer.param_groups[0]["lr"], "seconds_per_iter": seconds}
                if device.type == "cuda":
                    values["max_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
                record("train", values)
                bar.set_postfix(loss=f"{reduced['loss_total']:.4f}", lr=f"{values['lr']:.2e}")
                logger.info(
                    "iter %d/%d  %s  lr %.3e  %.2f s/it", state["iteration"], max_iter,
                    "  ".join(f"{k} {v:.4f}" for k, v in reduced.items()), values["lr"], seconds,
                )  # fmt: skip
                step_start = time.perf_counter()
            if main and checkpoint_period and state["iteration"] % checkpoint_period == 0:
                save_periodic()
            periodic = eval_period and state["iteration"] % eval_period == 0
            if evaluator is not None and periodic and state["iteration"] < max_iter:
                run_evaluation()
        if main:
            save_periodic()
            final = {
                "model": _unwrap(model).state_dict(),
                "iteration": state["iteration"],
                "metadata": metadata or {},
            }
            save_checkpoint(final, run_dir / "model_final.pth")
    finally:
        cleanup.close()
        bar.close()
        run_log.close()
    return {
        "iteration": state["iteration"],
        "skipped_steps": state["skipped_steps"],
        "losses": last_losses,
        "eval": state["last_eval"],
        "best": state["best"],
    }
