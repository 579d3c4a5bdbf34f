"""``method=cbl`` through tools/train.py: killed with SIGKILL mid-run and resumed, the run ends with the
weights of an uninterrupted one, the EMA teacher's included, past the switch to multi-seeds."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from tiny_run import kill_and_resume, tiny_overrides

from wsod.build import load_detector
from wsod.modeling.teacher_student import TeacherStudentPair
from wsod.runs.evaluate import evaluate_from_config
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]


def _overrides(root: Path, run_dir: Path) -> list[str]:
    # Six steps: the R-CNN head's multi-seeds from step 3 (0.4 x 6 = 2.4); the kill after checkpoint 2.
    settings = {
        "solver.max_iter": 6, "solver.milestones": "[5]", "checkpoint_period": 1, "random_baseline": "false",
        "data.test.batch_size": 6, "data.train.max_proposals": 48, "data.test.max_proposals": 48,
    }  # fmt: skip
    return ["method=cbl", *tiny_overrides(root, run_dir, **settings)]


def _final(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    final = torch.load(run_dir / "model_final.pth", weights_only=True)
    return {"model": final["model"], "teacher": final["teacher"]}


def test_cbl_trains_with_its_teacher_and_resumes_exactly_after_sigkill(tiny_toy_root, tmp_path):
    straight = tmp_path / "straight"
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=_overrides(tiny_toy_root, straight))
    threads = torch.get_num_threads()
    try:
        summary = train_from_config(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["iteration"] == 6
    assert {"loss_distill", "loss_rcnn_cls", "loss_rcnn_box", "ema_momentum"} <= set(summary["losses"])

    killed = tmp_path / "killed"
    command = [sys.executable, "tools/train.py", *_overrides(tiny_toy_root, killed)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    kill_and_resume(command, killed, env, "model_0000002.pth")

    ours, reference = _final(killed), _final(straight)
    for part in ("model", "teacher"):
        assert ours[part].keys() == reference[part].keys()
        for name, value in reference[part].items():
            torch.testing.assert_close(ours[part][name], value, rtol=0, atol=0, msg=f"{part}.{name}")
    assert any(k.startswith("method_heads.rcnn.") for k in reference["model"])
    # The teacher's classifier is the weighted mix, not the student's last classifier.
    name = "students.2.cls_score.weight"
    assert not torch.equal(reference["teacher"][name], reference["model"][name])
    pair, metadata = load_detector(killed / "model_final.pth")
    assert metadata["model"]["eval_weights"] == "mix" and isinstance(pair, TeacherStudentPair)


def test_eval_weights_picks_the_student_or_the_teacher_of_a_cbl_checkpoint(tiny_toy_root, tmp_path):
    """tools/eval.py eval_weights=student|teacher|mix: the same checkpoint's three models, each scored on
    the test set (mix, the run's own choice, is what its final evaluation reported)."""
    run = tmp_path / "run"
    overrides = [*_overrides(tiny_toy_root, run), "solver.max_iter=2", "solver.milestones=[1]"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        train_from_config(compose(config_name="train", overrides=overrides))
        data = [o for o in overrides if o.startswith("data.")]
        scored = {}
        for weights in ("student", "teacher", "mix"):
            out = tmp_path / weights
            cfg = compose(
                config_name="eval",
                overrides=[f"checkpoint={run / 'model_final.pth'}", f"eval_weights={weights}", *data,
                           "random_baseline=false", "progress=false", f"output_dir={out}"],
            )  # fmt: skip
            evaluate_from_config(cfg)
            assert f"evaluating the {weights} weights of" in (out / "log.txt").read_text()
            scored[weights] = json.loads((out / "metrics.json").read_text())
    assert scored["mix"] == json.loads((run / "eval" / "metrics.json").read_text())
    final = torch.load(run / "model_final.pth", weights_only=True)  # two models, not one twice
    assert not all(torch.equal(final["model"][n], v) for n, v in final["teacher"].items())
    # Each evaluation scored its own model: the detections' scores differ between the three.
    scores = {
        w: torch.cat(
            [
                d["scores"]
                for d in torch.load(tmp_path / w / "predictions.pth", weights_only=True)["detections"]
            ]
        )
        for w in ("student", "teacher", "mix")
    }
    for a, b in (("student", "teacher"), ("student", "mix"), ("teacher", "mix")):
        assert scores[a].shape != scores[b].shape or not torch.equal(scores[a], scores[b]), (a, b)
