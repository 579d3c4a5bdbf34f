"""GradNorm in the training loop: learned loss weights, their own optimizer, accumulation and processes.

Per optimizer step with ``accumulation`` batches (see ``wsod.engine.gradnorm`` for one balance call), at
the points where the loop calls a ``Companion`` (``wsod.engine.companion``):

* each batch, ``combine(output)`` (``weighted_total``): measures the per-loss gradient norms
  at the ROI features (the heads only), keeps GradNorm's weight gradient, and returns the weighted total
  (weights detached) for the loop's one backward;
* after the detector's update, ``after_step`` (``step()``): averages the weight gradients over the
  accumulated batches and over processes (so the weights stay identical everywhere), updates the weights
  with their own optimizer, renormalises them to sum to the number of losses, and logs them;
* a skipped step, ``skip()`` (``discard()``): the kept weight gradients are dropped.

Four settings beyond the published algorithm (``solver.gradnorm``; docs/METHOD.md §7 says why each):

* ``start_iter``: the weights stay at 1 (a plain sum) until this optimizer step, and L_i(0) is the mean
  of each rate value over the ``window`` steps before it, not the first step's value: MIST's student 1
  learns from the untrained teacher's scores, whose loss at step 0 is no baseline of anything;
* ``balance="students"``: the MIL loss keeps weight 1; GradNorm balances the students' losses only
  (they learn from the teacher: starving it starves every pseudo-label);
* ``normalize_rates``: a student's rate reads its loss divided by its mean pseudo-label weight
  (``RefinementMethod.loss_scales``), so that it follows the student's own fit, not its teacher's
  growing confidence;
* ``milestones``/``gamma``: the weights' learning rate steps down with the detector's.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from wsod.distributed import all_reduce_mean
from wsod.engine.companion import Companion
from wsod.engine.gradnorm import GradNorm
from wsod.engine.solver import WarmupMultiStep, WarmupMultiStepLR, load_optimizer_state
from wsod.modeling.protocol import TrainingOutput

__all__ = ["LossBalancer"]


BALANCE_CHOICES = ("all", "students")
FIXED_BY_BALANCE = {"all": (), "students": ("loss_mil",)}  # losses kept at weight 1


class LossBalancer(Companion):
    """``GradNorm`` over a detector's losses with an Adam optimizer (learning rate ``lr``) for its weights;
    a training-loop ``Companion`` that combines the losses.

    Args:
        num_losses: how many losses the detector returns (``loss_mil`` and the method's).
        alpha, min_weight: GradNorm's (``wsod.engine.gradnorm.GradNorm``); min_weight None: no floor.
        lr: Adam learning rate of the weights.
        start_iter: optimizer steps with every weight at 1 before GradNorm starts (0: from the first).
        window: the last ``window`` steps before ``start_iter`` whose rate values are averaged into
            L_i(0) (0, or start_iter 0: L_i(0) is the first balanced step's value, as published).
        balance: "all" (as published) or "students" (``loss_mil`` stays at weight 1).
        normalize_rates: rates from each loss divided by its scale (the third output of the
            detector's ``TrainingOutput.loss_scales``, kept when ``keep`` asks for them).
        milestones, gamma: the weights' learning rate x gamma at each of these optimizer steps.

    The loss names are fixed by the first call (a detector's losses always come in the same order).
    ``iteration`` counts the optimizer steps seen (applied or skipped) and is restored on a resume; a
    balancer switched on at a resume counts its ``start_iter`` from there.
    """

    name = "balancer"
    combines_losses = True

    def __init__(
        self,
        num_losses: int,
        *,
        alpha: float = 1.5,
        lr: float = 0.01,
        min_weight: float | None = 0.01,
        start_iter: int = 0,
        window: int = 0,
        balance: str = "all",
        normalize_rates: bool = False,
        milestones: Sequence[int] = (),
        gamma: float = 0.1,
    ) -> None:
        if balance not in BALANCE_CHOICES:
            raise ValueError(f"LossBalancer: balance must be one of {BALANCE_CHOICES}, got {balance!r}")
        fixed = FIXED_BY_BALANCE[balance]
        if num_losses - len(fixed) < 1:
            raise ValueError(
                f"LossBalancer: balance={balance!r} leaves no loss to balance among {num_losses}"
                " (a method without students has only loss_mil: use balance=all, or no GradNorm)"
            )
        if start_iter < 0 or window < 0:
            raise ValueError(f"LossBalancer: start_iter and window must be >= 0, got {start_iter}, {window}")
        if not alpha >= 0 or not lr > 0:
            raise ValueError(f"LossBalancer: alpha must be >= 0 and lr > 0, got alpha={alpha}, lr={lr}")
        self.fixed = fixed
        self.start_iter, self.window = int(start_iter), int(window)
        self.normalize_rates = bool(normalize_rates)
        # GradNorm measures at the ROI features; its normalised rates read each loss's scale.
        self.keep = frozenset({"roi_features", "loss_scales"} if normalize_rates else {"roi_features"})
        self.gradnorm = GradNorm(num_losses - len(fixed), alpha=alpha, min_weight=min_weight)
        # Adam: the weight gradient's scale is that of the gradient norms at the ROI features, which
        # differs by orders of magnitude between models; Adam's step does not depend on it (and so is
        # about lr per step whatever the gradient: hence the milestones).
        self.optimizer = torch.optim.Adam(self.gradnorm.parameters(), lr=lr)
        self.scheduler = WarmupMultiStepLR(self.optimizer, WarmupMultiStep(list(milestones), gamma))
        self.iteration = 0
        self.baseline_recorded = False
        self._names: tuple[str, ...] | None = None
        self._grads: list[Tensor] = []
        self._stats: list[Tensor] = []  # per balanced batch: (3, N) norms, rates, targets

    @property
    def balancing(self) -> bool:
        """Whether GradNorm sets the weights at the current step (else they are all 1)."""
        return self.iteration >= self.start_iter

    def to(self, device: torch.device) -> LossBalancer:
        self.gradnorm.to(device)
        return self

    def weighted_total(
        self,
        losses: dict[str, Tensor],
        roi_features: Tensor,
        loss_scales: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        """The total of ``losses`` for one backward: weighted by GradNorm once it balances (its weight
        gradient is kept), a plain sum before (the rate values observed inside the window).
        ``loss_scales``: needed with ``normalize_rates``."""
        names = self._check_names(losses)
        balanced = {name: loss for name, loss in losses.items() if name not in self.fixed}
        rate_values = self._rate_values(balanced, loss_scales)
        if not self.balancing:
            if self.iteration >= self.start_iter - self.window:
                # The mean over processes (every process observes the same values, so a checkpoint,
                # written by the first, holds the window of all of them: a resume inside it is exact).
                self.gradnorm.observe(all_reduce_mean(torch.stack(rate_values).float()))
            return sum(losses.values(), losses[names[0]].new_zeros(()))
        if self.start_iter > 0 and not self.baseline_recorded:
            self._record_baseline()
        total = self.gradnorm.balance(balanced, roi_features, rate_values)
        self._grads.append(self.gradnorm.weights.grad.detach().clone())
        self.gradnorm.weights.grad = None
        gn = self.gradnorm
        self._stats.append(torch.stack([gn.last_norms, gn.last_ratios, gn.last_targets]).float())
        return total + sum((losses[name] for name in self.fixed), total.new_zeros(()))

    def _check_names(self, losses: Mapping[str, Tensor]) -> tuple[str, ...]:
        names = tuple(losses)
        if self._names is None:
            missing = [name for name in self.fixed if name not in names]
            if missing:
                raise ValueError(
                    f"LossBalancer: the losses {list(names)} have no {missing} to keep at weight 1"
                )
            self._names = names
        return names

    def _rate_values(
        self, balanced: Mapping[str, Tensor], loss_scales: Mapping[str, Tensor] | None
    ) -> list[Tensor]:
        if not self.normalize_rates:
            return [loss.detach() for loss in balanced.values()]
        if loss_scales is None:
            raise ValueError(
                "LossBalancer: normalize_rates needs the losses' scales (the forward's keep=('loss_scales',))"
            )
        values = []
        for name, loss in balanced.items():
            scale = loss_scales[name].detach().to(loss.dtype)
            # A scale of 0 (no pseudo-label weight: a box loss on a batch without foreground ROIs) comes
            # with a loss of 0: the value 0, as without the normalisation (left out of L_i(0), rate 0).
            values.append(
                torch.where(scale > 0, loss.detach() / scale.clamp_min(1e-30), torch.zeros_like(scale))
            )
        return values

    def _record_baseline(self) -> None:
        """L_i(0) from the window (the same on every process: it observed process means)."""
        self.gradnorm.record_baseline()
        self.baseline_recorded = True

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
        self._stats.clear()

    def combine(self, output: TrainingOutput) -> Tensor:
        return self.weighted_total(output.losses, output.roi_features, output.loss_scales)

    def after_step(self, inputs: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Update the weights from the step's batches (already measured: ``inputs`` is not needed) and
        log them as ``weight_<loss name>``, with GradNorm's ``gradnorm_norm_<name>`` (G_i),
        ``gradnorm_rate_<name>`` (r_i) and ``gradnorm_target_<name>`` of the step (means over its
        batches) once it balances."""
        values = self._step_stats()
        self.step()
        self._advance()
        return {**self.weights(), **values}

    def skip(self) -> None:
        self.discard()
        self._advance()

    def _advance(self) -> None:
        self.iteration += 1
        with warnings.catch_warnings():
            # Before start_iter the weights' optimizer has not stepped yet; the schedule counts steps
            # all the same (torch warns about exactly that order).
            warnings.filterwarnings(
                "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
            )
            self.scheduler.step()

    def _step_stats(self) -> dict[str, float]:
        if not self._stats:
            return {}
        mean = all_reduce_mean(torch.stack(self._stats).mean(dim=0))
        self._stats.clear()
        names = self._balanced_names()
        return {
            f"gradnorm_{kind}_{name}": value
            for kind, row in zip(("norm", "rate", "target"), mean.tolist(), strict=True)
            for name, value in zip(names, row, strict=True)
        }

    def _balanced_names(self) -> list[str]:
        if self._names is None:
            return [str(i) for i in range(self.gradnorm.num_losses)]
        return [name for name in self._names if name not in self.fixed]

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def weights(self) -> dict[str, float]:
        """The current loss weights by loss name, for the log (the fixed losses at 1)."""
        balanced = dict(zip(self._balanced_names(), self.gradnorm.weights.tolist(), strict=True))
        return {f"weight_{name}": balanced.get(name, 1.0) for name in self._names or balanced}

    def state_dict(self) -> dict[str, Any]:
        return {
            "gradnorm": self.gradnorm.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "baseline_recorded": self.baseline_recorded,
        }

    def load_state_dict(self, state: dict[str, Any], iteration: int = 0) -> None:
        """Restore ``state_dict()``'s output at the loop's ``iteration`` (the learning rate placed there).
        A checkpoint written before the window existed loads too (an empty window, ``iteration`` the
        loop's)."""
        saved = state["gradnorm"]
        if saved["weights"].shape != self.gradnorm.weights.shape:
            raise ValueError(
                f"the checkpoint's GradNorm balances {saved['weights'].numel()} losses, this run"
                f" {self.gradnorm.num_losses} (solver.gradnorm.balance changed?): resume with the"
                " checkpoint's settings"
            )
        self.gradnorm.load_state_dict(saved)
        load_optimizer_state(self.optimizer, state["optimizer"])  # the current config's learning rate
        self.iteration = iteration
        self.baseline_recorded = state.get("baseline_recorded", self.gradnorm.initialized)
        self.scheduler.place(iteration)
