"""GradNorm in the training loop: learned loss weights, their own optimizer, accumulation and processes.

Per optimizer step with ``accumulation`` batches (see ``wsod.engine.gradnorm`` for one balance call), at
the points where the loop calls a ``Companion`` (``wsod.engine.companion``):

* each batch, ``combine(losses, roi_features)`` (``weighted_total``): measures the per-loss gradient norms
  at the ROI features (the heads only), keeps GradNorm's weight gradient, and returns the weighted total
  (weights detached) for the loop's one backward;
* after the detector's update, ``after_step`` (``step()``): averages the weight gradients over the
  accumulated batches and over processes (so the weights stay identical everywhere), updates the weights
  with their own optimizer, renormalises them to sum to the number of losses, and logs them;
* a skipped step, ``skip()`` (``discard()``): the kept weight gradients are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from wsod.distributed import all_reduce_mean
from wsod.engine.companion import Companion
from wsod.engine.gradnorm import GradNorm
from wsod.engine.solver import load_optimizer_state

__all__ = ["LossBalancer"]


class LossBalancer(Companion):
    """``GradNorm(num_losses, alpha, min_weight)`` with an Adam optimizer (learning rate ``lr``) for
    its weights; a training-loop ``Companion`` that combines the losses.

    The loss names are fixed by the first call (a detector's losses always come in the same order).
    """

    name = "balancer"
    combines_losses = True

    def __init__(
        self, num_losses: int, *, alpha: float = 1.5, lr: float = 0.01, min_weight: float = 0.01
    ) -> None:
        self.gradnorm = GradNorm(num_losses, alpha=alpha, min_weight=min_weight)
        # Adam: the weight gradient's scale is that of the gradient norms at the ROI features, which
        # differs by orders of magnitude between models; Adam's step does not depend on it.
        self.optimizer = torch.optim.Adam(self.gradnorm.parameters(), lr=lr)
        self._grads: list[Tensor] = []

    def to(self, device: torch.device) -> LossBalancer:
        self.gradnorm.to(device)
        return self

    def weighted_total(self, losses: dict[str, Tensor], roi_features: Tensor) -> Tensor:
        """The weighted total of ``losses`` for one backward; GradNorm's weight gradient is kept."""
        total = self.gradnorm.balance(losses, roi_features)
        self._grads.append(self.gradnorm.weights.grad.detach().clone())
        self.gradnorm.weights.grad = None
        return total

    def step(self) -> None:
        """Average the kept weight gradients (batches, then processes), update and renormalise."""
        if not self._grads:
            return
        self.gradnorm.weights.grad = all_reduce_mean(torch.stack(self._grads).mean(dim=0))
        self._grads.clear()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.gradnorm.renormalize()

    def discard(self) -> None:
        """Forget the kept weight gradients (the step was skipped: a loss was not finite)."""
        self._grads.clear()

    def combine(self, losses: dict[str, Tensor], roi_features: Tensor) -> Tensor:
        return self.weighted_total(losses, roi_features)

    def after_step(self, inputs: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Update the weights from the step's batches (already measured: ``inputs`` is not needed) and
        log them as ``weight_<loss name>``."""
        self.step()
        return self.weights()

    def skip(self) -> None:
        self.discard()

    def weights(self) -> dict[str, float]:
        """The current loss weights by loss name, for the log."""
        names = self.gradnorm.last_names or [str(i) for i in range(self.gradnorm.num_losses)]
        return {f"weight_{name}": w for name, w in zip(names, self.gradnorm.weights.tolist(), strict=True)}

    def state_dict(self) -> dict[str, Any]:
        return {"gradnorm": self.gradnorm.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any], iteration: int = 0) -> None:
        """Restore ``state_dict()``'s output (no schedule: ``iteration`` is not needed)."""
        self.gradnorm.load_state_dict(state["gradnorm"])
        load_optimizer_state(self.optimizer, state["optimizer"])  # the current config's learning rate
