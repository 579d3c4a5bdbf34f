"""Sequential batch back-propagation: run a per-sample module on a batch without keeping activations.

A per-ROI neck (ResNet res5) on thousands of ROIs is the memory hog of a WSOD detector: plain autograd
keeps every block's activations for every ROI. ``SequentialBackprop`` instead runs the module chunk by
chunk under ``no_grad`` in the forward pass, keeps only its inputs, and in the backward pass recomputes
one chunk at a time with gradients enabled, back-propagates that chunk's slice of the output gradient and
accumulates the input and parameter gradients. Peak memory is then one chunk's activations, whatever the
batch size; the cost is one extra forward of the module.

Correctness conditions (they follow from recomputation):

* the module must treat samples independently: train-mode BatchNorm mixes samples of a chunk and would
  update its running statistics twice, so it is refused (frozen BN, eval-mode BN and GroupNorm are fine);
* randomness is replayed: each chunk's RNG state is stashed before its forward and restored for its
  recompute, so dropout draws the same masks (the reference is plain autograd over the same chunks, in
  the same order, under the same seed: a whole-batch forward draws different masks);
* the autocast state of the forward is restored in the recompute;
* the module's parameters are explicit inputs of the autograd Function, and their gradients are summed
  over chunks and returned once, so each ``.grad`` is accumulated exactly once per backward, which is what
  DistributedDataParallel's gradient hooks require.

Memory: the recompute runs the module on detached stand-ins of its parameters
(``torch.func.functional_call``), so autograd's own AccumulateGrad sums each layer's gradient into the
stand-in as soon as the layer's backward produces it, as it sums into ``.grad`` under a
``torch.utils.checkpoint`` call per chunk, and the output is written into one buffer chunk by chunk
instead of concatenated. Measured against the stock checkpoint per chunk (docs/BENCHMARKS.md, "wsod against
the stock alternatives"): less memory per extra ROI on CPU and CUDA, a lower constant on CPU, within 4 MB
of it in float32 on an H200, and about 20 MB above it under bf16 autocast, where the stock path sums the
chunks' weight gradients in bf16 and this Function sums them in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.func import functional_call
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = ["SequentialBackprop", "check_per_sample_module"]


def check_per_sample_module(module: nn.Module) -> None:
    """Raise if ``module`` contains train-mode BatchNorm, which recomputation cannot reproduce.

    Train-mode BatchNorm normalises each chunk with that chunk's statistics (so the result depends on
    how the batch is chunked, unlike the per-sample maths the wrapper assumes) and updates its running
    statistics once in the forward and again in every recompute.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            raise ValueError(
                f"SequentialBackprop cannot wrap a module with train-mode BatchNorm ('{name or 'module'}':"
                f" {type(sub).__name__}): batch statistics mix the samples of a chunk and the running"
                " statistics would be updated twice by the recompute. Use FrozenBatchNorm2d, eval-mode"
                " BatchNorm or GroupNorm inside the wrapped module, or chunk_size=None."
            )


class _ChunkPlan:
    """Which inputs are split along dim 0 and which are passed whole to every chunk."""

    def __init__(self, inputs: Sequence[Any], shared: frozenset[int], chunk_size: int) -> None:
        self.shared = shared
        split_sizes = {x.shape[0] for i, x in enumerate(inputs) if isinstance(x, Tensor) and i not in shared}
        if len(split_sizes) != 1:
            raise ValueError(
                "SequentialBackprop needs at least one split tensor input and all split inputs must have"
                f" the same size along dim 0; got sizes {sorted(split_sizes)} (shared inputs:"
                f" {sorted(shared)})"
            )
        self.num_samples = split_sizes.pop()
        self.bounds = [
            (start, min(start + chunk_size, self.num_samples))
            for start in range(0, self.num_samples, chunk_size)
        ]

    def is_split(self, index: int, value: Any) -> bool:
        return isinstance(value, Tensor) and index not in self.shared

    def chunk(self, inputs: Sequence[Any], start: int, end: int) -> list[Any]:
        return [x[start:end] if self.is_split(i, x) else x for i, x in enumerate(inputs)]


