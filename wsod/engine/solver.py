"""Optimizer parameter groups and the warm-up + multi-step learning-rate schedule (docs/METHOD.md §8).

The schedule counts optimizer steps, not forward passes: with gradient accumulation over N batches, one
scheduler step happens every N batches, so the recipe's iteration numbers keep their meaning.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["param_groups", "build_optimizer", "WarmupMultiStep", "build_scheduler"]


def param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    bias_lr_factor: float = 2.0,
    bias_weight_decay: float = 0.0,
) -> list[dict]:
    """Trainable parameters split into weights and biases: biases get ``bias_lr_factor`` x lr and
    ``bias_weight_decay`` (the reference recipe: lr x2, no decay)."""
    weights, biases = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (biases if name.endswith(".bias") else weights).append(p)
    groups = [{"params": weights, "lr": lr, "weight_decay": weight_decay}]
    if biases:
        groups.append({"params": biases, "lr": lr * bias_lr_factor, "weight_decay": bias_weight_decay})
    return groups


def build_optimizer(
    model: nn.Module,
    *,
    name: str = "sgd",
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    bias_lr_factor: float = 2.0,
    bias_weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """SGD with momentum (the paper's recipe) or AdamW (trains the from-scratch toy model faster)."""
    groups = param_groups(
        model,
        lr=lr,
        weight_decay=weight_decay,
        bias_lr_factor=bias_lr_factor,
        bias_weight_decay=bias_weight_decay,
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


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    milestones: Sequence[int],
    gamma: float = 0.1,
    warmup_iters: int = 0,
    warmup_factor: float = 1 / 3,
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupMultiStep(milestones, gamma, warmup_iters, warmup_factor)
    )
