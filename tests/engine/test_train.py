"""The training loop's own rules: non-finite steps are skipped without a trace and abort cleanly; a
resume places the schedule at the restored iteration and logs each iteration once; companions are
called at fixed points of a step; periodic evaluations keep the best checkpoint. (The end-to-end runs
through tools/train.py are in tests/test_run.py.)"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from alive_probe import AliveProbe
from torch import nn

from wsod.engine.checkpoint import Checkpointer, latest_valid_checkpoint
from wsod.engine.companion import Companion
from wsod.engine.run_log import RunLog
from wsod.engine.solver import build_optimizer, build_scheduler
from wsod.engine.train import NonFiniteLossError, train
from wsod.modeling.protocol import TrainingOutput


class _Tiny(nn.Module):
    """Takes the detector's keyword arguments; its loss turns NaN on the calls listed in ``poisoned``
    (counted from 1), after the forward has updated the BatchNorm statistics."""

    def __init__(self, poisoned=(), scale=1.0):
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.fc = nn.Linear(3, 1)
        self.poisoned, self.calls, self.scale = set(poisoned), 0, scale

    def forward(
        self,
        images,
        proposals,
        image_labels,
        image_sizes,
        original_sizes,
        targets,
        views=1,
        progress=None,
        keep=(),
    ):
        self.calls += 1
        loss = self.scale * self.fc(self.norm(images.flatten(1)[:, :3])).pow(2).mean()
        return TrainingOutput({"loss_a": loss * float("nan") if self.calls in self.poisoned else loss})


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
            "targets": [{"labels": torch.ones(2)} for _ in range(4)],
        }


def _setup(poisoned=(), lr=0.1, scale=1.0):
    torch.manual_seed(0)
    model = _Tiny(poisoned, scale)
    optimizer = build_optimizer(model, name="sgd", lr=lr, momentum=0.9, weight_decay=0.0)
    return model, optimizer, build_scheduler(optimizer, milestones=[4], warmup_iters=2)


def _run(
    model, optimizer, scheduler, run_dir, max_iter, checkpoint_period=1000, keep_checkpoints=3, **options
):
    checkpointer = Checkpointer(run_dir, period=checkpoint_period, keep=keep_checkpoints)
    resume = options.get("resume_from")
    with RunLog(run_dir, purge_after=resume[1]["trainer"]["iteration"] if resume else None) as run_log:
        return train(
            model, optimizer, scheduler, _batches, max_iter=max_iter, device=torch.device("cpu"),
            checkpointer=checkpointer, run_log=run_log, progress=False, log_period=1, **options,
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


class _OverflowingStatistics(nn.Module):
    """A finite loss with non-finite BatchNorm statistics, built directly: on the calls listed in
    ``overflowing`` (counted from 1) the forward leaves an infinite running variance behind, as a
    variance of 1e20-sized activations does in float32 (what ``solver.lr=1e10`` does to the toy model),
    while the normalised output (from the batch's own statistics), the loss and every gradient stay
    finite. Built rather than provoked: whether a huge learning rate overflows the statistics before it
    overflows the loss depends on how the CPU rounds."""

    def __init__(self, overflowing=()):
        super().__init__()
        self.norm, self.fc = nn.BatchNorm1d(3), nn.Linear(3, 1)
        self.overflowing, self.calls = set(overflowing), 0

    def forward(
        self,
        images,
        proposals,
        image_labels,
        image_sizes,
        original_sizes,
        targets,
        views=1,
        progress=None,
        keep=(),
    ):
        self.calls += 1
        features = self.norm(images.flatten(1)[:, :3])
        if self.calls in self.overflowing:
            # In place, as BatchNorm writes its statistics. Through .data: the forward saved the buffer
            # for a backward that does not read it in training mode, and autograd would refuse a
            # visible in-place change of a saved tensor.
            self.norm.running_var.data[0] = math.inf
        return TrainingOutput({"loss_a": self.fc(features).pow(2).mean()})


def test_steps_that_overflow_batchnorm_statistics_with_a_finite_loss_are_skipped(tmp_path, caplog):
    torch.manual_seed(0)
    reference = _OverflowingStatistics()
    optimizer = build_optimizer(reference, name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    _run(reference, optimizer, build_scheduler(optimizer, milestones=[], warmup_iters=0), tmp_path / "ref", 1)

    torch.manual_seed(0)
    model = _OverflowingStatistics(overflowing={2, 3, 4})
    optimizer = build_optimizer(model, name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, milestones=[], warmup_iters=0)
    with pytest.raises(NonFiniteLossError) as caught:
        _run(model, optimizer, scheduler, tmp_path / "run", max_iter=10, max_nonfinite=3, checkpoint_period=1)
    assert "the last finite step was iteration 1" in str(caught.value)
    skipped = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert len(skipped) == 3 and all("non-finite BatchNorm statistic (finite loss" in m for m in skipped)
    assert all("loss_a" in m and "nan" not in m.split("(", 2)[2] for m in skipped)  # finite losses
    # Nothing of the skipped steps stayed: weights and statistics are those after step 1.
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    checkpoints = sorted((tmp_path / "run").glob("model_*.pth"))
    assert [p.name for p in checkpoints] == ["model_0000002.pth", "model_0000003.pth", "model_0000004.pth"]
    for path in checkpoints:  # every one holds the finite statistics of step 1
        state = torch.load(path, weights_only=True)["model"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()), path
        assert torch.equal(state["norm.running_var"], reference.norm.running_var)


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


class _Recorder(Companion):
    """Writes down each call of the loop, in order, with what it was given."""

    name = "recorder"
    needs_inputs = True

    def __init__(self, calls):
        self.calls, self.steps = calls, 0

    def after_step(self, inputs):
        self.steps += 1
        self.calls.append(("after_step", len(inputs)))
        return {"recorded_steps": float(self.steps)}

    def skip(self):
        self.calls.append(("skip",))

    def log_values(self):
        self.calls.append(("log_values",))
        return {"recorder_value": 1.5}

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state, iteration):
        self.calls.append(("load_state_dict", state, iteration))
        self.steps = state["steps"]


class _Halving(Companion):
    """Combines the losses: half their sum, measured at the features the forward returns."""

    name = "halving"
    combines_losses = True
    keep = frozenset({"roi_features"})

    def combine(self, output):
        assert output.roi_features.requires_grad
        return sum(output.losses.values()) / 2


class _TinyWithFeatures(_Tiny):
    def forward(
        self,
        images,
        proposals,
        image_labels,
        image_sizes,
        original_sizes,
        targets,
        views=1,
        progress=None,
        keep=(),
    ):
        output = super().forward(images, proposals, image_labels, image_sizes, original_sizes, targets, views)
        if "roi_features" in keep:
            output.roi_features = self.fc.weight * 1.0
        return output


def test_companions_are_called_at_fixed_points_of_each_step_and_checkpointed_by_name(tmp_path):
    calls = []
    model, optimizer, scheduler = _setup(poisoned={3})  # the first batch of step 2
    _run(
        model, optimizer, scheduler, tmp_path, max_iter=3, accumulation=2, checkpoint_period=2,
        companions=[_Recorder(calls)],
    )  # fmt: skip
    # Step 1 applied (both of its batches kept for it), step 2 skipped, step 3 applied.
    assert calls == [
        ("after_step", 2), ("log_values",), ("skip",), ("log_values",), ("after_step", 2), ("log_values",)
    ]  # fmt: skip
    rows = _rows(tmp_path)
    assert [r.get("recorded_steps") for r in rows] == [1.0, None, 2.0]
    assert all(r["recorder_value"] == 1.5 for r in rows)
    two = torch.load(tmp_path / "model_0000002.pth", weights_only=True)
    assert two["recorder"] == {"steps": 1}

    (tmp_path / "model_0000003.pth").unlink()
    resumed = []
    _run(
        *_setup(), tmp_path, max_iter=3, accumulation=2, companions=[_Recorder(resumed)],
        resume_from=latest_valid_checkpoint(tmp_path),
    )  # fmt: skip
    assert resumed[0] == ("load_state_dict", {"steps": 1}, 2) and resumed[1] == ("after_step", 2)


def test_the_companion_that_combines_the_losses_makes_the_total_that_is_backpropagated(tmp_path):
    straight = _setup()
    _run(*straight, tmp_path / "plain", max_iter=1)
    torch.manual_seed(0)
    model = _TinyWithFeatures()
    optimizer = build_optimizer(model, name="sgd", lr=0.2, momentum=0.9, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, milestones=[4], warmup_iters=2)
    _run(model, optimizer, scheduler, tmp_path / "halved", max_iter=1, companions=[_Halving()])
    # Half the loss at twice the learning rate: the same first SGD step.
    theirs = straight[0].state_dict()
    for name, ours in model.state_dict().items():
        torch.testing.assert_close(ours, theirs[name], msg=name)


def test_two_companions_that_combine_the_losses_are_refused(tmp_path):
    class _Other(_Halving):
        name = "other"

    with pytest.raises(ValueError, match="halving, other all combine the losses; pass at most one"):
        _run(*_setup(), tmp_path, max_iter=1, companions=[_Halving(), _Other()])


def test_a_resume_with_a_run_log_that_keeps_the_later_rows_is_refused(tmp_path):
    _run(*_setup(), tmp_path, max_iter=2, checkpoint_period=2)
    found = latest_valid_checkpoint(tmp_path)
    with RunLog(tmp_path) as run_log, pytest.raises(ValueError, match="open it with purge_after=2"):
        train(
            *_setup(), _batches, max_iter=3, device=torch.device("cpu"), checkpointer=Checkpointer(tmp_path),
            run_log=run_log, resume_from=found, progress=False,
        )  # fmt: skip


class _Scores:
    """An evaluator whose primary metric takes the given values, one per call."""

    primary_metric = "mAP"

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, model):
        value = self.values.pop(0)
        return SimpleNamespace(metrics={"mAP": value}, values={"mAP": value}, previews={})


def test_periodic_evaluations_keep_the_best_checkpoint_and_the_final_one_comes_last(tmp_path):
    model, optimizer, scheduler = _setup()
    summary = _run(
        model, optimizer, scheduler, tmp_path, max_iter=4, eval_period=1, evaluator=_Scores([0.1, 0.3, 0.2])
    )
    assert summary["best"] == {"value": 0.3, "iteration": 2, "metric": "mAP"}
    assert summary["eval"] == {"mAP": 0.2}  # evaluations before the last step only: 1, 2, 3
    best = torch.load(tmp_path / "model_best.pth", weights_only=True)
    assert best["best"] == summary["best"] and best["trainer"]["iteration"] == 2
    final = torch.load(tmp_path / "model_final.pth", weights_only=True)
    assert final["iteration"] == 4 and (tmp_path / "model_0000004.pth").is_file()  # the end's checkpoint
    for name, value in model.state_dict().items():
        assert torch.equal(final["model"][name], value), name
    assert [r["kind"] for r in _rows(tmp_path)] == ["train", "eval"] * 3 + ["train"]


class _WithFeatures(nn.Module):
    """A detector stand-in whose "ROI features" are only referenced by whoever it returns them to (its
    loss, a sum, saves nothing): the backward reaches the features after the heads, as the neck's does."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(
        self,
        images,
        proposals,
        image_labels,
        image_sizes,
        original_sizes,
        targets,
        views=1,
        progress=None,
        keep=(),
    ):
        features = AliveProbe.track(self.weight * images.flatten(1)[:, :3])
        losses = {"loss_a": features.sum()}
        return TrainingOutput(losses, roi_features=features if "roi_features" in keep else None)


