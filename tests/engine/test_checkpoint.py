"""Atomic checkpoints, recovery from a truncated one, RNG states across device layouts."""

from __future__ import annotations

import logging

import pytest
import torch

from wsod.engine.checkpoint import (
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


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
