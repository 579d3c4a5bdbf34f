"""The adversarial Concrete DropBlock step: it ascends the detector's loss with the DropBlock parameters
alone, leaves everything else as it was, and keeps the DropBlock identical on every process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wsod.engine.adversarial import DropBlockAdversary
from wsod.engine.solver import build_optimizer, build_scheduler
from wsod.modeling import build_detector

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from test_detector import _batch  # noqa: E402


def _detector(seed: int = 0):
    torch.manual_seed(seed)
    model = build_detector("resnet18", num_classes=3, chunk_size=4, width=0.25, dropblock=True)
    with torch.no_grad():  # sharper heads than N(0, 0.001): the loss depends on what is dropped
        for name, p in model.named_parameters():
            if name.startswith(("mil_head", "students")) and name.endswith("weight"):
                p.normal_(std=0.05)
    return model


def _adversary(model, lr=0.5, weight=0.01):
    optimizer = build_optimizer(
        model.dropblock, name="sgd", lr=lr, momentum=0.0, weight_decay=0.0, bias_lr_factor=1.0
    )
    return DropBlockAdversary(model, optimizer, build_scheduler(optimizer, milestones=[]), weight=weight)


def _inputs(counts=(13, 6), labels=((1, 0, 1), (0, 1, 0))):
    images, proposals, image_labels = _batch(counts=counts, labels=labels)
    return {"images": images, "proposals": proposals, "image_labels": image_labels}


def test_the_update_ascends_the_detector_loss_with_the_dropblock_parameters_alone():
    model = _detector()
    adversary = _adversary(model, lr=0.5, weight=0.01)
    inputs = _inputs()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    # The loss's gradient for the DropBlock parameters at the samples the step will draw.
    torch.manual_seed(7)
    loss = sum(model(**inputs).losses.values())
    params = list(model.dropblock.parameters())
    gradient = torch.autograd.grad(loss, params, allow_unused=True)
    model.zero_grad(set_to_none=True)

    torch.manual_seed(7)
    reported = adversary.step([inputs])
    assert reported == pytest.approx(loss.item(), rel=1e-6)
    moved = 0.0
    for p, g, (name, start) in zip(
        params,
        gradient,
        [(n, before[n]) for n, q in model.named_parameters() if any(q is x for x in params)],
        strict=True,
    ):
        step = p.detach() - start
        expected = torch.zeros_like(p) if g is None else 0.5 * 0.01 * g  # + lr x weight x dL/dtheta
        # float32 rounding of p + step: atol is a few ulps of the parameters (weights near 1)
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=2e-7, msg=name)
        moved += float((step * (g if g is not None else 0)).sum())
    assert moved > 0  # a step along the loss's gradient: the loss-increasing direction
    # Nothing else moved, nothing else got a gradient, and every requires_grad flag is back.
    dropblock_names = {n for n, q in model.named_parameters() if any(q is x for x in params)}
    for name, p in model.named_parameters():
        assert p.requires_grad == flags[name], name
        if name not in dropblock_names:
            assert torch.equal(p, before[name]) and p.grad is None, name


def test_a_non_finite_pass_is_skipped_without_changing_the_dropblock():
    model = _detector()
    adversary = _adversary(model)
    inputs = _inputs()
    inputs["images"] = inputs["images"] * float("nan")
    before = [p.detach().clone() for p in model.dropblock.parameters()]
    assert torch.isnan(torch.tensor(adversary.step([inputs])))
    assert adversary.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(model.dropblock.parameters(), before, strict=True))


def _distributed_worker(rank: int, world: int, folder: str, single_pass: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        model = _detector(seed=0)  # the same weights on every process, as DDP makes them
        adversary = _adversary(model, lr=5.0, weight=1.0)
        torch.manual_seed(100 + rank)  # each process its own samples and its own images
        counts, labels = ((9, 5), ((1, 0, 1), (0, 1, 0))) if rank == 0 else ((6, 11), ((0, 1, 1), (1, 0, 0)))
        if single_pass:
            # The detector's backward without DDP: each process's DropBlock gradient is its own, so
            # only the adversary's averaging can make the update the same everywhere.
            sum(model(**_inputs(counts, labels)).losses.values()).backward()
            assert adversary.step_from_detector_gradients()
        else:
            adversary.step([_inputs(counts, labels)])
        flat = torch.cat([p.detach().flatten() for p in model.dropblock.parameters()])
        torch.save(flat, f"{folder}/dropblock_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("single_pass", [False, True], ids=["two_pass", "single_pass"])
def test_the_dropblock_stays_identical_on_every_process(tmp_path, single_pass):
    mp.spawn(_distributed_worker, args=(2, str(tmp_path), single_pass), nprocs=2, join=True)
    first, second = (torch.load(tmp_path / f"dropblock_{rank}.pt") for rank in range(2))
    initial = torch.cat([p.detach().flatten() for p in _detector(seed=0).dropblock.parameters()])
    assert torch.equal(first, second)  # gradients averaged over processes: one update everywhere
    assert not torch.equal(first, initial)


@pytest.mark.parametrize("fuse_pooling", [True, False], ids=["fused", "paper"])
def test_one_chunk_with_dropblock_equals_plain_autograd_in_float64(fuse_pooling):
    batch = _batch(torch.double)
    grads = []
    for chunk_size in (None, 1000):  # 1000 >= every ROI of the batch: one chunk
        torch.manual_seed(0)
        model = build_detector(
            "resnet18",
            num_classes=3,
            chunk_size=chunk_size,
            width=0.25,
            dropblock=True,
            fuse_pooling=fuse_pooling,
        ).double()
        torch.manual_seed(5)
        losses = model(*batch).losses
        sum(losses.values()).backward()
        grads.append(
            (
                {k: v.item() for k, v in losses.items()},
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (plain_losses, plain), (seq_losses, seq) = grads
    assert plain_losses == pytest.approx(seq_losses, rel=1e-12)
    assert plain.keys() == seq.keys() and any("dropblock" in n for n in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(seq[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_accumulated_batches_give_the_mean_of_their_gradients():
    # With gradient accumulation the adversary sees every batch of the step and averages, as the 8-GPU
    # step averages over GPUs.
    batches = [_inputs((13, 6)), _inputs((7, 9), ((0, 1, 1), (1, 0, 0)))]
    steps = []
    for chosen in ([0], [1], [0, 1]):
        model = _detector()
        before = [p.detach().clone() for p in model.dropblock.parameters()]
        adversary = _adversary(model, lr=0.5, weight=0.01)
        torch.manual_seed(11)
        for index in range(chosen[0]):  # the same samples for batch 1 alone as after batch 0
            _ = model(**batches[index])
        adversary.step([batches[i] for i in chosen])
        steps.append([p.detach() - b for p, b in zip(model.dropblock.parameters(), before, strict=True)])
    for alone_0, alone_1, together in zip(*steps, strict=True):
        torch.testing.assert_close(together, (alone_0 + alone_1) / 2, rtol=1e-4, atol=2e-7)


def test_single_pass_gives_the_scorer_the_negated_scaled_gradient_of_the_first_forwards_loss():
    # float64, one step: the single-pass update from the detector's own backward equals the two-pass
    # update whose forward draws the same masks (the same RNG state) on the same, not yet updated model.
    steps = {}
    for mode in ("reference", "single", "two"):
        model = _detector().double()
        params = list(model.dropblock.parameters())
        before = [p.detach().clone() for p in params]
        inputs = _inputs()
        inputs["images"] = inputs["images"].double()
        inputs["proposals"] = [boxes.double() for boxes in inputs["proposals"]]
        torch.manual_seed(7)
        if mode == "reference":  # plain autograd of the detector's total loss
            loss = sum(model(**inputs).losses.values())
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            steps[mode] = [
                0.01 * (torch.zeros_like(p) if g is None else g) for p, g in zip(params, grads, strict=True)
            ]
            continue
        optimizer = build_optimizer(
            model.dropblock, name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0, bias_lr_factor=1.0
        )
        adversary = DropBlockAdversary(
            model,
            optimizer,
            build_scheduler(optimizer, milestones=[]),
            weight=0.01,
            single_pass=mode == "single",
        )
        assert adversary.needs_inputs == (mode == "two")
        if mode == "single":
            sum(
                model(**inputs).losses.values()
            ).backward()  # the training loop's backward of the detector's loss
            assert adversary.after_step([]) == {}
        else:
            assert "adversarial_loss" in adversary.after_step([inputs])
        steps[mode] = [p.detach() - b for p, b in zip(params, before, strict=True)]
        assert all(p.grad is None for p in params)  # nothing left for the next step
    assert any(s.abs().max() > 0 for s in steps["reference"])
    for single, two, reference in zip(steps["single"], steps["two"], steps["reference"], strict=True):
        torch.testing.assert_close(single, reference, rtol=1e-10, atol=1e-15)  # lr 1: +0.01 x dL/dtheta
        torch.testing.assert_close(two, reference, rtol=1e-10, atol=1e-15)


def test_single_pass_drops_the_detectors_gradients_on_a_skipped_step_and_refuses_fp16():
    model = _detector()
    optimizer = build_optimizer(model.dropblock, name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0)
    adversary = DropBlockAdversary(
        model, optimizer, build_scheduler(optimizer, milestones=[]), single_pass=True
    )
    sum(model(**_inputs()).losses.values()).backward()
    params = list(model.dropblock.parameters())
    before = [p.detach().clone() for p in params]
    adversary.skip()
    assert all(p.grad is None for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    with torch.no_grad():
        params[0].grad = torch.full_like(params[0], float("nan"))
    adversary.after_step([])
    assert adversary.skipped_steps == 1 and all(
        torch.equal(p, b) for p, b in zip(params, before, strict=True)
    )
    with pytest.raises(ValueError, match="fp16"):
        DropBlockAdversary(
            model, optimizer, build_scheduler(optimizer, milestones=[]), single_pass=True, amp="fp16"
        )
