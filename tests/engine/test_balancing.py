"""GradNorm in the training loop: weight gradients averaged over accumulated batches and processes, the
neck run no more often than without it, and its state carried through checkpoints."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wsod.engine.balancing import LossBalancer
from wsod.modeling import build_detector
from wsod.modeling.protocol import TRAINING_EXTRAS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from test_detector import _batch  # noqa: E402

NUM_LOSSES = 7  # the MIL loss and three students' cls and box losses


def _detector():
    torch.manual_seed(0)
    return build_detector("resnet18", num_classes=3, chunk_size=4, width=0.25)


def _losses(model, counts=(13, 6), labels=((1, 0, 1), (0, 1, 0))):
    output = model(*_batch(counts=counts, labels=labels), keep=("roi_features",))
    assert output.loss_scales is None  # not asked for
    return output.losses, output.roi_features


def test_weight_gradients_are_averaged_over_accumulated_batches():
    model = _detector()
    singles = []
    for counts in ((13, 6), (7, 9)):
        balancer = LossBalancer(NUM_LOSSES)
        balancer.gradnorm.initial_losses.fill_(1.0)  # the same reference for both runs
        losses, features = _losses(model, counts)
        balancer.weighted_total(losses, features)
        singles.append(balancer._grads[0])
    balancer = LossBalancer(NUM_LOSSES)
    balancer.gradnorm.initial_losses.fill_(1.0)
    for counts in ((13, 6), (7, 9)):
        losses, features = _losses(model, counts)
        balancer.weighted_total(losses, features)
    seen = []
    balancer.optimizer.step = lambda: seen.append(balancer.gradnorm.weights.grad.clone())
    balancer.step()
    torch.testing.assert_close(seen[0], (singles[0] + singles[1]) / 2)
    assert abs(balancer.gradnorm.weights.sum().item() - NUM_LOSSES) < 1e-5  # renormalised


def test_the_neck_runs_as_often_with_gradnorm_as_without():
    # GradNorm's norms are taken at the ROI features: only the heads are traversed for them.
    calls = {}
    for name, balancer in (("plain", None), ("gradnorm", LossBalancer(NUM_LOSSES))):
        model = _detector()
        counter = []
        model.roi_head.body.module.neck.register_forward_hook(lambda *_, c=counter: c.append(1))
        losses, features = _losses(model)
        total = sum(losses.values()) if balancer is None else balancer.weighted_total(losses, features)
        total.backward()
        calls[name] = len(counter)
    assert calls["plain"] == calls["gradnorm"] == 2 * 5  # 19 ROIs in chunks of 4: forward + recompute


def _worker(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        model = _detector()
        # One step inside the baseline window (its values averaged over the processes), then one balanced.
        balancer = LossBalancer(NUM_LOSSES, lr=0.1, start_iter=1, window=1)
        counts, labels = ((9, 5), ((1, 0, 1), (0, 1, 0))) if rank == 0 else ((6, 11), ((0, 1, 1), (1, 0, 0)))
        for _ in range(2):
            losses, features = _losses(model, counts, labels)
            balancer.weighted_total(losses, features)
            balancer.after_step([])
        torch.save(balancer.gradnorm.weights.detach(), f"{folder}/weights_{rank}.pt")
        torch.save(balancer.gradnorm.initial_losses, f"{folder}/baseline_{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_loss_weights_stay_identical_on_every_process(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    first, second = (torch.load(tmp_path / f"weights_{rank}.pt") for rank in range(2))
    assert torch.equal(first, second) and not torch.equal(first, torch.ones(NUM_LOSSES))
    first, second = (torch.load(tmp_path / f"baseline_{rank}.pt") for rank in range(2))
    assert torch.equal(first, second) and bool(torch.isfinite(first).all())


COUNTS = ((13, 6), (7, 9), (8, 8), (5, 10), (9, 7), (6, 12))


def _values(losses, names=None):
    return torch.stack([v.detach() for n, v in losses.items() if names is None or n in names])


def test_before_start_iter_the_weights_stay_at_1_and_the_window_mean_becomes_the_baseline():
    model = _detector()
    balancer = LossBalancer(NUM_LOSSES, start_iter=3, window=2, balance="all")
    window = []
    for iteration, counts in enumerate(COUNTS[:4]):
        losses, features = _losses(model, counts)
        total = balancer.weighted_total(losses, features)
        if iteration < 3:
            torch.testing.assert_close(total, sum(losses.values()), rtol=0, atol=0)  # a plain sum
            assert balancer._grads == [] and not balancer.gradnorm.initialized
            if iteration >= 1:  # the window: steps 1 and 2
                window.append(_values(losses))
        else:
            expected = torch.stack(window).double().mean(dim=0).float()
            torch.testing.assert_close(balancer.gradnorm.initial_losses, expected, rtol=1e-6, atol=0)
            assert len(balancer._grads) == 1
        row = balancer.after_step([])
        assert (set(row.values()) == {1.0}) == (iteration < 3), row  # only weights before the start
        assert any(k.startswith("gradnorm_rate_") for k in row) == (iteration == 3)


def test_balance_students_keeps_the_mil_loss_at_weight_1():
    model = _detector()
    balancer = LossBalancer(NUM_LOSSES, lr=0.5, balance="students")
    assert balancer.gradnorm.num_losses == NUM_LOSSES - 1
    for counts in COUNTS[:3]:
        losses, features = _losses(model, counts)
        total = balancer.weighted_total(losses, features)
        students = [v for n, v in losses.items() if n != "loss_mil"]
        weights = balancer.gradnorm.weights.detach()
        expected = losses["loss_mil"] + sum(w * v for w, v in zip(weights, students, strict=True))
        torch.testing.assert_close(total, expected)
        row = balancer.after_step([])
    assert row["weight_loss_mil"] == 1.0 and "gradnorm_norm_loss_mil" not in row
    student_weights = [v for k, v in row.items() if k.startswith("weight_loss_ref")]
    assert sum(student_weights) == pytest.approx(NUM_LOSSES - 1, rel=1e-5) and len(set(student_weights)) > 1
    with pytest.raises(ValueError, match="no loss to balance"):
        LossBalancer(1, balance="students")


def test_normalized_rates_read_each_loss_over_its_pseudo_label_weight():
    model = _detector()
    balancer = LossBalancer(NUM_LOSSES, normalize_rates=True, balance="all")
    assert balancer.normalize_rates and balancer.keep == {"roi_features", "loss_scales"}
    assert LossBalancer(NUM_LOSSES).keep == {"roi_features"}  # plain rates read no scales
    rate_values = []
    for counts in COUNTS[:2]:
        output = model(*_batch(counts=counts), keep=balancer.keep)
        losses, scales = output.losses, output.loss_scales
        assert list(scales) == list(losses) and scales["loss_mil"].item() == 1.0
        balancer.combine(output)  # what the training step calls: weighted_total of the output's fields
        rate_values.append(torch.stack([losses[n].detach() / scales[n] for n in losses]))
        balancer.after_step([])
    torch.testing.assert_close(balancer.gradnorm.initial_losses, rate_values[0])
    relative = rate_values[1] / rate_values[0]
    torch.testing.assert_close(balancer.gradnorm.last_ratios, relative / relative.mean())
    with pytest.raises(ValueError, match="scales"):
        balancer.weighted_total(*_losses(model))
    # A box loss without foreground (0, its scale 0) reads as rate 0, not NaN: the weights stay finite.
    output = model(*_batch(counts=COUNTS[2]), keep=("roi_features", "loss_scales"))
    losses, features, scales = output.losses, output.roi_features, output.loss_scales
    losses["loss_ref_box_2"], scales["loss_ref_box_2"] = losses["loss_ref_box_2"] * 0, torch.tensor(0.0)
    balancer.weighted_total(losses, features, scales)
    balancer.after_step([])
    assert balancer.gradnorm.last_ratios[4] == 0 and bool(torch.isfinite(balancer.gradnorm.weights).all())


def test_the_weights_learning_rate_follows_the_milestones_and_resume_restores_every_state():
    def make():
        return LossBalancer(NUM_LOSSES, lr=0.1, start_iter=2, window=2, milestones=[3], gamma=0.1)

    def run(balancer, steps, model, log):
        for counts in steps:
            losses, features = _losses(model, counts)
            balancer.weighted_total(losses, features)
            log.append((balancer.lr, balancer.after_step([])))

    model = _detector()
    straight, rows = make(), []
    run(straight, COUNTS[:5], model, rows)
    assert [lr for lr, _ in rows] == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.01])
    # Stopped inside the window (after 1 step) and after the start (after 3): the resumed balancer goes
    # on exactly as the uninterrupted one.
    for stop in (1, 3):
        first = make()
        run(first, COUNTS[:stop], model, [])
        state = copy.deepcopy(first.state_dict())
        resumed, resumed_rows = make(), []
        resumed.load_state_dict(state, iteration=stop)
        for name, value in first.gradnorm.state_dict().items():
            torch.testing.assert_close(
                resumed.gradnorm.state_dict()[name], value, rtol=0, atol=0, equal_nan=True
            )
        run(resumed, COUNTS[stop:5], model, resumed_rows)
        assert resumed_rows == rows[stop:]


def test_keep_asks_only_for_the_training_extras_and_the_loss_scales_come_without_the_features():
    model = _detector()
    with pytest.raises(ValueError, match=f"roi_feature.*unknown.*{re.escape(str(TRAINING_EXTRAS))}"):
        model(*_batch(counts=COUNTS[0]), keep=("roi_feature",))
    output = model(*_batch(counts=COUNTS[0]), keep=("loss_scales",))
    assert output.roi_features is None
    assert list(output.loss_scales) == list(output.losses) == list(model.loss_names)
    assert output.loss_scales["loss_mil"].item() == 1.0
    assert all(not v.requires_grad and v.dim() == 0 for v in output.loss_scales.values())
    plain = model(*_batch(counts=COUNTS[0]))  # keeps nothing by default
    assert plain.roi_features is None and plain.loss_scales is None
