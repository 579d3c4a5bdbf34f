"""GradNorm loss balancing (Chen et al., ICML 2018) measured at the (R, D) ROI features.

GradNorm learns one weight per loss so that the losses' gradient norms at a shared layer stay equal,
scaled by how fast each loss is falling. The usual implementation runs the full backward with
``retain_graph=True`` and then one backward per loss, keeping the whole graph (here: the
sequentially back-propagated neck and the base network) alive. This one takes the per-loss gradients
at the shared ROI features *before* the full backward. A gradient there only goes back through the
small heads, never into the neck (SequentialBackprop does not recompute anything for it), and the
single backward of the weighted total afterwards needs no ``retain_graph``, so the big graph is freed
as that backward goes.

One optimizer step::

    optimizer.zero_grad()
    losses = detector.losses(roi_features, proposals, labels)   # roi_features (R, D) need grad
    total = gradnorm.balance(losses, roi_features)               # fills gradnorm.weights.grad
    total.backward()                                             # one backward, no retain_graph
    optimizer.step()                                             # gradnorm.parameters() included
    gradnorm.renormalize()                                       # weights sum to num_losses again

Per call, with L_i the losses, w_i the weights, L_i(0) the losses at the first call and S the shared
tensor:

* G_i = || d(w_i L_i) / dS ||_2;
* r_i = (L_i / L_i(0)) / mean_j (L_j / L_j(0)); target_i = mean_j(G_j) * r_i ** alpha (a constant);
  the rates may read other values than the losses themselves (``rate_values``: a student's loss divided
  by its mean pseudo-label weight), and L_i(0) may be the mean of those values over a window of calls
  before the first balance (``observe``, then ``record_baseline``) instead of the first call's;
* L_grad = sum_i |G_i - target_i|; ``weights.grad`` is set to dL_grad/dw (the model gets nothing
  from L_grad, as in the paper);
* the returned total is sum_i w_i L_i with the weights detached: its backward gives the model its
  gradient and leaves ``weights.grad`` alone.
* ``renormalize()`` after the optimizer step clamps each weight to ``min_weight`` (wsod's addition:
  the published rule lets a weight turn negative and then maximise its loss) and rescales the weights
  to sum to N.

In distributed training each rank's weight gradient comes from its own batch; averaging it across ranks
(and over accumulated batches) is the caller's: in training, ``wsod.engine.balancing.LossBalancer``, the
loop's companion that owns GradNorm's optimizer (``solver.gradnorm``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["GradNorm"]


class GradNorm(nn.Module):
    """Learnable loss weights balanced by GradNorm at a shared tensor.

    Args:
        num_losses: number of loss terms N.
        alpha: GradNorm's asymmetry: 0 equalises the gradient norms; larger values push losses that
            fall slower (relative to their first value) to larger gradient norms.
        min_weight: floor of every weight, applied by ``renormalize()`` before the rescale (0 <=
            min_weight <= 1, or None for no floor: GradNorm as published). GradNorm's gradient does
            not keep a weight positive: with G_i = |w_i| g_i, once a weight crosses zero,
            |G_i - target_i| is minimised at w_i = -target_i / g_i, and the weight runs away on the
            negative side, where it *maximises* its loss. A toy run did exactly that (docs/RESULTS.md); the
            floor keeps every loss minimised.

    Attributes:
        weights: parameter (N,), initialised to 1; optimise it with the model, then ``renormalize()``.
        initial_losses: buffer (N,), L_i(0): the rate values at the first ``balance`` call, or their
            window mean (``record_baseline``); NaN until then. It is in ``state_dict()``, so a GradNorm
            restored from a checkpoint keeps the recorded values.
        baseline_sum, baseline_count: buffers (N,), what ``observe`` gathered for ``record_baseline``
            (finite positive values only); in ``state_dict()`` too, so a run stopped inside the window
            resumes with it.
        last_norms: (N,) G_i of the last call, detached (for logging).
        last_ratios: (N,) r_i of the last call.
        last_targets: (N,) target_i of the last call.
        last_grad_loss: scalar L_grad of the last call.
        last_names: the loss names of the last call when a mapping was given, else ``None``.
    """

    initial_losses: Tensor

    def __init__(self, num_losses: int, alpha: float = 1.5, min_weight: float | None = 0.01) -> None:
        super().__init__()
        if num_losses < 1:
            raise ValueError(f"GradNorm needs at least one loss, got num_losses={num_losses}")
        if min_weight is not None and not 0 <= min_weight <= 1:
            raise ValueError(f"GradNorm: min_weight must lie in [0, 1] or be None, got {min_weight}")
        self.num_losses = num_losses
        self.alpha = float(alpha)
        self.min_weight = None if min_weight is None else float(min_weight)
        self.weights = nn.Parameter(torch.ones(num_losses))
        # NaN marks "not recorded yet"; a persistent buffer so that checkpoints carry it.
        self.register_buffer("initial_losses", torch.full((num_losses,), float("nan")))
        self.register_buffer("baseline_sum", torch.zeros(num_losses, dtype=torch.float64))
        self.register_buffer("baseline_count", torch.zeros(num_losses, dtype=torch.float64))
        self.last_norms: Tensor | None = None
        self.last_ratios: Tensor | None = None
        self.last_targets: Tensor | None = None
        self.last_grad_loss: Tensor | None = None
        self.last_names: tuple[str, ...] | None = None

    def extra_repr(self) -> str:
        return f"num_losses={self.num_losses}, alpha={self.alpha}, min_weight={self.min_weight}"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001
        # A state saved before the baseline window existed has no window buffers: an empty window.
        for name in ("baseline_sum", "baseline_count"):
            state_dict.setdefault(prefix + name, torch.zeros_like(getattr(self, name)))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def initialized(self) -> bool:
        """Whether the initial losses have been recorded (by a call or by ``load_state_dict``)."""
        return not bool(torch.isnan(self.initial_losses).any())

    @torch.no_grad()
    def observe(self, rate_values: Tensor) -> None:
        """Add one call's rate values (N,) to the window that ``record_baseline`` turns into L_i(0);
        non-finite and non-positive values are left out (a box loss of 0 on a batch without
        foreground)."""
        values = rate_values.detach().to(self.baseline_sum)
        if values.shape != (self.num_losses,):
            raise ValueError(
                f"GradNorm.observe: expected {self.num_losses} values, got {tuple(values.shape)}"
            )
        usable = torch.isfinite(values) & (values > 0)
        self.baseline_sum += torch.where(usable, values, torch.zeros_like(values))
        self.baseline_count += usable.to(self.baseline_count)

    @torch.no_grad()
    def record_baseline(self) -> None:
        """L_i(0) = the mean of the observed values, for each loss not recorded yet that was observed
        at least once (the others are recorded at their first usable ``balance`` call, as without a
        window)."""
        seen = torch.isnan(self.initial_losses) & (self.baseline_count > 0)
        mean = self.baseline_sum / self.baseline_count.clamp_min(1)
        self.initial_losses.copy_(torch.where(seen, mean.to(self.initial_losses), self.initial_losses))

    def balance(
        self,
        losses: Sequence[Tensor] | Mapping[str, Tensor],
        shared: Tensor,
        rate_values: Sequence[Tensor] | None = None,
    ) -> Tensor:
        """Set ``weights.grad`` to GradNorm's gradient; return the weighted total for one backward.

        Args:
            losses: N scalar losses (a sequence, or a mapping whose iteration order gives the weight
                order and must not change between calls), each part of a graph that runs through
                ``shared`` and still has its buffers (no backward has run on it yet).
            shared: the shared tensor, e.g. ROI features (R, D); any shape. Must require grad.
            rate_values: N scalars the rates r_i are computed from instead of the losses (detached;
                the same kind of value ``observe`` saw); None: the losses.

        Returns:
            scalar sum_i w_i L_i with the weights detached, ready for one ``backward()`` without
            ``retain_graph``.

        A loss that does not depend on ``shared`` (or needs no gradient at all) has G_i = 0: its weight
        gets no gradient from L_grad (it only moves with ``renormalize()``) and its 0 still counts in
        mean_j G_j. Each loss's L_i(0) is recorded at the first call where it is finite and positive
        (r_i divides by it): a box loss is zero on a batch without foreground ROIs, e.g. VOC images
        whose objects are all difficult. Until then its relative rate L_i / L_i(0) counts as 1.
        """
        names, values = self._unpack(losses)
        if not isinstance(shared, Tensor) or not shared.requires_grad:
            raise ValueError(
                "GradNorm.balance: `shared` must be a tensor that requires grad (the ROI features of a"
                " training forward, computed with grad mode on); got one that does not"
            )
        if rate_values is None:
            rates_from = [loss.detach() for loss in values]
        elif len(rate_values) != self.num_losses:
            raise ValueError(
                f"GradNorm.balance: expected {self.num_losses} rate values, got {len(rate_values)}"
            )
        else:
            rates_from = [torch.as_tensor(v).detach() for v in rate_values]
        if not self.initialized:
            self._record_initial_losses(rates_from)

        # The norms: ||d(w_i L_i)/dS|| = |w_i| * ||dL_i/dS||, since w_i is not in L_i's graph. Taking
        # dL_i/dS without create_graph is exact for the weight gradient and keeps no double-backward graph
        # of the heads, and each (R, D) gradient is reduced to one scalar and freed at once, so the extra
        # memory is one (R, D) gradient plus the heads' backward transients. The model gets nothing from
        # L_grad (as in the paper), so a gradient of the norms w.r.t. the heads is never needed.
        # retain_graph=True keeps the heads' buffers for the final backward; the big graph below `shared`
        # is not traversed at all.
        unit_norms = torch.stack(
            [self._unit_norm(loss, shared).to(self.weights.dtype) for loss in values]
        ).to(self.weights.device)
        loss_values = torch.stack([v.to(self.initial_losses) for v in rates_from])
        with torch.enable_grad():
            norms = self.weights.abs() * unit_norms  # G_i, differentiable w.r.t. w_i
            recorded = ~torch.isnan(self.initial_losses)
            relative = torch.where(recorded, loss_values / self.initial_losses, torch.ones_like(loss_values))
            # All losses at zero would make the mean zero; a tiny floor gives r = 0 instead of NaN.
            ratios = relative / relative.mean().clamp_min(torch.finfo(relative.dtype).tiny)
            targets = norms.detach().mean() * ratios.to(norms.dtype) ** self.alpha
            grad_loss = (norms - targets).abs().sum()
            (weight_grad,) = torch.autograd.grad(grad_loss, self.weights)
        self.weights.grad = weight_grad  # replaces: the total's backward below adds nothing to it

        self.last_names = names
        self.last_norms = norms.detach()
        self.last_ratios = ratios
        self.last_targets = targets
        self.last_grad_loss = grad_loss.detach()
        weights = self.weights.detach()
        return sum((w * loss for w, loss in zip(weights, values, strict=True)), values[0].new_zeros(()))

    @torch.no_grad()
    def renormalize(self) -> None:
        """Clamp the weights in place to at least ``min_weight``, then rescale them to sum to
        ``num_losses``; call after the optimizer step. (A weight clamped to the floor can end just
        below it when the rescale shrinks all weights; it stays positive.)"""
        if self.min_weight is not None:
            self.weights.clamp_(min=self.min_weight)
        total = self.weights.sum()
        if not bool(torch.isfinite(total)) or total.item() <= 0:
            raise ValueError(
                f"GradNorm.renormalize: the weights sum to {total.item()}, cannot rescale them to"
                f" {self.num_losses}; the learning rate of the weights is probably too large"
            )
        self.weights.mul_(self.num_losses / total)

    def _unpack(
        self, losses: Sequence[Tensor] | Mapping[str, Tensor]
    ) -> tuple[tuple[str, ...] | None, list[Tensor]]:
        if isinstance(losses, Mapping):
            names: tuple[str, ...] | None = tuple(losses)
            values = list(losses.values())
            if self.last_names is not None and names != self.last_names:
                raise ValueError(
                    f"GradNorm.balance: loss names {names} differ from the previous call's"
                    f" {self.last_names}; each weight belongs to one loss, in a fixed order"
                )
        else:
            names, values = None, list(losses)
        if len(values) != self.num_losses:
            raise ValueError(f"GradNorm.balance: expected {self.num_losses} losses, got {len(values)}")
        for i, loss in enumerate(values):
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(
                    f"GradNorm.balance: loss {self._label(names, i)} must be a scalar, got {shape}"
                )
        return names, values

    def _record_initial_losses(self, values: list[Tensor]) -> None:
        """Record L_i(0) for each loss not recorded yet whose value is finite and positive."""
        current = torch.stack([loss.detach().to(self.initial_losses) for loss in values])
        usable = torch.isnan(self.initial_losses) & torch.isfinite(current) & (current > 0)
        self.initial_losses.copy_(torch.where(usable, current, self.initial_losses))

    @staticmethod
    def _unit_norm(loss: Tensor, shared: Tensor) -> Tensor:
        """||dL/dS||_2 as a detached scalar; 0 when L does not depend on S."""
        if not loss.requires_grad:
            return shared.new_zeros((), dtype=torch.promote_types(shared.dtype, torch.float32))
        (grad,) = torch.autograd.grad(loss, shared, retain_graph=True, allow_unused=True)
        if grad is None:
            return shared.new_zeros((), dtype=torch.promote_types(shared.dtype, torch.float32))
        # The norm in float32 at least: a bf16 (R, D) gradient would otherwise be summed in bf16.
        return torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32))

    @staticmethod
    def _label(names: tuple[str, ...] | None, index: int) -> str:
        return f"'{names[index]}'" if names is not None else str(index)