def _accumulator_dtype(x: Tensor) -> torch.dtype:
    """float32, or ``x``'s dtype when that is wider (float64)."""
    return torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else x.dtype


def _move_into_sum(sums: dict[int, Tensor], index: int, leaf: Tensor) -> None:
    """Post-accumulate hook of a narrow shared leaf: add the chunk's gradient to ``sums[index]`` (in
    ``_accumulator_dtype``) and release it."""
    if index in sums:
        sums[index] += leaf.grad
    else:
        sums[index] = leaf.grad.to(_accumulator_dtype(leaf))
    leaf.grad = None


def _autocast_state(device_type: str) -> dict[str, Any]:
    return {
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


class _SequentialBackpropFunction(torch.autograd.Function):
    """Chunked forward without graph; chunked recompute-and-backward; parameters as explicit inputs."""

    @staticmethod
    def forward(
        ctx: Any,
        module: nn.Module,
        plan: _ChunkPlan,
        preserve_rng_state: bool,
        param_names: tuple[str, ...],
        num_inputs: int,
        *inputs_and_params: Any,
    ) -> Tensor:
        inputs = inputs_and_params[:num_inputs]
        params = inputs_and_params[num_inputs:]
        tensors = [x for x in inputs if isinstance(x, Tensor)]
        device_type = tensors[0].device.type
        ctx.module, ctx.plan, ctx.num_inputs = module, plan, num_inputs
        ctx.device_type = device_type
        # Autocast is thread-local and backward may run on another thread: restore it explicitly.
        ctx.autocast_kwargs = _autocast_state(device_type)
        ctx.cpu_autocast_kwargs = _autocast_state("cpu")
        ctx.preserve_rng_state = preserve_rng_state
        ctx.rng_states: list[tuple[Tensor, list[int], list[Tensor]]] = []

        # The output is written chunk by chunk into one buffer: a list of chunk outputs concatenated at
        # the end would hold the (N, ...) output twice at once.
        result: Tensor | None = None
        for start, end in plan.bounds:  # grad mode is already off inside Function.forward
            chunk = plan.chunk(inputs, start, end)
            if preserve_rng_state:
                ctx.rng_states.append((torch.get_rng_state(), *get_device_states(*chunk)))
            out = module(*chunk)
            if not isinstance(out, Tensor) or out.shape[0] != end - start:
                raise TypeError(
                    "SequentialBackprop: the wrapped module must return one tensor with one row per"
                    f" sample; got {type(out).__name__}"
                    + (
                        f" of shape {tuple(out.shape)} for {end - start} samples"
                        if isinstance(out, Tensor)
                        else ""
                    )
                )
            if result is None:
                result = out if end == plan.num_samples else out.new_empty((plan.num_samples, *out.shape[1:]))
            if result is not out:
                result[start:end] = out
            del out
        ctx.save_for_backward(*(x if isinstance(x, Tensor) else None for x in inputs))
        ctx.non_tensor_inputs = {i: x for i, x in enumerate(inputs) if not isinstance(x, Tensor)}
        ctx.named_params = tuple(zip(param_names, params, strict=True))
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        plan: _ChunkPlan = ctx.plan
        saved = ctx.saved_tensors
        inputs = [ctx.non_tensor_inputs.get(i, t) for i, t in enumerate(saved)]
        needs_input_grad = ctx.needs_input_grad[5:]  # skip module, plan, preserve_rng_state, names, count
        input_wants_grad = [isinstance(x, Tensor) and needs_input_grad[i] for i, x in enumerate(inputs)]
        param_wants_grad = list(needs_input_grad[ctx.num_inputs :])

        # Every gradient is accumulated by autograd's own AccumulateGrad into a leaf of this backward,
        # layer by layer as the chunk's backward produces it, exactly as a checkpoint per chunk
        # accumulates into ``.grad``: the first chunk's gradient is kept as it is, later ones are added in
        # place and freed at once. (``torch.autograd.grad`` would instead hold every parameter's gradient
        # of a chunk until the chunk's backward ends: one extra copy of the parameters' gradients at the
        # step's peak, 40 MB for ResNet-50's res5; issue 34.) The leaves are detached stand-ins, not the
        # module's parameters, so the parameters' own ``.grad`` and DistributedDataParallel's hooks see
        # exactly one accumulation, when this Function returns the sums.
        # Shared inputs are summed in float32 at least (a bf16 feature map would otherwise lose the low
        # bits of every chunk's contribution to rounding) and cast back once at the end: a narrower leaf
        # hands each chunk's gradient, as autograd accumulated it, to a float32 sum and lets it go (no
        # float32 copy of the input itself). Each chunk of a split input is its own leaf, copied into one
        # full-size buffer.
        stand_ins = {
            name: p.detach().requires_grad_()
            for (name, p), wants in zip(ctx.named_params, param_wants_grad, strict=True)
            if wants
        }
        shared_leaves: dict[int, Tensor] = {}
        wide_sums: dict[int, Tensor] = {}
        input_grads: list[Tensor | None] = [None] * len(inputs)
        for i, (x, wants) in enumerate(zip(inputs, input_wants_grad, strict=True)):
            if not wants:
                continue
            if i in plan.shared:
                shared_leaves[i] = x.detach().requires_grad_()
                if _accumulator_dtype(x) != x.dtype:
                    shared_leaves[i].register_post_accumulate_grad_hook(partial(_move_into_sum, wide_sums, i))
            else:
                input_grads[i] = torch.zeros_like(x)

        for chunk_index, (start, end) in enumerate(plan.bounds):
            leaves: dict[int, Tensor] = {}
            chunk = []
            for i, x in enumerate(inputs):
                if i in shared_leaves:
                    x = leaves[i] = shared_leaves[i]
                elif plan.is_split(i, x):
                    x = x[start:end].detach().requires_grad_(input_wants_grad[i])
                    if input_wants_grad[i]:
                        leaves[i] = x
                chunk.append(x)
            rng = contextlib.nullcontext()
            if ctx.preserve_rng_state:
                cpu_state, devices, device_states = ctx.rng_states[chunk_index]
                rng = torch.random.fork_rng(devices=devices, device_type=ctx.device_type)
            with rng:
                if ctx.preserve_rng_state:
                    torch.set_rng_state(cpu_state)
                    set_device_states(devices, device_states, device_type=ctx.device_type)
                with (
                    torch.enable_grad(),
                    torch.autocast(ctx.device_type, **ctx.autocast_kwargs),
                    torch.autocast("cpu", **ctx.cpu_autocast_kwargs),
                ):
                    out = functional_call(ctx.module, stand_ins, tuple(chunk))
            wrt = list(leaves.values()) + list(stand_ins.values())
            if out.requires_grad and wrt:
                # Back-propagated from the scalar sum(out * g), whose gradient at out is g exactly (its
                # graph saves only g, a view of grad_output), so that the recomputed chunk output is freed
                # before the chunk's backward runs rather than held through it: a checkpoint per chunk
                # does not hold it either (2 MB per 256 ROIs of 2048 float32 features).
                with torch.enable_grad():
                    surrogate = torch.sum(out * grad_output[start:end])
                del out
                torch.autograd.backward(surrogate, inputs=wrt)
                del surrogate
            else:
                del out
            for i, leaf in leaves.items():
                if i not in shared_leaves and leaf.grad is not None:
                    input_grads[i][start:end] = leaf.grad
            del chunk, leaves, wrt

        for i, leaf in shared_leaves.items():
            grad = wide_sums.get(i, leaf.grad)
            input_grads[i] = None if grad is None else grad.to(inputs[i].dtype)
        sums = iter(stand_ins.values())  # one stand-in per parameter that wants a gradient, in order
        param_grads = [next(sums).grad if wants else None for wants in param_wants_grad]
        del stand_ins, shared_leaves  # the sums are referenced by the returned tuple alone
        return (None, None, None, None, None, *input_grads, *param_grads)


class SequentialBackprop(nn.Module):
    """Apply a per-sample ``module`` to a batch in chunks, recomputing it chunk by chunk in backward.

    Args:
        module: maps inputs whose dim 0 indexes samples to one tensor with one row per sample. It must
            treat samples independently (no train-mode BatchNorm; checked at every training call).
        chunk_size: samples per chunk, or ``None`` for plain autograd (the module is simply called).
        inference_chunk_size: samples per chunk when no gradient is needed (``torch.no_grad()``,
            evaluation): the module runs chunk by chunk without a graph, so transient activations stay
            those of one chunk. Default: ``chunk_size``; ``None`` with ``chunk_size=None``: one call.
        shared_inputs: positions of tensor inputs passed whole to every chunk instead of being split,
            e.g. ``(0,)`` for a feature map ``(B, C, H, W)`` shared by per-ROI boxes ``(R, 5)``. Every
            other tensor input is split along dim 0 and all must have the same length N. Non-tensor
            inputs are passed unchanged.
        preserve_rng_state: stash and replay each chunk's RNG state so that dropout inside the module
            draws the same masks in the recompute. Turn off only for deterministic modules.

    Forward: ``inputs`` as the module takes them -> the module's output for all N samples, the chunk
    outputs concatenated along dim 0. When a gradient is needed (grad mode on and a parameter or input
    requires grad) the autograd Function above runs, in training and eval mode alike. When none is
    needed the module runs in chunks of ``inference_chunk_size`` without a graph. N == 0 is one call.
    """

    def __init__(
        self,
        module: nn.Module,
        chunk_size: int | None,
        *,
        inference_chunk_size: int | None = None,
        shared_inputs: Sequence[int] = (),
        preserve_rng_state: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("chunk_size", chunk_size), ("inference_chunk_size", inference_chunk_size)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer or None, got {value}")
        self.module = module
        self.chunk_size = chunk_size
        self.inference_chunk_size = inference_chunk_size or chunk_size
        self.shared_inputs = frozenset(shared_inputs)
        self.preserve_rng_state = preserve_rng_state

    def extra_repr(self) -> str:
        return (
            f"chunk_size={self.chunk_size}, inference_chunk_size={self.inference_chunk_size},"
            f" shared_inputs={sorted(self.shared_inputs)}"
        )

    def needs_grad(self, *inputs: Any) -> bool:
        """Whether a call on ``inputs`` builds a graph: grad mode on and a parameter or input requiring
        grad. Decides between ``chunk_size`` (with the autograd Function) and ``inference_chunk_size``."""
        params = any(p.requires_grad for p in self.module.parameters())
        any_input_grad = any(isinstance(x, Tensor) and x.requires_grad for x in inputs)
        return torch.is_grad_enabled() and (params or any_input_grad)

    def forward(self, *inputs: Any) -> Tensor:
        needs_grad = self.needs_grad(*inputs)
        return self.run(inputs, self.chunk_size if needs_grad else self.inference_chunk_size, needs_grad)

    def run(self, inputs: Sequence[Any], chunk_size: int | None, needs_grad: bool | None = None) -> Tensor:
        """``forward`` with a chunk size chosen by the caller for this call (``None``: one plain call of
        the module), e.g. per step by ``chunk_size="auto"`` (``wsod.modeling.chunking``). With a graph
        (``needs_grad``, computed when not given) chunks are recomputed in backward; without one the
        module runs chunk by chunk under ``no_grad``."""
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")
        if needs_grad is None:
            needs_grad = self.needs_grad(*inputs)
        if chunk_size is None:
            return self.module(*inputs)
        plan = _ChunkPlan(inputs, self.shared_inputs, chunk_size)
        if plan.num_samples == 0 or (not needs_grad and len(plan.bounds) == 1):
            return self.module(*inputs)  # nothing to save; keeps output shape and graph trivially right
        if not needs_grad:
            with torch.no_grad():
                return torch.cat([self.module(*plan.chunk(inputs, start, end)) for start, end in plan.bounds])
        check_per_sample_module(self.module)
        named = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        names, params = tuple(name for name, _ in named), [p for _, p in named]
        return _SequentialBackpropFunction.apply(
            self.module, plan, self.preserve_rng_state, names, len(inputs), *inputs, *params
        )
