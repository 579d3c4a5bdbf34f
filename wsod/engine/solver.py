"""Optimizer parameter groups, the warm-up + multi-step learning-rate schedule and the momentum rescale
at learning-rate changes (docs/METHOD.md §8).

The schedule counts optimizer steps, not forward passes: with gradient accumulation over N batches, one
scheduler step happens every N batches, so the recipe's iteration numbers keep their meaning.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "param_groups",
    "load_optimizer_state",
    "build_optimizer",
    "WarmupMultiStep",
    "WarmupMultiStepLR",
    "rescale_momentum",
    "build_scheduler",
]

# The reference code's rule (engine/trainer.py): rescale when the learning rate changes by a factor above
# 1.1 either way, from a learning rate above 1e-7.
MOMENTUM_RESCALE_RATIO = 1.1
MOMENTUM_RESCALE_MIN_LR = 1e-7


def param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    bias_lr_factor: float = 2.0,
    bias_weight_decay: float = 0.0,
    exclude: Iterable[nn.Parameter] = (),
) -> list[dict]:
    """Trainable parameters split into weights and biases: biases get ``bias_lr_factor`` x lr and
    ``bias_weight_decay`` (the reference recipe: lr x2, no decay). ``exclude``: parameters another
    optimizer owns (the DropBlock scorer, trained by its adversarial step)."""
    excluded = {id(p) for p in exclude}
    weights, biases = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in excluded:
            (biases if name.endswith(".bias") else weights).append(p)
    groups = [{"params": weights, "lr": lr, "weight_decay": weight_decay}]
    if biases:
        groups.append({"params": biases, "lr": lr * bias_lr_factor, "weight_decay": bias_weight_decay})
    return groups


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Restore an optimizer's state (momentum buffers, Adam moments) but keep the hyperparameters it was
    built with (lr, momentum, weight decay...): on a resume the run's current config is the one in
    effect, and a changed value must not be silently replaced by the checkpoint's."""
    fresh = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, hyperparameters in zip(optimizer.param_groups, fresh, strict=True):
        group.update(hyperparameters)


def build_optimizer(
    model: nn.Module,
    *,
    name: str = "sgd",
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    bias_lr_factor: float = 2.0,
    bias_weight_decay: float = 0.0,
    exclude: Iterable[nn.Parameter] = (),
) -> torch.optim.Optimizer:
    """SGD with momentum (the paper's recipe) or AdamW (trains the from-scratch toy model faster)."""
    groups = param_groups(
        model,
        lr=lr,
        weight_decay=weight_decay,
        bias_lr_factor=bias_lr_factor,
        bias_weight_decay=bias_weight_decay,
        exclude=exclude,
    )
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"unknown optimizer '{name}': expected 'sgd' or 'adamw'")


class WarmupMultiStep:
    """lr factor at optimizer step t: linear warm-up from ``warmup_factor`` to 1 over ``warmup_iters``,
    times ``gamma`` for every milestone <= t. A picklable callable for ``LambdaLR``."""

    def __init__(
        self,
        milestones: Sequence[int],
        gamma: float = 0.1,
        warmup_iters: int = 0,
        warmup_factor: float = 1 / 3,
    ) -> None:
        if list(milestones) != sorted(milestones):
            raise ValueError(f"milestones must be increasing, got {list(milestones)}")
        self.milestones = list(milestones)
        self.gamma = gamma
        self.warmup_iters = warmup_iters
        self.warmup_factor = warmup_factor

    def __call__(self, step: int) -> float:
        decay = self.gamma ** bisect.bisect_right(self.milestones, step)
        if step >= self.warmup_iters:
            return decay
        alpha = step / self.warmup_iters
        return decay * (self.warmup_factor * (1 - alpha) + alpha)


def rescale_momentum(
    optimizer: torch.optim.Optimizer,
    previous_lrs: Sequence[float],
    *,
    ratio: float = MOMENTUM_RESCALE_RATIO,
    min_lr: float = MOMENTUM_RESCALE_MIN_LR,
) -> bool:
    """Multiply each SGD momentum buffer by ``new_lr / old_lr`` where the learning rate just changed a lot.

    ``previous_lrs``: each parameter group's learning rate before the scheduler stepped; the new ones are
    read from the optimizer. A group is rescaled when its old learning rate is above ``min_lr`` and
    ``max(new / old, old / new) > ratio`` (the reference code's rule: with 1.1, a drop to below 1 / 1.1 of
    the old value or a rise above 1.1 times it; a linear warm-up over 200 steps changes it by at most 1% a
    step and is never rescaled). Only what the optimizer holds is read, so a resumed run behaves as an
    uninterrupted one. Returns whether any buffer was rescaled.
    """
    rescaled = False
    for group, old in zip(optimizer.param_groups, previous_lrs, strict=True):
        new = group["lr"]
        if old <= min_lr or new == old or max(new / old, old / max(new, 1e-10)) <= ratio:
            continue
        for param in group["params"]:
            buffer = optimizer.state.get(param, {}).get("momentum_buffer")
            if buffer is not None:
                buffer.mul_(new / old)
                rescaled = True
    return rescaled


# torch's warning when a scheduler steps before its optimizer ever has (torch.optim.lr_scheduler).
_SCHEDULER_BEFORE_OPTIMIZER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class WarmupMultiStepLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` on a ``WarmupMultiStep`` schedule that, with ``momentum_rescale``, rescales SGD momentum
    buffers at every large learning-rate change (``rescale_momentum``), right after the learning rate
    changes and before the next optimizer step uses it, as the reference trainer does.

    ``momentum_rescale`` is a setting, not state: it is left out of ``state_dict`` so that the config of
    a resumed run decides it.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, schedule: WarmupMultiStep, *, momentum_rescale: bool = False
    ) -> None:
        # LambdaLR's constructor steps once to set the starting learning rate: nothing to rescale there.
        self.momentum_rescale = False
        super().__init__(optimizer, schedule)
        self.momentum_rescale = momentum_rescale

    def step(self, epoch: int | None = None) -> None:
        previous = [group["lr"] for group in self.optimizer.param_groups]
        with warnings.catch_warnings():
            # The schedule counts optimizer steps taken or skipped (a non-finite step moves it on, so
            # that a resumed run's rates stay those of its iteration). torch takes a first step that
            # was skipped for the order mistake it warns about; this is the one place that happens.
            warnings.filterwarnings("ignore", _SCHEDULER_BEFORE_OPTIMIZER, UserWarning)
            super().step(epoch)
        if self.momentum_rescale:
            rescale_momentum(self.optimizer, previous)

    def place(self, iteration: int) -> None:
        """Set the learning rates of optimizer step ``iteration`` (a resumed run's position) without
        rescaling momentum: restored momentum buffers already carry every rescale up to there."""
        self.last_epoch = iteration
        for group, base, schedule in zip(
            self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True
        ):
            group["lr"] = base * schedule(iteration)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("momentum_rescale", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        setting = self.momentum_rescale
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "momentum_rescale"})
        self.momentum_rescale = setting


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    milestones: Sequence[int],
    gamma: float = 0.1,
    warmup_iters: int = 0,
    warmup_factor: float = 1 / 3,
    momentum_rescale: bool = False,
) -> WarmupMultiStepLR:
    """The warm-up + multi-step schedule; ``momentum_rescale`` rescales SGD momentum buffers at large
    learning-rate changes (the reference recipe; ``rescale_momentum``)."""
    return WarmupMultiStepLR(
        optimizer,
        WarmupMultiStep(milestones, gamma, warmup_iters, warmup_factor),
        momentum_rescale=momentum_rescale,
    )
