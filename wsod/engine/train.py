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
from wsod.engine.adversarial import DropBlockAdversary
from wsod.engine.amp import autocast, resolve_amp
from wsod.engine.balancing import LossBalancer
from wsod.engine.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from wsod.engine.evaluate import Evaluator
from wsod.engine.run_log import RunLog
from wsod.engine.solver import WarmupMultiStepLR, load_optimizer_state

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


def _recorded_best(path: Path) -> dict[str, Any] | None:
    """The evaluation ``model_best.pth`` was saved for, or None (no file, or an unreadable one)."""
    if not path.is_file():
        return None
    try:
        return load_checkpoint(path).get("best")
    except RuntimeError as error:
        logger.warning("ignoring %s: %s", path, error)
        return None


def _better_best(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    # A checkpoint older than the best evaluation does not know it; model_best.pth does.
    if a is None or (b is not None and b["value"] > a["value"]):
        return b
    return a


def _short(value: float) -> str:
    """A log number: 4 decimals, or 3 significant digits for small ones (a learning rate of 3e-5)."""
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3e}"


def _checkpoint_name(iteration: int) -> str:
    return f"model_{iteration:07d}.pth"


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


def _saved_weights(run_dir: Path) -> str:
    """Where the last finite weights are, for the message of a run stopped by an overflowing update."""
    saved = list_checkpoints(run_dir)
    if not saved:
        return "no checkpoint was saved before it (checkpoint_period), so no weights of this run are kept"
    return f"the newest checkpoint, {saved[0]}, holds finite weights"


