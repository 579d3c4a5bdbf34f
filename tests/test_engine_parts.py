"""Solver schedule and parameter groups; atomic checkpoints and recovery from a truncated one."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from wsod.engine.checkpoint import latest_valid_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
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


def test_atomic_save_and_truncated_checkpoint_falls_back(tmp_path, caplog):
    for iteration in (10, 20, 30):
        save_checkpoint(
            {"iteration": iteration, "w": torch.full((3,), float(iteration))},
            tmp_path / f"model_{iteration:07d}.pth",
        )
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "model_0000030.pth",
        "model_0000020.pth",
        "model_0000010.pth",
    ]
    assert not list(tmp_path.glob("*.tmp"))  # no temporary files left behind
    newest = tmp_path / "model_0000030.pth"
    newest.write_bytes(newest.read_bytes()[:100])  # a run killed mid-write by something other than us
    with pytest.raises(RuntimeError, match="model_0000030.pth cannot be read"):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING):
        path, state = latest_valid_checkpoint(tmp_path)
    assert path.name == "model_0000020.pth" and state["iteration"] == 20
    assert "skipping unreadable checkpoint" in caplog.text
    assert latest_valid_checkpoint(tmp_path / "empty") is None
