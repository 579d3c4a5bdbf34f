"""The training loop's own rules: non-finite steps are skipped without a trace and abort cleanly; a
resume places the schedule at the restored iteration and logs each iteration once. (The end-to-end
runs through tools/train.py are in tests/test_run.py.)"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from wsod.engine.checkpoint import latest_valid_checkpoint
from wsod.engine.solver import build_optimizer, build_scheduler
from wsod.engine.train import NonFiniteLossError, train


class _Tiny(nn.Module):
    """Takes the detector's keyword arguments; its loss turns NaN on the calls listed in ``poisoned``
    (counted from 1), after the forward has updated the BatchNorm statistics."""

    def __init__(self, poisoned=(), scale=1.0):
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.fc = nn.Linear(3, 1)
        self.poisoned, self.calls, self.scale = set(poisoned), 0, scale

    def forward(self, images, proposals, image_labels, image_sizes, original_sizes):
        self.calls += 1
        loss = self.scale * self.fc(self.norm(images.flatten(1)[:, :3])).pow(2).mean()
        return {"loss_a": loss * float("nan") if self.calls in self.poisoned else loss}


def _batches(start):
    """Batch i is a function of i alone, so a resumed stream continues the uninterrupted one."""
    for index in itertools.count(start):
        g = torch.Generator().manual_seed(100 + index)
        yield {
            "images": torch.randn(4, 3, 1, 1, generator=g),
            "proposals": [torch.zeros(1, 4)] * 4,
            "image_labels": torch.ones(4, 2),
            "image_sizes": [(1, 1)] * 4,
            "original_sizes": [(1, 1)] * 4,
        }


def _setup(poisoned=(), lr=0.1, scale=1.0):
    torch.manual_seed(0)
    model = _Tiny(poisoned, scale)
    optimizer = build_optimizer(model, name="sgd", lr=lr, momentum=0.9, weight_decay=0.0)
    return model, optimizer, build_scheduler(optimizer, milestones=[4], warmup_iters=2)


def _run(model, optimizer, scheduler, run_dir, max_iter, **options):
    return train(
        model, optimizer, scheduler, _batches, max_iter=max_iter, run_dir=run_dir,
        device=torch.device("cpu"), progress=False, log_period=1, **options,
    )  # fmt: skip


def _state(model, optimizer):
    return {k: v.clone() for k, v in model.state_dict().items()}, [
        optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()
    ]


def test_non_finite_steps_change_nothing_and_too_many_abort_naming_the_last_finite_step(tmp_path):
    reference = _setup()
    _run(*reference, tmp_path / "reference", max_iter=2)
    weights, momentum = _state(*reference[:2])

    model, optimizer, scheduler = _setup(poisoned={3, 4, 5})
    with pytest.raises(NonFiniteLossError) as caught:
        _run(model, optimizer, scheduler, tmp_path / "run", max_iter=8, max_nonfinite=3, checkpoint_period=1)
    assert str(caught.value).startswith(
        "training stopped: 3 consecutive steps (up to iteration 5) had a non-finite loss, gradient or"
        " BatchNorm statistic;"
        " the last finite step was iteration 2."
    )
    # Weights, BatchNorm statistics and momentum are those after iteration 2: nothing was applied.
    ours, our_momentum = _state(model, optimizer)
    for name, value in weights.items():
        assert torch.equal(ours[name], value), name
    assert all(torch.equal(a, b) for a, b in zip(our_momentum, momentum, strict=True))
    # Every checkpoint holds finite weights; the one saved at the stop (iteration 5) holds those of
    # iteration 2 and the three skipped steps, and the message names it.
    path, newest = latest_valid_checkpoint(tmp_path / "run")
    assert newest["trainer"]["iteration"] == 5 and newest["trainer"]["skipped_steps"] == 3
    assert f"Its weights are saved in {path}" in str(caught.value)
    for name, value in weights.items():
        assert torch.equal(newest["model"][name], value), name


def test_a_few_non_finite_steps_are_skipped_and_training_goes_on(tmp_path):
    model, optimizer, scheduler = _setup(poisoned={2, 3})
    summary = _run(model, optimizer, scheduler, tmp_path, max_iter=5, max_nonfinite=3)
    assert summary["iteration"] == 5 and summary["skipped_steps"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _Overflowing(nn.Module):
    """A layer before a train-mode BatchNorm: once its weights are huge (finite), the batch variance of
    its outputs overflows float32 and the running variance turns inf, while the normalised output, the
    loss and every gradient stay finite (what ``solver.lr=1e10`` does to the toy model)."""

    def __init__(self):
        super().__init__()
        self.fc0, self.norm, self.fc = nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)

    def forward(self, images, proposals, image_labels, image_sizes, original_sizes):
        # tanh bounds the loss whatever the weights, as the detector's softmax and BCE losses do.
        return {"loss_a": self.fc(self.norm(self.fc0(images.flatten(1)[:, :3]))).tanh().pow(2).mean()}


def test_steps_that_overflow_batchnorm_statistics_with_a_finite_loss_are_skipped(tmp_path, caplog):
    torch.manual_seed(0)
    model = _Overflowing()
    optimizer = build_optimizer(model, name="sgd", lr=1e25, momentum=0.0, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, milestones=[], warmup_iters=0)
    with pytest.raises(NonFiniteLossError) as caught:
        _run(model, optimizer, scheduler, tmp_path, max_iter=10, max_nonfinite=3, checkpoint_period=1)
    # Step 1 made the weights huge but finite; steps 2-4 had finite losses and overflowed statistics.
    assert "the last finite step was iteration 1" in str(caught.value)
    skipped = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert len(skipped) == 3 and all("non-finite BatchNorm statistic (finite loss" in m for m in skipped)
    assert all("loss_a" in m and "nan" not in m.split("(", 2)[2] for m in skipped)  # finite losses
    assert model.fc0.weight.abs().max() > 1e20 and torch.isfinite(model.fc0.weight).all()
    checkpoints = sorted(tmp_path.glob("model_*.pth"))
    assert [p.name for p in checkpoints] == ["model_0000002.pth", "model_0000003.pth", "model_0000004.pth"]
    for path in checkpoints:  # every one holds finite statistics: those after step 1
        state = torch.load(path, weights_only=False)["model"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()), path
        assert torch.equal(state["norm.running_var"], model.norm.running_var)


def test_an_update_that_makes_weights_non_finite_stops_at_once(tmp_path):
    model, optimizer, scheduler = _setup(
        lr=1e30, scale=1e10
    )  # finite loss and gradients, an overflowing step
    with pytest.raises(NonFiniteLossError, match="the update of iteration 1 made parameters non-finite") as e:
        _run(model, optimizer, scheduler, tmp_path, max_iter=3, checkpoint_period=1)
    assert not list(tmp_path.glob("model_*.pth"))
    assert "no checkpoint was saved before it (checkpoint_period)" in str(e.value)  # no false promise


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_applies_a_new_learning_rate_and_logs_each_iteration_once(tmp_path):
    _run(*_setup(), tmp_path, max_iter=4, checkpoint_period=2, keep_checkpoints=5)
    assert [r["iteration"] for r in _rows(tmp_path)] == [1, 2, 3, 4]
    (tmp_path / "model_0000004.pth").unlink()  # interrupted after iteration 3: resumes from 2

    model, optimizer, scheduler = _setup(lr=0.5)  # the run's new config says lr 0.5
    found = latest_valid_checkpoint(tmp_path)
    _run(model, optimizer, scheduler, tmp_path, max_iter=5, resume_from=found)
    rows = _rows(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]  # 3 is not repeated
    # The new rate, at the restored place of the schedule (warm-up over at 2, x0.1 after 4 steps).
    assert [r["lr"] for r in rows[2:]] == pytest.approx([0.5, 0.5, 0.05])
    assert optimizer.param_groups[0]["momentum"] == 0.9


def test_resume_after_a_momentum_rescale_equals_the_uninterrupted_run(tmp_path):
    def setup():
        torch.manual_seed(0)
        model = _Tiny()
        optimizer = build_optimizer(model, name="sgd", lr=0.1, momentum=0.9, weight_decay=0.0)
        return model, optimizer, build_scheduler(optimizer, milestones=[3], momentum_rescale=True)

    straight = setup()
    _run(*straight, tmp_path / "straight", max_iter=6)
    _run(*setup(), tmp_path / "cut", max_iter=6, checkpoint_period=4)
    (tmp_path / "cut" / "model_0000006.pth").unlink()
    # Resumed at 4, after the rescale at the lr drop of step 3: it must not be applied a second time.
    resumed = setup()
    _run(*resumed, tmp_path / "cut", max_iter=6, resume_from=latest_valid_checkpoint(tmp_path / "cut"))
    for (name, ours), theirs in zip(
        resumed[0].state_dict().items(), straight[0].state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs), name
