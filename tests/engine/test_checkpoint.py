"""Atomic checkpoints, recovery from a truncated one, RNG states across device layouts, and the
Checkpointer's files: rotation, the best model from periodic and final evaluations, the stored counters."""

from __future__ import annotations

import logging

import pytest
import torch

from wsod.engine.checkpoint import (
    Checkpointer,
    TrainState,
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


def _payload(weight: float):
    return lambda: {"model": {"w": torch.full((2,), weight)}}


def test_periodic_checkpoints_rotate_and_a_forced_one_is_not_saved_twice(tmp_path, monkeypatch):
    checkpointer = Checkpointer(tmp_path, period=2, keep=2, metadata={"classes": ["a"]})
    saves = []
    real = save_checkpoint
    monkeypatch.setattr("wsod.engine.checkpoint.save_checkpoint", lambda s, p: saves.append(p) or real(s, p))
    state = TrainState()
    for iteration in range(1, 8):
        state.iteration = iteration
        checkpointer.periodic(state, _payload(iteration))
    assert checkpointer.periodic(state, _payload(7), force=True) == tmp_path / "model_0000007.pth"
    state.iteration = 8
    checkpointer.periodic(state, _payload(8))
    assert checkpointer.periodic(state, _payload(8), force=True) is None  # the period saved it already
    assert [p.name for p in saves] == [f"model_{i:07d}.pth" for i in (2, 4, 6, 7, 8)]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["model_0000008.pth", "model_0000007.pth"]
    stored = load_checkpoint(tmp_path / "model_0000008.pth")
    assert stored["trainer"] == {
        "iteration": 8, "skipped_steps": 0, "last_finite": None, "last_eval": None, "best": None
    }  # fmt: skip
    assert stored["metadata"] == {"classes": ["a"]}
    assert torch.equal(stored["model"]["w"], torch.full((2,), 8.0))


def test_model_best_is_replaced_only_by_a_higher_value_from_periodic_or_final_evaluations(tmp_path):
    checkpointer = Checkpointer(tmp_path, period=0)
    state = TrainState(iteration=2)
    periodic = lambda weight: lambda: checkpointer.checkpoint(state, _payload(weight)())  # noqa: E731
    assert checkpointer.offer_best("mAP", 0.5, 2, periodic(2.0))
    assert not checkpointer.offer_best("mAP", 0.5, 3, periodic(3.0))  # equal: not better
    assert not checkpointer.offer_best("mAP", None, 3, periodic(3.0))  # undefined: never
    best = load_checkpoint(tmp_path / "model_best.pth")
    assert best["best"] == {"value": 0.5, "iteration": 2, "metric": "mAP"}
    assert best["trainer"]["best"] == best["best"]  # a resume from model_best.pth knows it too
    assert torch.equal(best["model"]["w"], torch.full((2,), 2.0))

    checkpointer.final({"w": torch.full((2,), 4.0)}, 4)
    assert checkpointer.offer_best("mAP", 0.7, 4)  # the final model, without reading model_final.pth
    best = load_checkpoint(tmp_path / "model_best.pth")
    assert best["best"] == {"value": 0.7, "iteration": 4, "metric": "mAP"} and best["iteration"] == 4
    assert torch.equal(best["model"]["w"], load_checkpoint(tmp_path / "model_final.pth")["model"]["w"])


def test_a_resume_keeps_the_better_of_the_checkpoints_best_and_model_best(tmp_path):
    recorded = {"value": 0.9, "iteration": 3, "metric": "mAP"}
    save_checkpoint({"model": {}, "best": recorded}, tmp_path / "model_best.pth")
    older = {"iteration": 2, "skipped_steps": 1, "best": {"value": 0.4, "iteration": 2, "metric": "mAP"},
             "last_eval": {"mAP": 0.4}, "last_finite": 2}  # fmt: skip
    checkpointer = Checkpointer(tmp_path)
    state = checkpointer.resume({"trainer": older})  # a trainer dict as written before TrainState
    assert state == TrainState(iteration=2, skipped_steps=1, last_finite=2, last_eval={"mAP": 0.4})
    assert checkpointer.best == recorded
    assert not checkpointer.offer_best("mAP", 0.8, 4, lambda: {})

    (tmp_path / "model_best.pth").write_bytes(b"truncated")  # unreadable: the checkpoint's record counts
    again = Checkpointer(tmp_path)
    again.resume({"trainer": older})
    assert again.best == older["best"]


def test_another_process_writes_nothing_but_keeps_the_same_best_record(tmp_path):
    checkpointer = Checkpointer(tmp_path / "run", period=1, enabled=False)
    state = TrainState(iteration=1)
    assert checkpointer.periodic(state, _payload(1), force=True) is None
    checkpointer.final({"w": torch.zeros(2)}, 1)
    assert checkpointer.offer_best("mAP", 0.3, 1)
    assert checkpointer.best == {"value": 0.3, "iteration": 1, "metric": "mAP"}
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_named_by_keep_at_is_saved_off_period_and_never_rotated_away(tmp_path):
    checkpointer = Checkpointer(tmp_path, period=4, keep=2, keep_at=[6])
    for iteration in range(1, 21):
        checkpointer.periodic(TrainState(iteration=iteration), lambda: {"model": {}})
    names = sorted(p.name for p in tmp_path.glob("model_*.pth"))
    assert names == ["model_0000006.pth", "model_0000016.pth", "model_0000020.pth"]
