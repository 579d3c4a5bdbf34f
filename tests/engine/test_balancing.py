"""GradNorm in the training loop: weight gradients averaged over accumulated batches and processes, the
neck run no more often than without it, and its state carried through checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wsod.engine.balancing import LossBalancer
from wsod.modeling import build_detector

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from test_detector import _batch  # noqa: E402

NUM_LOSSES = 7  # the MIL loss and three students' cls and box losses


def _detector():
    torch.manual_seed(0)
    return build_detector("resnet18", num_classes=3, chunk_size=4, width=0.25)


def _losses(model, counts=(13, 6), labels=((1, 0, 1), (0, 1, 0))):
    return model(*_batch(counts=counts, labels=labels), return_features=True)


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
        balancer = LossBalancer(NUM_LOSSES, lr=0.1)
        counts, labels = ((9, 5), ((1, 0, 1), (0, 1, 0))) if rank == 0 else ((6, 11), ((0, 1, 1), (1, 0, 0)))
        losses, features = _losses(model, counts, labels)
        balancer.weighted_total(losses, features)
        balancer.step()
        torch.save(balancer.gradnorm.weights.detach(), f"{folder}/weights_{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_loss_weights_stay_identical_on_every_process(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    first, second = (torch.load(tmp_path / f"weights_{rank}.pt") for rank in range(2))
    assert torch.equal(first, second) and not torch.equal(first, torch.ones(NUM_LOSSES))
