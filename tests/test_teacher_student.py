"""A teacher–student method defined here, outside wsod/, trained through tools/train.py.

``TeacherConsistency`` is MIST plus one batch loss: the KL divergence from the EMA teacher's detection
scores on view 1 of each image to the last student's on view 2, ROI matched to ROI by proposal id. It
needs ``data.train.views=2`` and ``solver.ema.enabled=true`` and touches nothing under wsod/: a method
config names it (``method=teacher_consistency`` from a config folder of its own), the EMA teacher is the
built-in companion, the views the data option. Killed with SIGKILL mid-run and resumed, the run ends
with the weights of an uninterrupted one, the teacher's included.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from tiny_run import kill_and_resume, tiny_overrides
from torch import Tensor

from wsod.build import load_detector
from wsod.modeling.method import MethodBatch
from wsod.modeling.refinement import MISTMethod
from wsod.modeling.teacher_student import TeacherStudentPair
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


class TeacherConsistency(MISTMethod):
    """MIST, plus ``consistency_weight`` x KL(teacher's scores on view 1 || last student's on view 2)."""

    def __init__(self, consistency_weight: float = 1.0, **mist) -> None:
        super().__init__(**mist)
        self.consistency_weight = float(consistency_weight)

    def loss_names(self, num_students: int) -> tuple[str, ...]:
        return (*super().loss_names(num_students), "loss_consistency")

    def batch_losses(self, batch: MethodBatch) -> dict[str, Tensor]:
        if batch.teacher is None or batch.views < 2:
            raise ValueError("TeacherConsistency needs solver.ema.enabled=true and data.train.views=2")
        teacher = batch.by_view(batch.teacher.detection)
        student = batch.by_view(F.log_softmax(batch.student_logits[-1], dim=1))
        terms = []
        for image_teacher, image_student, ids in zip(teacher, student, batch.proposal_ids(), strict=True):
            position = torch.full((int(ids[0].max()) + 1,), -1, dtype=torch.long, device=ids[0].device)
            position[ids[0]] = torch.arange(len(ids[0]), device=ids[0].device)
            matched = position[ids[1].clamp_max(len(position) - 1)]
            keep = (ids[1] < len(position)) & (matched >= 0)
            target = image_teacher[0][matched[keep]]
            terms.append(F.kl_div(image_student[1][keep], target, reduction="batchmean"))
        return {"loss_consistency": self.consistency_weight * torch.stack(terms).mean()}


METHOD_YAML = """\
# A method of a test file (tests/test_teacher_student.py): MIST plus a teacher-student consistency loss.
defaults: [mist, _self_]
name: test_teacher_student:TeacherConsistency
consistency_weight: 0.5
"""


def _config_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "my_configs"
    (folder / "method").mkdir(parents=True)
    (folder / "method" / "teacher_consistency.yaml").write_text(METHOD_YAML)
    return folder


def _overrides(root: Path, run_dir: Path, **extra) -> list[str]:
    # Four steps on 48 proposals per image: the kill comes after the checkpoint of step 2.
    settings = {
        "data.train.views": 2, "solver.ema.enabled": "true", "solver.ema.schedule": "ramp",
        "model.eval_weights": "teacher", "solver.max_iter": 4, "solver.milestones": "[3]",
        "checkpoint_period": 1, "random_baseline": "false", "data.test.batch_size": 6,
        "data.train.max_proposals": 48, "data.test.max_proposals": 48, **extra,
    }  # fmt: skip
    return ["method=teacher_consistency", *tiny_overrides(root, run_dir, **settings)]


def _tool_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _final(run_dir: Path) -> dict[str, dict[str, Tensor]]:
    final = torch.load(run_dir / "model_final.pth", weights_only=True)
    return {"model": final["model"], "teacher": final["teacher"]}


def test_a_method_of_a_test_file_trains_on_two_views_with_the_ema_teacher_and_resumes_exactly_after_sigkill(
    tiny_toy_root, tmp_path
):
    config_dir = _config_dir(tmp_path)
    # The uninterrupted run, in this process.
    straight = tmp_path / "straight"
    # pytest puts this file's folder on sys.path (the tool's PYTHONPATH below): the method's module by name.
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[*_overrides(tiny_toy_root, straight), f"hydra.searchpath=[file://{config_dir}]"],
        )
    threads = torch.get_num_threads()
    try:
        summary = train_from_config(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["iteration"] == 4 and "loss_consistency" in summary["losses"]

    # The same run through tools/train.py, killed with SIGKILL once it has written a checkpoint.
    killed = tmp_path / "killed"
    command = [
        sys.executable,
        "tools/train.py",
        "--config-dir",
        str(config_dir),
        *_overrides(tiny_toy_root, killed),
    ]
    kill_and_resume(command, killed, _tool_env(), "model_0000002.pth")
    ours, reference = _final(killed), _final(straight)
    for part in ("model", "teacher"):
        assert ours[part].keys() == reference[part].keys()
        for name, value in reference[part].items():
            torch.testing.assert_close(ours[part][name], value, rtol=0, atol=0, msg=f"{part}.{name}")
    # The teacher is an average, not a copy of the student, and it is what the run evaluated.
    assert any(not torch.equal(reference["teacher"][n], v) for n, v in reference["model"].items())
    teacher, metadata = load_detector(killed / "model_final.pth")
    assert metadata["model"]["eval_weights"] == "teacher"
    for name, value in teacher.state_dict().items():
        torch.testing.assert_close(value, reference["teacher"][name], rtol=0, atol=0)
    pair, _ = load_detector(killed / "model_final.pth", eval_weights="mix")
    assert isinstance(pair, TeacherStudentPair) and not pair.teacher.training
