"""A student and its EMA teacher predicting together: what ``model.eval_weights=mix`` evaluates.

The EMA teacher (``wsod.engine.ema.EMATeacher``) is a copy of the student with averaged weights; on
the same test view both score the same proposals, and the student says how the two per-ROI predictions
mix (``WeaklySupervisedDetector.mix_predictions``: the class probabilities by its method's
``mix_scores``, the boxes averaged). The pair implements the detector contract
(``wsod.modeling.protocol.Detector``) for prediction; training goes through the student.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from wsod.modeling.protocol import DetectionSettings

__all__ = ["EVAL_WEIGHTS", "TeacherStudentPair"]

# What an evaluation predicts with (``model.eval_weights``): the trained weights, the EMA teacher's, or
# both mixed by the method.
EVAL_WEIGHTS = ("student", "teacher", "mix")


class TeacherStudentPair(nn.Module):
    """``student`` and ``teacher`` (the same architecture) as one detector for prediction: each test
    view's per-ROI records of both, mixed by ``student.mix_predictions``. The teacher stays in eval mode
    whatever mode the pair is put in."""

    def __init__(self, student: nn.Module, teacher: nn.Module) -> None:
        super().__init__()
        if not hasattr(student, "mix_predictions"):
            raise ValueError(
                f"{type(student).__name__} has no per-ROI predictions to mix with its teacher's"
                " (model.eval_weights=mix): evaluate the student or the teacher"
            )
        self.student, self.teacher = student, teacher.eval()

    def train(self, mode: bool = True) -> TeacherStudentPair:
        self.training = mode
        self.student.train(mode)
        return self

    @property
    def num_classes(self) -> int:
        return self.student.num_classes

    @property
    def loss_names(self) -> tuple[str, ...]:
        return self.student.loss_names

    @property
    def detection_settings(self) -> DetectionSettings:
        return self.student.detection_settings

    @property
    def makes_proposals(self) -> bool:
        return self.student.makes_proposals

    def module_groups(self) -> dict[str, list[nn.Module]]:
        return self.student.module_groups()

    def teacher_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return self.teacher.teacher_inputs(inputs)

    def predict_view(
        self, inputs: Mapping[str, Any], flipped: Sequence[bool], settings: DetectionSettings
    ) -> list[Any]:
        own = self.student.predict_view(inputs, flipped, settings)
        theirs = self.teacher.predict_view(inputs, flipped, settings)
        return [self.student.mix_predictions(a, b) for a, b in zip(own, theirs, strict=True)]

    def merge_views(self, views: Sequence[Any], settings: DetectionSettings) -> dict[str, Tensor]:
        return self.student.merge_views(views, settings)

    def postprocess(
        self, scores: Tensor, boxes: Tensor, settings: DetectionSettings | None = None
    ) -> dict[str, Tensor]:
        return self.student.postprocess(scores, boxes, settings)
