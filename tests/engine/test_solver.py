"""Solver: the warm-up + multi-step schedule, the parameter groups and the momentum rescale."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from wsod.engine.solver import WarmupMultiStep, build_optimizer, build_scheduler, rescale_momentum


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


def _linear_model():
    """y = w x + b with w = b = 1; with x = 1 and loss y, every step's gradient is 1 for both."""
    model = nn.Sequential(nn.Linear(1, 1))  # parameter names "0.weight", "0.bias": two groups
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
    return model


def _sgd_steps(model, optimizer, scheduler, steps):
    for _ in range(steps):
        model(torch.ones(1, 1)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def _hand_sgd(lrs, rescale, momentum=0.9, grad=1.0, start=1.0):
    """PyTorch's SGD by hand (buf = g on the first step, then momentum * buf + g; p -= lr * buf), with the
    reference's rescale buf *= new_lr / old_lr after every lr change by a factor above 1.1."""
    p, buf = start, None
    for t, lr in enumerate(lrs):
        buf = grad if buf is None else momentum * buf + grad
        p -= lr * buf
        nxt = lrs[t + 1] if t + 1 < len(lrs) else lr
        if rescale and max(nxt / lr, lr / nxt) > 1.1:
            buf *= nxt / lr
    return p, buf


@pytest.mark.parametrize("rescale", [True, False])
def test_momentum_rescale_follows_a_hand_computed_sgd_trajectory(rescale):
    model = _linear_model()
    optimizer = build_optimizer(model, name="sgd", lr=0.01, weight_decay=0.0, momentum=0.9)
    scheduler = build_scheduler(optimizer, milestones=[2, 4], gamma=0.1, momentum_rescale=rescale)
    _sgd_steps(model, optimizer, scheduler, 5)
    # lr 0.01, 0.01, 0.001, 0.001, 0.0001 for the weight; biases at twice that.
    weight_lrs = [0.01, 0.01, 0.001, 0.001, 0.0001]
    assert len(optimizer.param_groups) == 2
    for param, lrs in ((model[0].weight, weight_lrs), (model[0].bias, [2 * lr for lr in weight_lrs])):
        p, buf = _hand_sgd(lrs, rescale)
        assert param.item() == pytest.approx(p, rel=1e-6)
        assert optimizer.state[param]["momentum_buffer"].item() == pytest.approx(buf, rel=1e-6)
    # By hand, weight, rescaled: buf 1, 1.9 -> x0.1 = 0.19, 1.171, 2.0539 -> x0.1 = 0.20539, 1.184851.
    if rescale:
        assert optimizer.state[model[0].weight]["momentum_buffer"].item() == pytest.approx(1.184851, rel=1e-6)


def test_momentum_rescale_rule_is_the_reference_ratio_either_way():
    model = _linear_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    model(torch.ones(1, 1)).sum().backward()
    optimizer.step()
    buffer = optimizer.state[model[0].weight]["momentum_buffer"]

    def change(old, new):
        optimizer.param_groups[0]["lr"] = new
        before = buffer.item()
        rescale_momentum(optimizer, [old])
        return buffer.item() / before

    assert change(1.0, 1 / 1.1 + 1e-6) == 1.0  # a drop to just above 1 / 1.1: kept
    assert change(1.0, 0.9) == pytest.approx(0.9)  # ratio 1.11 > 1.1: rescaled
    assert change(1.0, 1.2) == pytest.approx(1.2)  # a rise counts too (reference: max of both ratios)
    assert change(1.0, 1.05) == 1.0
    assert change(1e-8, 1e-9) == 1.0  # from a learning rate at or below 1e-7: never
    # A linear warm-up from lr/3 over 200 steps changes the lr by at most 1% a step: never rescaled.
    schedule = WarmupMultiStep([20000], warmup_iters=200, warmup_factor=1 / 3)
    assert max(schedule(t + 1) / schedule(t) for t in range(300)) < 1.011


def test_momentum_rescale_survives_resume():
    def run(steps, state=None):
        model = _linear_model()
        optimizer = build_optimizer(model, name="sgd", lr=0.01, weight_decay=0.0)
        scheduler = build_scheduler(optimizer, milestones=[2], momentum_rescale=True)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        _sgd_steps(model, optimizer, scheduler, steps)
        states = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        return copy.deepcopy({k: v.state_dict() for k, v in states.items()})

    uninterrupted = run(4)
    for split in (1, 2, 3):  # checkpoints before, at and after the lr drop
        resumed = run(4 - split, run(split))
        torch.testing.assert_close(resumed["model"], uninterrupted["model"], rtol=0, atol=0)
        torch.testing.assert_close(
            resumed["optimizer"]["state"], uninterrupted["optimizer"]["state"], rtol=0, atol=0
        )
    # The setting is not state: the resumed run's own config decides it.
    assert "momentum_rescale" not in uninterrupted["scheduler"]
