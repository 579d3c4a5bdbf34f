"""The adversarial step of Concrete DropBlock (docs/METHOD.md §6): after each detector step, the DropBlock
scorer learns to drop what the detector relies on most.

Per optimizer step: (1) the detector's own step on its total loss (the training loop's); (2) this step,
the loop's ``after_step`` of this companion (``wsod.engine.companion``): a second forward of the same
batches, with new DropBlock samples, and an update of the DropBlock parameters alone, descending on
``-weight x total loss`` (so ascending on the detector's loss) with their own optimizer and schedule.
The schedule steps with the detector's, whether the detector's step was applied or skipped.

With ``single_pass`` (``solver.dropblock.single_pass``; a departure from the reference, docs/METHOD.md §6)
there is no second forward: the detector's own backward has already given the DropBlock parameters the
gradient of the detector's loss through the straight-through masks (the loss it descends on, so with
GradNorm the weighted total), and this step negates and scales that gradient. It costs the scorer's
forward and backward inside the detector's pass, not a second pass of the neck and heads; its masks are
the ones the detector trained on, where the reference's are fresh draws.

The second pass only needs the gradient of the DropBlock parameters. Every other parameter is set not to
require grad for its duration, so the base network builds no graph, the sequentially back-propagated
neck recomputes its chunks for the DropBlock parameters only, and the heads contribute no parameter
gradient. The pass goes through the unwrapped detector (not DistributedDataParallel, whose gradient
hooks expect every parameter); the DropBlock gradients are averaged over processes explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from wsod.distributed import all_reduce_mean
from wsod.engine.amp import autocast
from wsod.engine.companion import Companion
from wsod.engine.solver import WarmupMultiStepLR, load_optimizer_state

__all__ = ["DropBlockAdversary"]


@contextmanager
def _only_trainable(model: nn.Module, keep: Sequence[nn.Parameter]) -> Iterator[None]:
    """Within the block only ``keep`` require grad; every parameter's flag is restored afterwards."""
    kept = {id(p) for p in keep}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(id(p) in kept)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class DropBlockAdversary(Companion):
    """Trains a detector's ``dropblock`` adversarially; a training-loop ``Companion``.

    Args:
        detector: the (unwrapped) ``WeaklySupervisedDetector`` whose ``dropblock`` is trained.
        optimizer: over ``detector.dropblock``'s parameters only (the reference: SGD, lr 1e-4, momentum
            0.9, weight decay 1e-4, biases at twice the lr without decay).
        scheduler: the DropBlock learning-rate schedule (the reference: x3 at each of the detector's lr
            steps, warm-up over 500 steps); stepped once per optimizer step, by ``after_step`` or
            ``skip``, as the detector's is.
        weight: the DropBlock loss is ``-weight`` x the detector's total loss (reference: 0.01).
        amp: the training loop's resolved precision (None, "bf16" or "fp16"); fp16 uses its own scaler.
        single_pass: update from the gradients the detector's backward left on the DropBlock parameters
            (no second forward); not with fp16, whose loss scale belongs to the loop's scaler.
    """

    name = "adversary"

    def __init__(
        self,
        detector: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: WarmupMultiStepLR,
        *,
        weight: float = 0.01,
        amp: str | None = None,
        device: torch.device | str = "cpu",
        single_pass: bool = False,
    ) -> None:
        if detector.dropblock is None:
            raise ValueError("the detector has no DropBlock to train (build it with dropblock=True)")
        if single_pass and amp == "fp16":
            raise ValueError(
                "solver.dropblock.single_pass cannot run with fp16 (the detector's gradients carry the"
                " loop's loss scale): use amp=bf16 or null, or the two-pass step"
            )
        self.single_pass = bool(single_pass)
        self.needs_inputs = not self.single_pass  # the second forward runs on the step's own batches
        self.detector, self.optimizer, self.scheduler = detector, optimizer, scheduler
        self.weight, self.amp, self.device = weight, amp, torch.device(device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp == "fp16")
        self.params = [p for p in detector.dropblock.parameters() if p.requires_grad]
        self.skipped_steps = 0
        self._step_lr = self.lr  # the rate of the last optimizer step, for its log row

    def step(self, batches: Sequence[dict[str, Any]]) -> float:
        """One adversarial update from the step's batches (``model_inputs`` dicts already on the device,
        the micro-batches of one optimizer step). Returns the mean detector loss of the second forward
        (NaN when the step was skipped because a loss or gradient was not finite)."""
        totals, grads = [], [torch.zeros_like(p) for p in self.params]
        was_training = self.detector.training
        self.detector.train()
        with _only_trainable(self.detector, self.params):
            for inputs in batches:
                with autocast(self.device, self.amp):
                    losses = self.detector(**inputs).losses
                total = sum(losses.values())
                totals.append(total.detach().float())
                batch_grads = torch.autograd.grad(
                    self.scaler.scale(total) / len(batches), self.params, allow_unused=True
                )
                for accumulated, g in zip(grads, batch_grads, strict=True):
                    if g is not None:
                        accumulated += g
        self.detector.train(was_training)
        mean_loss = all_reduce_mean(torch.stack(totals).mean()).item()
        grads = [all_reduce_mean(g) for g in grads]
        self.optimizer.zero_grad(set_to_none=True)
        finite = math.isfinite(mean_loss) and all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite and not self.scaler.is_enabled():  # fp16's scaler skips overflow on its own
            self.skipped_steps += 1
            return math.nan
        for p, g in zip(self.params, grads, strict=True):
            p.grad = -self.weight * g  # ascend on the detector's loss
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return mean_loss

    def step_from_detector_gradients(self) -> bool:
        """The single-pass update: the gradients of the detector's loss that its backward left on the
        DropBlock parameters (a mean over the step's batches, as the detector's own), averaged over
        processes, negated and scaled by ``weight``, one optimizer step. Returns whether it was applied
        (not when a gradient is not finite: counted in ``skipped_steps``)."""
        # Every process reduces every parameter (a missing gradient as zeros), so the collectives match.
        grads = [all_reduce_mean(p.grad if p.grad is not None else torch.zeros_like(p)) for p in self.params]
        self.optimizer.zero_grad(set_to_none=True)
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.skipped_steps += 1
            return False
        for p, g in zip(self.params, grads, strict=True):
            p.grad = -self.weight * g  # ascend on the detector's loss
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def after_step(self, inputs: Sequence[dict[str, Any]]) -> dict[str, float]:
        """The adversarial update on the detector's applied step (``inputs``: its micro-batches), then the
        schedule's step. Two-pass: logs the mean detector loss of the second forward as
        ``adversarial_loss`` (single pass: the detector's own loss is the one, already logged)."""
        if self.single_pass:
            self.step_from_detector_gradients()
            values = {}
        else:
            values = {"adversarial_loss": self.step(inputs)}
        self._advance_schedule()
        return values

    def skip(self) -> None:
        """No adversarial update on a skipped step (the detector's gradients on the DropBlock are
        dropped); the schedule still steps, as the detector's does."""
        self.optimizer.zero_grad(set_to_none=True)
        self._advance_schedule()

    def log_values(self) -> dict[str, float]:
        return {"dropblock_lr": self._step_lr}

    def _advance_schedule(self) -> None:
        self._step_lr = self.lr  # read before the step: the rate this optimizer step used
        self.scheduler.step()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the optimizer's state and the fp16 scaler's (the schedule is a
        function of the iteration, placed on resume)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        """Restore ``state_dict()`` and place the schedule at ``iteration``, keeping the current
        hyperparameters (as the detector's optimizer does on a resume)."""
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
        self.scheduler.place(iteration)
