"""What the training step calls on its optional extras (the adversarial DropBlock step, the GradNorm loss
weights, the EMA teacher): one small interface, called at fixed points of every optimizer step.

One optimizer step (``wsod.engine.step.train_step``), with the points where each companion is called::

    for each of the step's ``accumulation`` batches:
        before_forward(inputs)                            -> extra keyword arguments of the forward
        output = model(**inputs, **extra, keep=...)       # ``keep``: what the combining companion needs
        total = combine(output)                           # the one companion with combines_losses, if any
        backward of total
    the step is applied (loss, gradients and statistics finite):
        optimizer step; after_step(the step's model inputs)  -> values for the log
    or skipped:
        skip()
    log_values()                                          -> values for the log, every step
    the detector's schedule steps; checkpoints hold state_dict() under ``name``

Around the step, the loop asks ``evaluation_model`` which model its evaluations predict with (the EMA
teacher's, for instance) and ``final_weights`` what ``model_final.pth`` holds besides the model's.

A companion keeps its own optimizer and schedule; the loop never looks inside. The loop stays an explicit
loop (no event system): these are the only places a companion runs. Which companions a run has comes
from its config (``wsod.build.COMPANIONS``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor, nn

from wsod.modeling.protocol import TrainingOutput

__all__ = ["Companion", "evaluation_model"]


class Companion:
    """The base of every training extra; each method's default does nothing.

    Attributes:
        name: the key of ``state_dict()`` in a checkpoint ("adversary", "balancer", "ema_teacher");
            unique in a run.
        combines_losses: ``combine`` makes each batch's total loss (at most one companion of a run).
        keep: what the training forward also returns for ``combine`` (``TRAINING_EXTRAS``: the (R, D)
            ROI features, which ``combine`` may differentiate, and the losses' scales).
        needs_inputs: ``after_step`` receives the step's model inputs (kept on the device until then,
            with every companion's ``before_forward`` arguments); the others receive an empty list, so
            that the step's batches are freed as it goes.
    """

    name: ClassVar[str] = ""
    combines_losses: ClassVar[bool] = False
    keep: frozenset[str] = frozenset()  # a class default; a companion may set it per instance
    needs_inputs: bool = False

    def before_forward(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Extra keyword arguments of the training forward on ``inputs`` (the batch's model inputs, on
        the device), e.g. an EMA teacher's scores. Called inside the step's autocast."""
        return {}

    def combine(self, output: TrainingOutput) -> Tensor:
        """The scalar total of one batch's losses for its backward (``combines_losses`` only)."""
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

    def evaluation_model(self, model: nn.Module) -> nn.Module:
        """The model an evaluation predicts with, given the trained one (default: that model)."""
        return model

    def final_weights(self) -> dict[str, Any]:
        """What ``model_final.pth`` holds of this companion besides the model's weights (default none)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it, under ``name``."""
        return {}

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        """Restore ``state_dict()``'s output on a resume at ``iteration`` (a schedule is placed there)."""


def evaluation_model(model: nn.Module, companions: Sequence[Companion]) -> nn.Module:
    """The model evaluations use: ``model`` (unwrapped from DDP) passed through each companion's
    ``evaluation_model``."""
    model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    for companion in companions:
        model = companion.evaluation_model(model)
    return model
