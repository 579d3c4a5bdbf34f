"""Solver schedule and parameter groups; atomic checkpoints and recovery from a truncated one."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from wsod.engine.amp import resolve_amp
from wsod.engine.checkpoint import (
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
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


def test_rng_state_restores_from_another_device_layout(tmp_path, monkeypatch, caplog):
    # Saved by an 8-GPU process (three generators stand for them), resumed where one GPU is visible.
    state = rng_state()
    fake = torch.Generator().manual_seed(1)  # leaves the global stream alone
    state["cuda"] = [torch.randint(0, 255, (16,), dtype=torch.uint8, generator=fake) for _ in range(3)]
    expected = torch.rand(5)
    save_checkpoint({"rng": state}, tmp_path / "model_0000001.pth")
    torch.rand(7)  # move the stream on
    loaded = load_checkpoint(tmp_path / "model_0000001.pth", map_location=torch.device("cpu"))

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.append((s, device)))
    with caplog.at_level(logging.WARNING):
        set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(5), expected)  # the CPU stream, bit for bit
    assert len(restored) == 1 and restored[0][1] == 0
    assert restored[0][0].device.type == "cpu" and restored[0][0].dtype == torch.uint8
    assert torch.equal(restored[0][0], state["cuda"][0])
    assert "3 CUDA generator state(s), this process sees 1 GPU(s)" in caplog.text


def test_resume_loads_the_checkpoint_to_host_memory(monkeypatch, tmp_path):
    # On CUDA a map_location of the device would move the RNG byte tensors to the GPU, which
    # torch.set_rng_state refuses; load_state_dict moves weights to their parameters' devices anyway.
    import wsod.engine.train as engine

    seen = []

    def spy(directory, map_location="cpu"):
        seen.append(map_location)

    monkeypatch.setattr(engine, "latest_valid_checkpoint", spy)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = build_scheduler(optimizer, milestones=[])
    engine.train(
        model, optimizer, scheduler, lambda start: iter(()), max_iter=0, run_dir=tmp_path,
        device=torch.device("cpu"), resume=True, progress=False,
    )  # fmt: skip
    assert seen == ["cpu"]


def test_bf16_becomes_fp16_on_gpus_without_native_bfloat16(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with caplog.at_level(logging.WARNING):
        assert resolve_amp("bf16", "cuda") == "fp16"
    assert "no native bfloat16" in caplog.text
    assert resolve_amp("fp16", "cuda") == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_amp("bf16", "cuda") == "bf16"
    assert resolve_amp("bf16", "cpu") is None and resolve_amp(None, "cuda") is None
    with pytest.raises(ValueError, match="unknown amp 'fp8'"):
        resolve_amp("fp8", "cuda")