def _check_parameters(model: nn.Module, iteration: int, run_dir: Path) -> None:
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise NonFiniteLossError(
            f"training stopped: the update of iteration {iteration} made parameters non-finite (the loss"
            f" and gradients were finite: the step was too large). Lower solver.lr; {_saved_weights(run_dir)}"
        )


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: WarmupMultiStepLR,
    make_batches: Callable[[int], Iterator[dict[str, Any]]],
    *,
    max_iter: int,
    run_dir: str | Path,
    device: torch.device,
    accumulation: int = 1,
    amp: str | None = None,
    resume_from: tuple[Path, dict[str, Any]] | None = None,
    checkpoint_period: int = 1000,
    keep_checkpoints: int = 3,
    log_period: int = 20,
    eval_period: int = 0,
    evaluator: Evaluator | None = None,
    adversary: DropBlockAdversary | None = None,
    balancer: LossBalancer | None = None,
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
        resume_from: ``(path, checkpoint)`` of a checkpoint of this run to continue from (see
            ``latest_valid_checkpoint``): weights, optimizer state, RNG states, counters and the best
            evaluation are restored; the optimizer hyperparameters and the learning-rate schedule are
            those of the ``optimizer`` and ``scheduler`` given, placed at the restored iteration (so a
            changed learning rate takes effect); ``metrics.jsonl`` and tensorboard drop what was logged
            after the checkpoint, so that each iteration appears once.
        evaluator: called on every process (prediction is distributed) every ``eval_period`` steps
            before the last; the checkpoint with the highest value of its primary metric is kept as
            ``model_best.pth``. The final evaluation is the caller's, after ``model_final.pth`` exists.
        adversary: the adversarial DropBlock step (``DropBlockAdversary``), run after every applied
            detector step on the same batches; its optimizer state is checkpointed and its schedule
            stepped with the detector's.
        balancer: GradNorm loss weights (``LossBalancer``): each batch's losses are weighted by it and
            its weights updated after every applied step (state checkpointed, weights logged).
        max_nonfinite: abort after this many consecutive steps whose loss, gradient or updated
            buffers (BatchNorm running statistics) are not finite. Such a step is skipped: no parameter,
            buffer or optimizer state changes; it is counted and logged. The abort saves a checkpoint of
            the last finite state (whatever ``checkpoint_period``) and names it. An update that makes a
            parameter non-finite stops the run at once, so that no checkpoint ever holds non-finite
            weights; its message says which checkpoint, if any, holds the last finite ones.
        metadata: stored in every checkpoint under "metadata" (e.g. the model config and class names,
            so that evaluation can rebuild the model from the checkpoint alone).

    Returns a summary: final iteration, skipped steps, last losses and the last evaluation.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    main = is_main_process()
    amp = resolve_amp(amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    state = {"iteration": 0, "skipped_steps": 0, "best": None, "last_eval": None, "last_finite": None}

    if resume_from is not None:
        path, checkpoint = resume_from
        _unwrap(model).load_state_dict(checkpoint["model"])
        load_optimizer_state(optimizer, checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        set_rng_state(checkpoint["rng"])
        state.update(checkpoint["trainer"])
        state["best"] = _better_best(state["best"], _recorded_best(run_dir / "model_best.pth"))
        # The schedule is a function of the iteration: a freshly built one, placed at the restored
        # iteration, applies a changed schedule at once and equals the saved one otherwise.
        scheduler.place(state["iteration"])
        if adversary is not None and "adversary" in checkpoint:
            adversary.load_state_dict(checkpoint["adversary"], state["iteration"])
        if balancer is not None and "balancer" in checkpoint:
            balancer.load_state_dict(checkpoint["balancer"])
        logger.info("resumed from %s at iteration %d", path, state["iteration"])

    # On a resume, rows and events logged after the checkpoint's iteration are dropped: they repeat.
    run_log = RunLog(run_dir, enabled=main, purge_after=state["iteration"] if resume_from else None)

    def record(kind: str, values: dict[str, Any]) -> None:
        run_log.record(kind, state["iteration"], values)

    def checkpoint_state() -> dict[str, Any]:
        return {
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_state(),
            "trainer": dict(state),
            **({"adversary": adversary.state_dict()} if adversary is not None else {}),
            **({"balancer": balancer.state_dict()} if balancer is not None else {}),
            "metadata": metadata or {},
        }

    def save_periodic() -> None:
        save_checkpoint(checkpoint_state(), run_dir / _checkpoint_name(state["iteration"]))
        for old in list_checkpoints(run_dir)[keep_checkpoints:]:
            old.unlink(missing_ok=True)

    def run_evaluation() -> None:
        model.eval()
        with torch.no_grad():
            result = evaluator(_unwrap(model))
        model.train()
        metrics = result.metrics
        state["last_eval"] = metrics
        value = metrics.get(evaluator.primary_metric)
        is_best = value is not None and (state["best"] is None or value > state["best"]["value"])
        if is_best:
            state["best"] = {
                "value": value,
                "iteration": state["iteration"],
                "metric": evaluator.primary_metric,
            }
        if main:
            run_log.evaluation(state["iteration"], result)  # metrics, per-class APs, images of detections
            logger.info("evaluation at iteration %d: %s", state["iteration"], metrics)
            if is_best:
                save_checkpoint({**checkpoint_state(), "best": state["best"]}, run_dir / "model_best.pth")

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
            buffers = _copy_buffers(model)  # restored if the step is skipped
            step_losses: dict[str, torch.Tensor] = {}
            step_inputs = []  # kept for the adversarial DropBlock step
            for micro in range(accumulation):
                inputs = model_inputs(next(batches), device)
                if adversary is not None:
                    step_inputs.append(inputs)
                sync = micro == accumulation - 1 or not isinstance(model, nn.parallel.DistributedDataParallel)
                with model.no_sync() if not sync else nullcontext(), autocast(device, amp):
                    if balancer is None:
                        losses = model(**inputs)
                        total = sum(losses.values())
                    else:  # GradNorm measures at the ROI features, before the one backward
                        losses, roi_features = model(**inputs, return_features=True)
                        total = balancer.weighted_total(losses, roi_features)
                scaler.scale(total / accumulation).backward()
                for name, value in losses.items():
                    step_losses[name] = step_losses.get(name, 0) + value.detach() / accumulation
            step_losses["loss_total"] = sum(step_losses.values())
            reduced = _reduce_losses(step_losses)
            # The same decision on every process: losses are averaged over processes, and DDP has made
            # the gradients identical. fp16's scaler skips overflowing gradients itself (routinely).
            finite = math.isfinite(reduced["loss_total"])
            if finite and not scaler.is_enabled():
                reduced["grad_norm"] = _gradient_norm(optimizer)
                finite = math.isfinite(reduced["grad_norm"])
            what = "loss or gradient"
            if finite and not _buffers_finite(model):
                finite, what = False, "BatchNorm statistic (finite loss and gradient)"
            if finite:
                consecutive_nonfinite = 0
                state["last_finite"] = state["iteration"] + 1
                scaler.step(optimizer)
                scaler.update()
                _check_parameters(model, state["iteration"] + 1, run_dir)
                if adversary is not None:
                    reduced["adversarial_loss"] = adversary.step(step_inputs)
                if balancer is not None:
                    balancer.step()
                    reduced.update(balancer.weights())
            else:
                consecutive_nonfinite += 1
                state["skipped_steps"] += 1
                _restore(buffers)
                if balancer is not None:
                    balancer.discard()
                logger.warning(
                    "non-finite %s at iteration %d (%s): step skipped, weights and statistics unchanged"
                    " (%d skipped in total)", what, state["iteration"] + 1, reduced, state["skipped_steps"],
                )  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used, for the log
            if adversary is not None:
                reduced["dropblock_lr"] = adversary.lr
                adversary.scheduler.step()
            scheduler.step()
            state["iteration"] += 1
            last_losses = reduced
            bar.update(1)

            if main and (state["iteration"] % log_period == 0 or state["iteration"] == max_iter):
                seconds = (time.perf_counter() - step_start) / log_period
                values = {**reduced, "lr": lr, "seconds_per_iter": seconds}
                if device.type == "cuda":
                    values["max_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
                record("train", values)
                bar.set_postfix(loss=f"{reduced['loss_total']:.4f}", lr=f"{values['lr']:.2e}")
                logger.info(
                    "iter %d/%d  %s  lr %.3e  %.2f s/it", state["iteration"], max_iter,
                    "  ".join(f"{k} {_short(v)}" for k, v in reduced.items()), values["lr"], seconds,
                )  # fmt: skip
                step_start = time.perf_counter()
            if consecutive_nonfinite >= max_nonfinite:  # after logging the step
                # Skipped steps changed nothing: the model and optimizer hold the last finite step's
                # state. Saved now, whatever checkpoint_period says, so that the stop loses no work.
                if main:
                    save_periodic()
                last = state["last_finite"]
                raise NonFiniteLossError(
                    f"training stopped: {consecutive_nonfinite} consecutive steps (up to iteration"
                    f" {state['iteration']}) had a non-finite loss, gradient or BatchNorm statistic; the"
                    f" last finite step was {'iteration ' + str(last) if last else 'none of this run'}."
                    " Lower solver.lr, lengthen solver.warmup_iters, or check the data. Its weights are"
                    f" saved in {run_dir / _checkpoint_name(state['iteration'])} (resume=true with a"
                    " lower solver.lr continues from them)"
                )
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
