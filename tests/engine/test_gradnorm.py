"""GradNorm at a shared tensor against a plain retain_graph implementation, and its behaviour in training."""

from __future__ import annotations

import copy
import importlib.util
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from wsod.engine.gradnorm import GradNorm
from wsod.sequential_backprop import SequentialBackprop

N, D_IN, D = 10, 5, 6
CHUNK = 3


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


class _Model(nn.Module):
    """A per-sample trunk (N, D_IN) -> shared (N, D) and three heads on the shared rows, plus weight decay
    on a head, a loss that does not go through the shared tensor (its GradNorm norm is 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, D), nn.Tanh())
        self.cls = nn.Linear(D, 4)
        self.reg = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, 2))
        self.mil = nn.Linear(D, 3)

    def forward(self, x, labels, targets, image_labels):
        shared = self.trunk(x)
        losses = {
            "cls": F.cross_entropy(self.cls(shared), labels),
            "reg": 50.0 * F.smooth_l1_loss(self.reg(shared), targets),  # another gradient scale
            # Image-level: log-sum-exp pooling over the rows, as a MIL head pools over ROIs.
            "mil": F.binary_cross_entropy_with_logits(self.mil(shared).logsumexp(dim=0), image_labels),
            "decay": 1e-2 * self.cls.weight.pow(2).sum(),
        }
        return shared, losses


def _wrap_trunk(model: _Model) -> _Model:
    model.trunk = SequentialBackprop(model.trunk, chunk_size=CHUNK)
    return model


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(N, D_IN, generator=g, dtype=torch.double),
        torch.randint(0, 4, (N,), generator=g),
        torch.randn(N, 2, generator=g, dtype=torch.double),
        torch.tensor([1.0, 0.0, 1.0], dtype=torch.double),
    )


def _reference_step(model, weights, initial, alpha, batch):
    """The usual GradNorm: full backward with retain_graph=True, then one create_graph gradient per loss."""
    shared, losses = model(*batch)
    values = torch.stack(list(losses.values()))
    if initial is None:
        initial = values.detach().clone()
    total = (weights * values).sum()
    total.backward(retain_graph=True)  # keeps the whole graph alive for the per-loss gradients below
    norms = []
    for i in range(len(values)):
        (grad,) = torch.autograd.grad(
            weights[i] * values[i], shared, retain_graph=True, create_graph=True, allow_unused=True
        )
        norms.append(grad.norm() if grad is not None else shared.new_zeros(()))
    norms = torch.stack(norms)
    relative = values.detach() / initial
    ratios = relative / relative.mean()
    targets = (norms.mean() * ratios**alpha).detach()
    grad_loss = (norms - targets).abs().sum()
    (weights.grad,) = torch.autograd.grad(grad_loss, weights)  # replaces the L_i from total.backward
    return initial, norms.detach(), ratios, total.detach()


@pytest.mark.parametrize("sequential", [False, True], ids=["plain_trunk", "sequential_trunk"])
def test_matches_retain_graph_reference_over_sgd_steps(sequential):
    torch.manual_seed(0)
    ref_model = _Model().double()
    model = copy.deepcopy(ref_model)
    if sequential:
        _wrap_trunk(model)
    alpha, num_losses = 1.5, 4
    ref_weights = nn.Parameter(torch.ones(num_losses, dtype=torch.double))
    # No floor: the reference is GradNorm as published, and a weight crosses zero below.
    gradnorm = GradNorm(num_losses, alpha, min_weight=None).double()
    ref_opt = torch.optim.SGD(
        [{"params": ref_model.parameters()}, {"params": [ref_weights], "lr": 0.05}], lr=0.1, momentum=0.9
    )
    opt = torch.optim.SGD(
        [{"params": model.parameters()}, {"params": gradnorm.parameters(), "lr": 0.05}], lr=0.1, momentum=0.9
    )
    initial = None
    weight_grads, weights_seen = [], []
    for step in range(5):
        batch = _batch(step)
        ref_opt.zero_grad()
        reference = _reference_step(ref_model, ref_weights, initial, alpha, batch)
        initial, ref_norms, ref_ratios, ref_total = reference

        opt.zero_grad()
        weights_seen.append(gradnorm.weights.detach().clone())
        shared, losses = model(*batch)
        total = gradnorm.balance(losses, shared)
        total.backward()  # no retain_graph

        assert torch.allclose(gradnorm.initial_losses, initial, rtol=1e-12, atol=0)
        assert _max_rel_err(gradnorm.last_norms, ref_norms) <= 1e-10
        assert gradnorm.last_norms[3] == 0 and ref_norms[3] == 0  # the "decay" loss skips `shared`
        assert _max_rel_err(gradnorm.last_ratios, ref_ratios) <= 1e-10
        assert _max_rel_err(gradnorm.weights.grad, ref_weights.grad) <= 1e-10
        assert _max_rel_err(total.detach(), ref_total) <= 1e-12
        ref_params, params = list(ref_model.parameters()), list(model.parameters())
        assert len(params) == len(ref_params) == 12
        for p, r in zip(params, ref_params, strict=True):
            assert p.grad is not None and _max_rel_err(p.grad, r.grad) <= 1e-10
        weight_grads.append(gradnorm.weights.grad.clone())

        ref_opt.step()
        opt.step()
        gradnorm.renormalize()
        with torch.no_grad():
            ref_weights.mul_(num_losses / ref_weights.sum())
        assert _max_rel_err(gradnorm.weights.detach(), ref_weights.detach()) <= 1e-10
        assert gradnorm.weights.sum().item() == pytest.approx(num_losses, rel=1e-12)
    # The comparison means something: the weights did receive non-zero, changing gradients.
    assert all(g[:3].abs().min() > 0 for g in weight_grads)
    assert not torch.allclose(weight_grads[0], weight_grads[-1])
    assert not torch.allclose(gradnorm.weights.detach(), torch.ones(num_losses, dtype=torch.double))
    # The "reg" weight crosses zero at the last step, so G_i = ||w_i dL_i/dS|| is compared for w_i < 0 too.
    assert weights_seen[-1][1] < 0 < weights_seen[-2][1]


def _two_scale_training(weight_lr: float, steps: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """Two regression heads on noise targets (irreducible losses, so the scales persist); the second loss
    is scaled by 100, so its gradient at the shared features starts about 100x larger. Returns per step
    max_i G_i / min_i G_i and the weights' sum after ``renormalize()``."""
    torch.manual_seed(seed)
    x = torch.randn(128, 4, dtype=torch.double)
    y1, y2 = torch.randn(128, 2, dtype=torch.double), torch.randn(128, 2, dtype=torch.double)
    trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double()
    head1, head2 = nn.Linear(8, 2).double(), nn.Linear(8, 2).double()
    # alpha = 0: the target is the mean norm itself, so balanced means equal G_i.
    gradnorm = GradNorm(2, alpha=0.0).double()
    model_params = [*trunk.parameters(), *head1.parameters(), *head2.parameters()]
    optimizer = torch.optim.SGD(
        [{"params": model_params, "lr": 0.01}, {"params": gradnorm.parameters(), "lr": weight_lr}]
    )
    ratios, sums = [], []
    for step in range(steps):
        # |G_i - target_i| gives the weights steps of constant size lr * ||dL_i/dS||: a decaying rate
        # lets them settle instead of oscillating around balance.
        optimizer.param_groups[1]["lr"] = weight_lr * 0.985**step
        optimizer.zero_grad()
        shared = trunk(x)
        losses = [F.mse_loss(head1(shared), y1), 100.0 * F.mse_loss(head2(shared), y2)]
        gradnorm.balance(losses, shared).backward()
        optimizer.step()
        gradnorm.renormalize()
        norms = gradnorm.last_norms
        ratios.append((norms.max() / norms.min()).item())
        sums.append(gradnorm.weights.sum().item())
    return ratios, sums


