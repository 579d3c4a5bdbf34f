"""What the training loop calls on its optional extras (the adversarial DropBlock step, the GradNorm loss
weights, an EMA teacher one day): one small interface, called at fixed points of every optimizer step.

One optimizer step of ``wsod.engine.train.train``, with the points where each companion is called::

    for each of the step's ``accumulation`` batches:
        forward; total = combine(losses, roi_features)   # the one companion with combines_losses, if any
        backward of total
    the step is applied (loss, gradients and statistics finite):
        optimizer step; after_step(the step's model inputs)  -> values for the log
    or skipped:
        skip()
    log_values()                                          -> values for the log, every step
    the detector's schedule steps; checkpoints hold state_dict() under ``name``

A companion keeps its own optimizer and schedule; the loop never looks inside. The loop stays an explicit
loop (no event system): these are the only places a companion runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor

__all__ = ["Companion"]


class Companion:
    """The base of every training extra; each method's default does nothing.

    Attributes:
        name: the key of ``state_dict()`` in a checkpoint ("adversary", "balancer"); unique in a run.
        combines_losses: ``combine`` makes each batch's total loss (at most one companion of a run):
            the forward then also returns the (R, D) ROI features, which ``combine`` may differentiate.
        needs_inputs: ``after_step`` receives the step's model inputs (kept on the device until then);
            the others receive an empty list, so that the step's batches are freed as it goes.
        needs_loss_scales: (with ``combines_losses``) ``combine`` also receives each loss's
            pseudo-label weight scale (the detector's ``return_loss_scales``) as a third argument.
    """

    name: ClassVar[str] = ""
    combines_losses: ClassVar[bool] = False
    needs_inputs: bool = False  # a class default; a companion may set it per instance
    needs_loss_scales: bool = False

    def combine(self, losses: dict[str, Tensor], roi_features: Tensor) -> Tensor:
        """The scalar total of one batch's ``losses`` for its backward (``combines_losses`` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not combine losses (combines_losses=False)")

    def after_step(self, inputs: Sequence[dict[str, Any]]) -> dict[str, float]:
        """The detector's step was applied; ``inputs``: its ``model_inputs`` dicts (``needs_inputs``).
        Returns values for this step's log row."""
        return {}

    def skip(self) -> None:
        """The detector's step was skipped (something was not finite): forget what it gathered."""

    def log_values(self) -> dict[str, float]:
        """Values for every step's log row, applied or skipped."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it, under ``name``."""
        return {}

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        """Restore ``state_dict()``'s output on a resume at ``iteration`` (a schedule is placed there)."""
