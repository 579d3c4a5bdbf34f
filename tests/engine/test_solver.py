"""Solver: the warm-up + multi-step schedule and the parameter groups."""

from __future__ import annotations

import pytest
from torch import nn

from wsod.engine.solver import WarmupMultiStep, build_optimizer, build_scheduler


def test_warmup_multistep_factors():
    schedule = WarmupMultiStep([20, 30], gamma=0.1, warmup_iters=10, warmup_factor=1 / 3)
    assert schedule(0) == pytest.approx(1 / 3)
    assert schedule(5) == pytest.approx(1 / 3 * 0.5 + 0.5)  # halfway between 1/3 and 1
    assert schedule(10) == 1.0 and schedule(19) == 1.0
    assert schedule(20) == pytest.approx(0.1) and schedule(30) == pytest.approx(0.01)


def test_bias_groups_and_scheduler():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    optimizer = build_optimizer(model, name="sgd", lr=0.01, weight_decay=1e-4)
    weights, biases = optimizer.param_groups
    assert [p.shape for p in weights["params"]] == [(2, 4)]  # the frozen weight is left out
    assert len(biases["params"]) == 2
    assert biases["lr"] == pytest.approx(0.02) and biases["weight_decay"] == 0.0
    assert weights["weight_decay"] == 1e-4
    scheduler = build_scheduler(optimizer, milestones=[2], warmup_iters=0)
    lrs = []
    for _ in range(3):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.01, 0.01, 0.001])
