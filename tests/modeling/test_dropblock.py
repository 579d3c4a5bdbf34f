"""Concrete DropBlock: rescaling, drop rate, eval identity, straight-through gradients, and equivalence
with plain autograd inside SequentialBackprop (float64, every gradient compared)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import RoIAlign

from wsod.modeling.dropblock import ConcreteDropBlock
from wsod.modeling.roi_head import _NeckWithPooling
from wsod.sequential_backprop import SequentialBackprop

N = 9
C = 6
CHUNK_SIZES = [1, 4, N]


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def _saturated(block: ConcreteDropBlock) -> ConcreteDropBlock:
    """Push sigmoid(drop score) to 1 everywhere, so that every location's seed probability is gamma."""
    with torch.no_grad():
        block.scorer[-1].bias[0] = 100.0  # the last GroupNorm's shift of the drop score
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("rois", "size"), [(64, 7), (16, 14), (200, 2), (200, 1)])
def test_rescaling_keeps_the_mean_of_each_roi(dtype, rois, size):
    torch.manual_seed(0)
    block = ConcreteDropBlock(3).to(dtype).train()
    x = torch.ones(rois, 3, size, size, dtype=dtype)
    fully_dropped = partly_dropped = 0
    for _ in range(10):
        out = block(x)
        assert out.dtype == dtype and out.shape == x.shape and torch.isfinite(out).all()
        kept = (out > 0).sum(dim=(1, 2, 3)) // 3  # kept locations per ROI (all channels alike)
        # Each kept location is scaled by S*S / (kept locations of its ROI): the ROI's mean is 1.
        scale = size * size / kept.clamp(min=1).to(dtype)
        assert torch.equal(out, (out > 0) * scale.view(-1, 1, 1, 1))
        means = out.mean(dim=(1, 2, 3), dtype=torch.float64)
        has_kept = kept > 0
        assert torch.allclose(means[has_kept], torch.ones_like(means[has_kept]), rtol=0, atol=1e-6)
        # A ROI with nothing kept is all zeros (clamped denominator), never inf or NaN.
        assert (means[~has_kept] == 0).all()
        fully_dropped += int((~has_kept).sum())
        partly_dropped += int(((kept > 0) & (kept < size * size)).sum())
    assert fully_dropped + partly_dropped > 0, "something must be dropped, or the test checks nothing"
    if size <= 2:  # a single seed covers a 1x1 or 2x2 ROI: the zero-sum guard must have been exercised
        assert fully_dropped > 0


@pytest.mark.parametrize("size", [7, 14])
def test_dropped_fraction_stays_within_its_bound(size):
    torch.manual_seed(0)
    block = _saturated(ConcreteDropBlock(4).train())
    rois = 4000
    x = torch.randn(rois, 4, size, size)
    with torch.no_grad():
        assert torch.equal(block.seed_probability(x), torch.full((rois, 1, size, size), block.gamma))
        dropped = 1 - block.keep_mask(x)
    # Seeds are independent Bernoulli(gamma), so a location is dropped with probability
    # 1 - (1 - gamma)**k, k the number of seeds whose block covers it (9 inside, fewer at the border);
    # the union bound gives block_size**2 * gamma = drop_rate.
    k = F.conv2d(torch.ones(1, 1, size, size), torch.ones(1, 1, 3, 3), padding=1)
    expected = (1 - (1 - block.gamma) ** k).mean().item()
    assert expected <= block.drop_rate
    per_roi = dropped.mean(dim=(1, 2, 3), dtype=torch.float64)
    # Tolerance: ROIs are independent and each ROI's dropped fraction lies in [0, 1], so by Hoeffding
    # P(|mean over 4000 ROIs - expected| > 0.04) <= 2 exp(-2 * 4000 * 0.04**2) ~ 6e-6.
    tol = 0.04
    assert abs(per_roi.mean().item() - expected) <= tol
    assert per_roi.mean().item() <= block.drop_rate + tol
    # Without growing seeds into blocks the fraction would be about gamma = 0.033; with p = drop_rate
    # per seed (gamma not divided by block_size**2) it would be about 0.9: both fail the check above.


def test_eval_mode_is_the_identity_and_draws_nothing():
    block = ConcreteDropBlock(C).double().eval()
    x = torch.randn(N, C, 7, 7, dtype=torch.double)
    torch.manual_seed(3)
    out = block(x)
    after = torch.rand(1)
    torch.manual_seed(3)
    assert out is x and torch.equal(out, x)
    assert torch.equal(torch.rand(1), after)
    assert not torch.equal(block.train()(x), x)


def test_straight_through_gradients_reach_every_scorer_parameter_and_not_the_scorer_input():
    torch.manual_seed(0)
    block = ConcreteDropBlock(C).double().train()
    x = torch.randn(64, C, 7, 7, dtype=torch.double, requires_grad=True)
    grad_out = torch.randn(x.shape, dtype=torch.double)
    out = block(x)
    out.backward(grad_out)
    for name, p in block.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    # x is multiplied by a mask computed from x.detach(): its gradient is grad_out times that factor
    # only, with no term through the scorer.
    factor = out.detach() / x.detach()
    assert torch.allclose(x.grad, grad_out * factor, rtol=1e-12, atol=0)


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError, match="odd"):
        ConcreteDropBlock(4, block_size=2)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ConcreteDropBlock(4, drop_rate=9.0, block_size=3)


# --- inside SequentialBackprop ---------------------------------------------------------------------


