"""chunk_size="auto": the policy alone, the per-ROI cost, the budget, and the detector with it (plain
autograd when everything fits, an exact fixed chunk when not, inference, errors)."""

from __future__ import annotations

import gc
import logging
import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from wsod import sequential_backprop
from wsod.modeling import build_detector
from wsod.modeling.chunking import (
    CUDA_MARGIN_MIN_BYTES,
    GIB,
    INFERENCE_FALLBACK_CHUNK,
    MIB,
    AutoChunk,
    resolve_budget,
)

NUM_CLASSES = 3


def _batch(counts=(13, 6), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(len(counts), 3, 64, 96, generator=g).to(dtype)
    proposals = []
    for n in counts:
        xy = torch.rand(n, 2, generator=g) * torch.tensor([80.0, 50.0])
        wh = 4 + torch.rand(n, 2, generator=g) * (torch.tensor([96.0, 64.0]) - xy - 4)
        proposals.append(torch.cat([xy, xy + wh], dim=1).to(dtype))
    labels = torch.tensor([[1, 0, 1], [0, 1, 0]][: len(counts)], dtype=dtype)
    return images, proposals, labels


def _tiny(chunk_size, backbone="resnet18", **options):
    torch.manual_seed(0)
    if backbone == "vgg16":
        options = {"_width": 1 / 16, "pooler": "pool", "roi_size": 7, **options}
    else:
        options = {"width": 0.25, **options}
    return build_detector(backbone, num_classes=NUM_CLASSES, chunk_size=chunk_size, **options)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    losses = model(*batch).losses
    sum(losses.values()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in losses.items()}, grads


def _count_function_calls(monkeypatch) -> list[int]:
    calls = []
    original = sequential_backprop._SequentialBackpropFunction.apply

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(sequential_backprop._SequentialBackpropFunction, "apply", counting)
    return calls


def _saved_bytes_of_a_step(model, batch) -> int:
    """Bytes autograd keeps for backward over a whole training step (storages counted once)."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = model(*batch).losses
    sum(losses.values()).backward()
    return sum(saved.values())


# --- the policy on its own -------------------------------------------------------------------------


def test_the_policy_is_plain_autograd_when_everything_fits_else_the_largest_chunk_that_does():
    policy = AutoChunk(budget_bytes=1000, per_roi_bytes=10)
    assert policy.max_rois == 100
    assert policy.choose(1) is None and policy.choose(100) is None
    assert policy.choose(101) == 100 and policy.choose(5000) == 100
    assert AutoChunk(budget_bytes=5, per_roi_bytes=10).choose(3) == 1  # never below one ROI
    assert AutoChunk(budget_bytes=0, per_roi_bytes=10).choose(3) == 1
    assert AutoChunk(budget_bytes=1, per_roi_bytes=0).choose(10**9) is None
    assert AutoChunk(budget_bytes=1, per_roi_bytes=0).max_rois == math.inf
    with pytest.raises(ValueError, match="budget_bytes >= 0"):
        AutoChunk(budget_bytes=-1, per_roi_bytes=10)


# --- the detector with chunk_size="auto" -------------------------------------------------------------


@pytest.mark.parametrize("fuse_pooling", [True, False], ids=["fused", "paper"])
def test_a_budget_that_fits_everything_is_plain_autograd(monkeypatch, fuse_pooling):
    batch = _batch(dtype=torch.double)
    plain = _tiny(None, fuse_pooling=fuse_pooling).double().train()
    auto = _tiny("auto", fuse_pooling=fuse_pooling, memory_budget_gb=1.0).double().train()
    auto.load_state_dict(plain.state_dict())
    _step(auto, batch)  # the first step measures the per-ROI cost
    calls = _count_function_calls(monkeypatch)
    ref_losses, ref_grads = _step(plain, batch)
    losses, grads = _step(auto, batch)
    assert calls == [] and auto.roi_head.last_chunk is None  # no autograd Function: plain autograd
    assert dict(auto.roi_head.choices) == {"plain": 2}
    assert losses.keys() == ref_losses.keys() and grads.keys() == ref_grads.keys()
    for name in losses:
        assert torch.equal(losses[name], ref_losses[name]), name
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    # The same peak: autograd keeps exactly what it keeps for chunk_size=None.
    assert _saved_bytes_of_a_step(auto, batch) == _saved_bytes_of_a_step(plain, batch)


@pytest.mark.parametrize("fuse_pooling", [True, False], ids=["fused", "paper"])
def test_a_tight_budget_chunks_exactly_like_the_fixed_chunk_it_picks(monkeypatch, fuse_pooling):
    batch = _batch(dtype=torch.double)
    probe = _tiny("auto", fuse_pooling=fuse_pooling, memory_budget_gb=1.0).double().train()
    _step(probe, batch)
    per_roi = next(iter(probe.roi_head.costs.values())).per_roi
    budget_gb = 5.5 * per_roi / GIB  # room for 5 ROIs of the 19
    auto = _tiny("auto", fuse_pooling=fuse_pooling, memory_budget_gb=budget_gb).double().train()
    fixed = _tiny(5, fuse_pooling=fuse_pooling).double().train()
    fixed.load_state_dict(auto.state_dict())
    calls = _count_function_calls(monkeypatch)
    losses, grads = _step(auto, batch)
    assert auto.roi_head.last_chunk == 5 and len(calls) == 1 and dict(auto.roi_head.choices) == {"chunk 5": 1}
    assert 5 * per_roi <= budget_gb * GIB < 6 * per_roi
    ref_losses, ref_grads = _step(fixed, batch)
    for name in losses:
        assert torch.equal(losses[name], ref_losses[name]), name
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_the_cost_probe_draws_nothing_from_the_rng_so_dropout_masks_stay_those_of_plain_autograd():
    # VGG16's neck has dropout: a probe that consumed random numbers would change every later mask.
    batch = _batch()
    plain = _tiny(None, backbone="vgg16").train()
    auto = _tiny("auto", backbone="vgg16", memory_budget_gb=1.0).train()
    auto.load_state_dict(plain.state_dict())
    torch.manual_seed(7)
    ref_losses, ref_grads = _step(plain, batch)
    torch.manual_seed(7)
    losses, grads = _step(auto, batch)  # measures the cost first, then runs plain autograd
    assert auto.roi_head.costs and auto.roi_head.last_chunk is None
    for name in losses:
        assert torch.equal(losses[name], ref_losses[name]), name
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors alive at once among those the ops inside it create."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key):
        self.current -= self.live.pop(key, 0)


def test_the_per_roi_cost_bounds_the_live_memory_of_forward_and_backward():
    # Independent check of the estimate: every tensor the body's forward and backward create, alive at
    # once, per extra ROI (kernels' internal buffers are not seen here; docs/BENCHMARKS.md has the
    # resident-memory check).
    model = _tiny("auto", memory_budget_gb=1.0).train()
    body = model.roi_head.body.module
    features = torch.randn(1, 64, 16, 24, requires_grad=True)

    def peak(n):
        g = torch.Generator().manual_seed(n)
        xy = torch.rand(n, 2, generator=g) * 200
        rois = torch.cat([torch.zeros(n, 1), xy, xy + 100], dim=1)
        with _LiveBytes() as mode:
            body(features, rois).sum().backward()
        return mode.peak

    policy = model.roi_head.policy((features, torch.tensor([[0, 0, 0, 50, 50.0]])))
    slope = (peak(48) - peak(16)) / 32
    assert 0.5 * policy.per_roi_bytes <= slope <= policy.per_roi_bytes


def test_inference_uses_the_test_chunk_the_auto_chunk_or_the_cpu_fallback(caplog, monkeypatch):
    batch = _batch()
    plain = _tiny(None).eval()
    with torch.no_grad():
        expected = plain(*batch[:2])
    calls = []
    original = sequential_backprop.SequentialBackprop.run

    def recording(self, inputs, chunk_size, needs_grad=None):
        calls.append(chunk_size)
        return original(self, inputs, chunk_size, needs_grad)

    monkeypatch.setattr(sequential_backprop.SequentialBackprop, "run", recording)
    for options, chunk in [
        ({"test_chunk_size": 7}, 7),
        ({"memory_budget_gb": 1.0}, None),  # everything fits: one pass
        ({}, INFERENCE_FALLBACK_CHUNK),  # CPU without a budget: no error at inference
    ]:
        model = _tiny("auto", **options).eval()
        model.load_state_dict(plain.state_dict())
        calls.clear()
        with caplog.at_level(logging.INFO, logger="wsod"), torch.no_grad():
            detections = model(*batch[:2])
        assert calls == [chunk], options
        for got, ref in zip(detections, expected, strict=True):
            assert torch.allclose(got["scores"], ref["scores"], atol=1e-5)
    assert f"inference in chunks of {INFERENCE_FALLBACK_CHUNK} ROIs" in caplog.text


def test_training_on_cpu_without_a_budget_names_the_setting():
    model = _tiny("auto").train()
    with pytest.raises(ValueError, match="model.memory_budget_gb"):
        model(*_batch())


def test_the_choice_and_the_measurement_are_logged(caplog):
    model = _tiny("auto", memory_budget_gb=1.0).train()
    with caplog.at_level(logging.INFO, logger="wsod"):
        _step(model, _batch())
    text = caplog.text
    assert "budget 1.000 GB (memory_budget_gb=1)" in text
    assert "MB per ROI in float32 (saved activations" in text and "plain autograd up to" in text
    assert "19 ROIs need" in text and ": plain autograd" in text


def test_a_budget_below_one_rois_cost_is_warned_about_naming_the_setting(caplog):
    model = _tiny("auto", memory_budget_gb=1e-9).train()  # about 1 KB: less than one ROI of this neck
    with caplog.at_level(logging.INFO, logger="wsod"):
        _step(model, _batch())
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "is smaller than one ROI's cost" in warning.getMessage()
    assert (
        "chunks of 1 ROI" in warning.getMessage()
        and "model.memory_budget_gb more than" in warning.getMessage()
    )
    assert model.roi_head.last_chunk == 1

    caplog.clear()
    fits = _tiny("auto", memory_budget_gb=1.0).train()
    with caplog.at_level(logging.INFO, logger="wsod"):
        _step(fits, _batch())
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    "options,message",
    [
        ({"chunk_size": "big"}, "chunk_size must be a positive integer, None or 'auto'"),
        ({"chunk_size": 64, "memory_budget_gb": 2.0}, "used only with chunk_size='auto'"),
        ({"chunk_size": "auto", "memory_budget_gb": 0}, "memory_budget_gb must be a number > 0"),
    ],
)
def test_bad_settings_are_refused_at_build_time(options, message):
    with pytest.raises(ValueError, match=message):
        build_detector("resnet18", num_classes=3, width=0.25, **options)


def test_train_mode_batchnorm_in_the_neck_is_refused_before_any_probe():
    model = _tiny("auto", neck_norm="bn", memory_budget_gb=1.0).train()
    with pytest.raises(ValueError, match="train-mode BatchNorm"):
        model(*_batch())


# --- the budget ------------------------------------------------------------------------------------


def _fake_cuda(monkeypatch, free, total, allocated, reserved, fraction=None):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: reserved)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: fraction or 1.0)


def test_the_cuda_budget_is_the_allocators_available_memory_less_the_margin(monkeypatch):
    # No GPU here: torch.cuda is mocked. 40 GB free + 2 GB cached unused = 42 GB; margin 25 % = 10.5 GB.
    _fake_cuda(monkeypatch, free=40 * GIB, total=80 * GIB, allocated=6 * GIB, reserved=8 * GIB)
    budget = resolve_budget(None, torch.device("cuda", 0))
    assert budget.bytes == pytest.approx(42 * GIB * 0.75)
    assert "42.00 GB available" in budget.source and "margin of 10.50 GB" in budget.source
    # A small card: the margin is at least 2 GB.
    _fake_cuda(monkeypatch, free=5 * GIB, total=8 * GIB, allocated=0, reserved=0)
    assert resolve_budget(None, torch.device("cuda", 0)).bytes == pytest.approx(
        5 * GIB - CUDA_MARGIN_MIN_BYTES
    )
    # The allocator capped by set_per_process_memory_fraction (as the ROI benchmark does): 16 of 80 GB.
    _fake_cuda(monkeypatch, free=70 * GIB, total=80 * GIB, allocated=2 * GIB, reserved=2 * GIB, fraction=0.2)
    capped = resolve_budget(None, torch.device("cuda", 0))
    assert (
        capped.bytes == pytest.approx(14 * GIB - 3.5 * GIB) and "per-process memory fraction" in capped.source
    )
    # An explicit budget wins on any device; CPU has none by itself.
    assert resolve_budget(3, torch.device("cuda", 0)).bytes == 3 * GIB
    assert resolve_budget(0.5, torch.device("cpu")).bytes == 0.5 * GIB
    assert resolve_budget(None, torch.device("cpu")) is None


def test_costs_are_measured_once_per_precision():
    model = _tiny("auto", memory_budget_gb=1.0).train()
    batch = _batch()
    _step(model, batch)
    _step(model, batch)
    assert list(model.roi_head.costs) == ["float32"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(*batch)
    costs = model.roi_head.costs
    assert list(costs) == ["float32", "bfloat16"]
    assert costs["bfloat16"].saved < costs["float32"].saved
    assert all(c.per_roi > 0.01 * MIB for c in costs.values())


def test_the_cost_probe_keeps_nothing_alive():
    # A saved output packed as itself would hold its own grad_fn: a cycle through C++ autograd nodes that
    # no garbage collection frees (33 MB per measurement for ResNet-50 on 4 + 8 ROIs).
    model = _tiny("auto", memory_budget_gb=1.0).train()
    body = model.roi_head.body.module
    outputs = []
    for module in body.modules():
        if isinstance(module, torch.nn.ReLU):  # ReLU saves its output
            module.register_forward_hook(lambda m, i, out: outputs.append(weakref.ref(out)))
    features = torch.randn(1, 64, 16, 24, requires_grad=True)
    model.roi_head.policy((features, torch.tensor([[0, 0, 0, 50, 50.0]])))
    gc.collect()
    assert outputs and all(ref() is None for ref in outputs)
