"""An exponential-moving-average teacher (mean teacher) as a training ``Companion`` (``solver.ema``).

The teacher is a copy of the student detector made when the run starts. After every applied optimizer
step, each tensor of the module groups it follows (``follow``: ``"backbone"``, ``"neck"``, ``"heads"``,
the groups the detector names, ``wsod.modeling.protocol.Detector.module_groups``) moves towards the
student's::

    theta_T <- alpha_t * theta_T + (1 - alpha_t) * theta_S

with ``alpha_t = momentum`` (``schedule="constant"``) or ``alpha_t = min(1 - 1 / (t + 1), momentum)``
(``"ramp"``: the mean teacher of Tarvainen and Valpola, 2017, and CBL's, so that the early teacher is the
plain average of the few students so far; t counts the updates made before this one). Floating-point
buffers (BatchNorm running statistics) average like the parameters; integer ones (counters) are copied.
Groups the teacher does not follow hold the student's current values (copied after each step): the
teacher then differs from the student only where it averages. ``sources`` may give a teacher tensor a
weighted mix of student tensors instead of its namesake (CBL's teacher classifier follows
(1/6) x the three refinement classifiers + (1/2) x the R-CNN classifier):
``theta_T <- alpha theta_T + (1 - alpha) sum_k w_k theta_S,k``.

Every micro-batch, before the student's forward (``before_forward``), the teacher scores the same
images and ROIs in eval mode under ``torch.no_grad``: the neck runs with its inference chunking and keeps
no graph, so the teacher adds its parameters to the step's memory, not per-ROI activations. What it
gives the student's forward is the detector's ``teacher_inputs`` (the weakly-supervised detector:
``teacher_scores``, which its refinement method reads in ``batch_losses``).

Checkpoints hold the teacher's weights and its update count (``state_dict``), so a resume continues it
exactly; ``model_final.pth`` holds its weights under ``"teacher"`` (``final_weights``), which
``wsod.build.load_detector`` reads for ``model.eval_weights`` ``teacher`` or ``mix``. Evaluations use
the student, the teacher, or the pair mixed by the method (``evaluation_model``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from wsod.engine.companion import Companion
from wsod.modeling.protocol import MODULE_GROUPS
from wsod.modeling.teacher_student import EVAL_WEIGHTS, TeacherStudentPair

__all__ = ["EMATeacher", "SCHEDULES"]

SCHEDULES = ("constant", "ramp")


class EMATeacher(Companion):
    """The EMA teacher of ``student`` (the unwrapped detector).

    Args:
        momentum: alpha, in [0, 1) (the cap of ``"ramp"``).
        schedule: ``"constant"`` or ``"ramp"`` (the module docstring).
        follow: the module groups the teacher averages (a subset of ``MODULE_GROUPS``, at least one).
        eval_weights: what evaluations predict with: ``"student"``, ``"teacher"`` or ``"mix"`` (the
            student and the teacher on the same ROIs, their per-ROI scores mixed by the method's
            ``mix_scores``).
        sources: optional ``{teacher state name: {student state name: weight}}``: those teacher tensors
            follow the weighted sum of the named student tensors (same shape) instead of their namesake,
            whatever their group; the others follow ``follow``.
    """

    name = "ema_teacher"

    def __init__(
        self,
        student: nn.Module,
        *,
        momentum: float = 0.999,
        schedule: str = "constant",
        follow: Sequence[str] = MODULE_GROUPS,
        eval_weights: str = "student",
        sources: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"EMATeacher: momentum must be in [0, 1), got {momentum}")
        if schedule not in SCHEDULES:
            raise ValueError(f"EMATeacher: schedule must be one of {SCHEDULES}, got {schedule!r}")
        unknown = [group for group in follow if group not in MODULE_GROUPS]
        if unknown or not follow:
            raise ValueError(
                f"EMATeacher: follow must list some of {MODULE_GROUPS}, got {list(follow)}"
                f" ({unknown} unknown)"
            )
        if eval_weights not in EVAL_WEIGHTS:
            raise ValueError(f"EMATeacher: eval_weights must be one of {EVAL_WEIGHTS}, got {eval_weights!r}")
        if isinstance(student, nn.parallel.DistributedDataParallel):
            student = student.module
        self.student, self.momentum, self.schedule = student, float(momentum), schedule
        self.follow, self.eval_weights = tuple(follow), eval_weights
        self.teacher = copy.deepcopy(student).eval().requires_grad_(False)
        self.updates = 0
        # The copy above is of the weights at build time; a run resumed from a checkpoint without a
        # teacher (switched on at the resume) loads the student's weights after it: the teacher is then
        # made again from those at its first use (``_start``). A checkpoint's teacher replaces it.
        self._started = False
        self._averaged, self._copied = _pairs(student, self.teacher, self.follow, sources or {})
        self._last_momentum = float("nan")

    def alpha(self) -> float:
        """The momentum of the next update."""
        if self.schedule == "ramp":
            return min(1.0 - 1.0 / (self.updates + 1), self.momentum)
        return self.momentum

    @torch.no_grad()
    def before_forward(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The teacher's ``teacher_inputs`` on the step's images and ROIs (eval mode, no graph)."""
        self._start()
        self.teacher.eval()  # whatever an evaluation left it in
        return self.teacher.teacher_inputs(inputs)

    @torch.no_grad()
    def _start(self) -> None:
        """At the first use of a teacher no checkpoint gave: the student's current weights."""
        if not self._started:
            self.teacher.load_state_dict(self.student.state_dict())
            self._started = True

    @torch.no_grad()
    def update(self) -> float:
        """One EMA update from the student's current weights; returns the alpha used."""
        self._start()
        alpha = self.alpha()
        for teacher, mix in self._averaged:
            if len(mix) == 1 and mix[0][1] == 1.0:  # its namesake: one fused, exact lerp
                teacher.lerp_(mix[0][0].detach().to(teacher.dtype), 1.0 - alpha)
                continue
            target = sum(weight * student.detach().to(teacher.dtype) for student, weight in mix)
            teacher.mul_(alpha).add_(target, alpha=1.0 - alpha)
        for teacher, student in self._copied:
            teacher.copy_(student.detach())
        self.updates += 1
        return alpha

    def after_step(self, inputs: Sequence[dict[str, Any]]) -> dict[str, float]:
        self._last_momentum = self.update()
        return {"ema_momentum": self._last_momentum}

    def evaluation_model(self, model: nn.Module) -> nn.Module:
        self._start()
        if self.eval_weights == "teacher":
            return self.teacher
        if self.eval_weights == "mix":
            return TeacherStudentPair(model, self.teacher)
        return model

    def final_weights(self) -> dict[str, Any]:
        self._start()
        return {"teacher": self.teacher.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        self._start()
        return {"teacher": self.teacher.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        self.teacher.load_state_dict(state["teacher"])
        self.updates = int(state["updates"])
        self._started = True


def _pairs(
    student: nn.Module,
    teacher: nn.Module,
    follow: Sequence[str],
    sources: Mapping[str, Mapping[str, float]],
) -> tuple[list[tuple[Tensor, list[tuple[Tensor, float]]]], list[tuple[Tensor, Tensor]]]:
    """The teacher's state entries: averaged ones (floating point, in a followed group or named by
    ``sources``) with the weighted student tensors they follow, and copied ones with their namesake (the
    rest: other groups, integer buffers, anything outside the groups)."""
    group_of = {
        id(tensor): group
        for group, modules in student.module_groups().items()
        for module in modules
        for tensor in module.state_dict(keep_vars=True).values()
    }
    student_state = student.state_dict(keep_vars=True)
    teacher_state = teacher.state_dict(keep_vars=True)
    for name, mix in sources.items():
        wrong = [n for n in (name, *mix) if n not in student_state]
        if wrong:
            raise ValueError(f"EMATeacher: sources name {wrong}, which the detector's state does not hold")
        bad = [n for n in mix if student_state[n].shape != student_state[name].shape]
        if bad:
            raise ValueError(f"EMATeacher: sources of {name} {bad} differ from it in shape")
    averaged, copied = [], []
    for name, tensor in student_state.items():
        target = teacher_state[name].data
        if name in sources:
            averaged.append((target, [(student_state[n], float(w)) for n, w in sources[name].items()]))
        elif group_of.get(id(tensor)) in follow and tensor.is_floating_point():
            averaged.append((target, [(tensor, 1.0)]))
        else:
            copied.append((target, tensor))
    return averaged, copied