def _dropblock_and_neck() -> nn.Sequential:
    """ConcreteDropBlock, then a small per-ROI neck with GroupNorm: (R, C, S, S) -> (R, 5)."""
    torch.manual_seed(0)
    neck = nn.Sequential(
        nn.Conv2d(C, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )
    return nn.Sequential(ConcreteDropBlock(C, hidden_channels=4), neck).double().train()


def _run(module, wrapper, inputs, seed=42, grad_output_seed=123):
    """Seed, forward through ``wrapper``, backward a fixed output gradient; returns output, gradients
    of the inputs that require grad and of every parameter, and the next draw of the RNG."""
    for x in inputs:
        x.grad = None
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = wrapper(*inputs)
    grad_out = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(grad_output_seed), dtype=out.dtype
    )
    out.backward(grad_out)
    grads = [x.grad for x in inputs if x.requires_grad] + [p.grad for p in module.parameters()]
    return out.detach(), [g.clone() for g in grads], torch.rand(1)


def _assert_same(result, ref, tol=1e-10):
    out, grads, after = result
    ref_out, ref_grads, ref_after = ref
    assert out.shape == ref_out.shape and _max_rel_err(out, ref_out) <= tol
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads, strict=True):
        assert r.abs().sum() > 0 and _max_rel_err(g, r) <= tol
    assert torch.equal(after, ref_after)  # the recompute leaves the caller's random stream alone


def _chunked(module, chunk_size, shared=False):
    """The reference: plain autograd over the same chunks, in the same order (split input last)."""
    if shared:
        return lambda features, rois: torch.cat(
            [module(features, rois[s : s + chunk_size]) for s in range(0, N, chunk_size)]
        )
    return lambda x: torch.cat([module(x[s : s + chunk_size]) for s in range(0, N, chunk_size)])


def test_one_chunk_matches_plain_autograd():
    module = _dropblock_and_neck()
    x = torch.randn(N, C, 7, 7, dtype=torch.double, requires_grad=True)
    _assert_same(_run(module, SequentialBackprop(module, N), [x]), _run(module, module, [x]))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunks_replay_the_forward_blocks(chunk_size):
    module = _dropblock_and_neck()
    x = torch.randn(N, C, 7, 7, dtype=torch.double, requires_grad=True)
    ref = _run(module, _chunked(module, chunk_size), [x])
    _assert_same(_run(module, SequentialBackprop(module, chunk_size), [x]), ref)
    with torch.no_grad():
        assert not torch.allclose(ref[0], module.eval()(x)), "DropBlock should change the outputs"


def test_without_rng_replay_the_gradients_differ():
    """Guards the tests above: with preserve_rng_state=False the recompute draws other blocks."""
    module = _dropblock_and_neck()
    x = torch.randn(N, C, 7, 7, dtype=torch.double, requires_grad=True)
    _, ref_grads, _ = _run(module, _chunked(module, 4), [x])
    _, grads, _ = _run(module, SequentialBackprop(module, 4, preserve_rng_state=False), [x])
    assert any(_max_rel_err(g, r) > 1e-3 for g, r in zip(grads, ref_grads, strict=True))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_fused_pooling_dropblock_and_neck_match_plain_autograd(chunk_size):
    fused = _NeckWithPooling(RoIAlign(7, 1 / 16, 0, aligned=True), _dropblock_and_neck())
    g = torch.Generator().manual_seed(2)
    features = torch.randn(2, C, 6, 7, dtype=torch.double, generator=g).requires_grad_(True)
    xy = torch.rand(N, 2, generator=g, dtype=torch.double) * 60
    wh = torch.rand(N, 2, generator=g, dtype=torch.double) * 50 + 4
    rois = torch.cat([torch.randint(0, 2, (N, 1), generator=g).double(), xy, xy + wh], dim=1)
    ref = _run(fused, _chunked(fused, chunk_size, shared=True), [features, rois])
    wrapper = SequentialBackprop(fused, chunk_size, shared_inputs=(0,))
    _assert_same(_run(fused, wrapper, [features, rois]), ref)  # grads[0]: the feature-map gradient


def test_the_scorer_starts_as_the_references_kaiming_normal_fan_out():
    # wetectron cdb.py: kaiming_normal_(mode="fan_out", nonlinearity="relu") on the three convolutions,
    # so std = sqrt(2 / (out_channels * k * k)); norms at scale 1, shift 0.
    torch.manual_seed(0)
    block = ConcreteDropBlock(256, hidden_channels=64)
    conv1, norm1, _, conv2, norm2 = block.scorer
    for conv, fan_out in ((conv1, 64 * 9), (conv2, 2 * 9), (block.shortcut, 2)):
        weight = conv.weight.detach()
        expected = (2 / fan_out) ** 0.5
        tolerance = 4 * expected / (2 * weight.numel()) ** 0.5  # 4 standard errors of a sample std
        assert abs(weight.std().item() - expected) < tolerance, (tuple(weight.shape), weight.std().item())
        assert abs(weight.mean().item()) < 4 * expected / weight.numel() ** 0.5
    for norm in (norm1, norm2):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))
        assert torch.equal(norm.bias, torch.zeros_like(norm.bias))
    # PyTorch's default would give the 1x1 shortcut std 1 / sqrt(3 * 256) = 0.036, not 1: the drop
    # scores would start nearly flat over a ROI's locations.
    x = torch.randn(8, 256, 14, 14)
    scores = block._drop_score(x)  # (8, 1, 14, 14)
    assert scores.std(dim=(2, 3)).min() > 0.5