class _Combiner(Companion):
    name = "combiner"
    combines_losses = True
    keep = frozenset({"roi_features"})

    def combine(self, output):
        losses = output.losses
        (grad,) = torch.autograd.grad(
            losses["loss_a"], output.roi_features, retain_graph=True, create_graph=True
        )
        return sum(losses.values()) + 0 * grad.sum()


@pytest.mark.parametrize("combined", [False, True])
def test_the_roi_features_are_not_held_through_the_backward(combined):
    # Held by the loop, the (R, D) features of a real detector stay alive at the neck's backward peak
    # (kilobytes per ROI: the fused slope of tools/benchmark_rois.py doubled when they were).
    from wsod.engine.step import _forward_backward

    model = _WithFeatures()
    batch = {"images": torch.ones(2, 3, 4, 4), "proposals": [torch.zeros(1, 4)] * 2, "image_labels": None,
             "image_sizes": [(4, 4)] * 2, "original_sizes": [(4, 4)] * 2, "targets": [{}, {}]}  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    companions = [_Combiner()] if combined else []
    _forward_backward(model, itertools.repeat(batch), torch.device("cpu"), 1, None, scaler, companions)
    assert AliveProbe.alive == [False] and model.weight.grad is not None


def test_seconds_per_step_divide_by_the_steps_of_each_window(tmp_path, monkeypatch):
    # A clock that advances 1 s per forward: every row must say 1 s per step, the last window (5 steps
    # with log_period 3: steps 4-5) included.
    import wsod.engine.train as train_module

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(train_module.time, "perf_counter", lambda: clock.now)
    model, optimizer, scheduler = _setup()
    forward = model.forward
    model.forward = lambda **inputs: (setattr(clock, "now", clock.now + 1.0), forward(**inputs))[1]
    checkpointer = Checkpointer(tmp_path, period=1000)
    with RunLog(tmp_path) as run_log:
        train(
            model, optimizer, scheduler, _batches, max_iter=5, device=torch.device("cpu"),
            checkpointer=checkpointer, run_log=run_log, progress=False, log_period=3,
        )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["seconds_per_iter"]) for r in rows if r["kind"] == "train"] == [
        (3, 1.0),
        (5, 1.0),
    ]


def test_a_skipped_first_step_moves_the_schedule_without_torchs_order_warning(tmp_path):
    """The schedule counts skipped steps too; torch would take a skipped first step for a scheduler
    stepped before its optimizer and warn."""
    model, optimizer, scheduler = _setup(poisoned={1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = _run(model, optimizer, scheduler, tmp_path, max_iter=2)
    assert summary["skipped_steps"] == 1 and scheduler.last_epoch == 2
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [
        str(w.message) for w in caught
    ]