@pytest.fixture
def one_thread():
    """Hundreds of tiny steps: thread hand-offs would cost more than the maths on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gradient_norms_of_losses_100x_apart_converge(one_thread):
    steps = 200
    ratios, sums = _two_scale_training(weight_lr=5e-3, steps=steps)
    start, end = ratios[0], statistics.median(ratios[-50:])
    assert start > 50, f"the setup should start about 100x apart, measured {start:.1f}"
    assert end < 1.5, f"max/min G_i: {start:.1f} at the start, median {end:.3f} over the last 50 steps"
    assert sums == pytest.approx([2.0] * steps, rel=1e-12)
    # Control: with the weights frozen (lr 0) the same training keeps the norms far apart.
    frozen, _ = _two_scale_training(weight_lr=0.0, steps=steps)
    assert statistics.median(frozen[-50:]) > 30, f"without GradNorm: {statistics.median(frozen[-50:]):.1f}"


def test_roi_boundary_adds_no_trunk_forward():
    torch.manual_seed(0)
    model = _wrap_trunk(_Model().double())
    calls = []
    model.trunk.module.register_forward_hook(lambda _m, inputs, _o: calls.append(len(inputs[0])))
    head_calls = []
    model.reg.register_forward_hook(lambda *_: head_calls.append(1))
    gradnorm = GradNorm(4).double()
    batch = _batch(0)

    shared, losses = model(*batch)
    sum(losses.values()).backward()
    plain = list(calls)
    assert plain == [3, 3, 3, 1] * 2  # forward, then the recompute in backward

    calls.clear()
    model.zero_grad()
    shared, losses = model(*batch)
    total = gradnorm.balance(losses, shared)
    assert calls == [3, 3, 3, 1]  # the per-loss norms went back through the heads only
    total.backward()
    assert calls == plain
    assert len(head_calls) == 2
    # The big graph is freed by that one backward: it cannot be walked again.
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        total.backward()


def test_state_dict_round_trip_keeps_initial_losses():
    torch.manual_seed(0)
    model = _Model().double()
    gradnorm = GradNorm(4, alpha=1.0).double()
    shared, losses = model(*_batch(0))
    gradnorm.balance(losses, shared)
    recorded = gradnorm.initial_losses.clone()
    assert torch.equal(recorded, torch.stack([v.detach() for v in losses.values()]))
    with torch.no_grad():
        gradnorm.weights.copy_(torch.tensor([1.5, 0.5, 1.25, 0.75]))
    state = gradnorm.state_dict()
    assert set(state) == {"weights", "initial_losses", "baseline_sum", "baseline_count"}

    restored = GradNorm(4, alpha=1.0).double()
    assert not restored.initialized
    restored.load_state_dict(state)
    assert restored.initialized
    shared, losses = model(*_batch(1))  # other losses: a fresh GradNorm would record these
    restored.balance(losses, shared)
    assert torch.equal(restored.initial_losses, recorded)
    assert torch.equal(restored.weights.detach(), gradnorm.weights.detach())
    fresh = GradNorm(4, alpha=1.0).double()
    fresh.balance(losses, shared)
    assert not torch.equal(fresh.initial_losses, recorded)
    # ratios of the restored one use the first batch's losses
    relative = torch.stack([v.detach() for v in losses.values()]) / recorded
    assert torch.allclose(restored.last_ratios, relative / relative.mean(), rtol=1e-12, atol=0)


def test_errors_and_guards():
    torch.manual_seed(0)
    model = _Model().double()
    shared, losses = model(*_batch(0))
    values = list(losses.values())
    with pytest.raises(ValueError, match="requires grad"):
        GradNorm(4).double().balance(values, shared.detach())
    with pytest.raises(ValueError, match="expected 4 losses, got 3"):
        GradNorm(4).double().balance(values[:3], shared)
    with pytest.raises(ValueError, match="must be a scalar"):
        GradNorm(4).double().balance([*values[:3], shared.sum(dim=0)], shared)
    # A loss at zero on the first call (a box loss without foreground) is recorded at its first positive
    # value; until then its relative rate counts as 1.
    zero_first = GradNorm(4).double()
    zero_first.balance({**losses, "reg": 0.0 * losses["reg"]}, shared)
    reg = list(losses).index("reg")
    assert not zero_first.initialized and torch.isnan(zero_first.initial_losses[reg])
    assert zero_first.last_ratios.isfinite().all()
    zero_first.balance(losses, shared)
    assert zero_first.initialized and zero_first.initial_losses[reg] == losses["reg"].item()

    gradnorm = GradNorm(4).double()
    gradnorm.balance(losses, shared)
    with pytest.raises(ValueError, match="loss names"):
        gradnorm.balance(dict(reversed(list(losses.items()))), shared)
    # A loss that needs no gradient at all counts as norm 0, and its weight gets no gradient.
    constant = torch.tensor(0.5, dtype=torch.double)
    gradnorm.balance({**losses, "decay": constant}, shared)
    assert gradnorm.last_norms[3] == 0 and gradnorm.weights.grad[3] == 0
    assert (gradnorm.last_norms[:3] > 0).all()

    # A weight that an optimizer step took below the floor is clamped to it before the rescale: a
    # negative weight would maximise its loss (the toy run's GradNorm did that before the floor).
    with torch.no_grad():
        gradnorm.weights.copy_(torch.tensor([1.0, -2.0, 0.5, 0.5], dtype=torch.double))
    gradnorm.renormalize()
    expected = torch.tensor([1.0, 0.01, 0.5, 0.5], dtype=torch.double) * (4 / 2.01)
    torch.testing.assert_close(gradnorm.weights.detach(), expected)
    assert gradnorm.weights.sum().item() == pytest.approx(4.0, rel=1e-12)
    with torch.no_grad():
        gradnorm.weights.copy_(torch.tensor([1.0, float("nan"), 0.5, 0.5], dtype=torch.double))
    with pytest.raises(ValueError, match="sum to nan"):
        gradnorm.renormalize()
    with pytest.raises(ValueError, match="min_weight must lie in"):
        GradNorm(4, min_weight=-0.1)


def test_the_old_import_path_is_gone():
    # wsod.gradnorm re-exported GradNorm, which lives beside its training-loop half wsod.engine.balancing.
    assert importlib.util.find_spec("wsod.gradnorm") is None, "import wsod.engine.gradnorm instead"
