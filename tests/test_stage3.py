"""The third stage end to end on the tiny toy set: the guide's third-stage block (docs/guides/
second_stage.md: split -> train stage 3 -> eval) word for word after its second-stage block, the split
file against the losses it ranks, the teacher evaluated and saved, refused inputs, and an exact resume
of a third-stage run killed with SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from guide_pipeline import compose_config, guide_block, run_commands, run_under_torchrun, short_overrides
from tiny_run import TINY_TOY, kill_and_resume

from wsod.build import load_detector
from wsod.config_checks import ConfigError
from wsod.data.labelled_split import read_split
from wsod.modeling.faster_rcnn import FasterRCNNDetector
from wsod.runs.split import split_from_config
from wsod.runs.stage3 import train_stage3_from_config

ROOT = Path(__file__).resolve().parents[1]
# The guide's toy k (240 of 600 images) on the tiny set's 12 images.
TINY_K = {"k=240": "k=5"}


def _tiny(commands: list[str]) -> list[str]:
    out = []
    for command in commands:
        for wanted, tiny in TINY_K.items():
            command = command.replace(wanted, tiny)
        out.append(command)
    return out


@pytest.fixture(scope="module")
def stage3(guide_pipeline, tiny_toy_root):
    """The guide's third-stage block after its second-stage one: the working directory and each result.
    The tiny second stage runs 4 steps; its checkpoint after step 2 stands in for the toy's
    ``model_0001500.pth`` (before the learning-rate step at 3)."""
    workdir, _ = guide_pipeline
    stage2 = workdir / "runs" / "toy_stage2"
    shutil.copy(stage2 / "model_0000002.pth", stage2 / "model_0001500.pth")
    return workdir, run_commands(_tiny(guide_block(1)), tiny_toy_root, workdir)


def test_the_guides_third_stage_runs_word_for_word_with_a_short_schedule(stage3):
    workdir, (split, trained, evaluation) = stage3
    commands = guide_block(1)
    assert [c.split()[1] for c in commands] == [
        "tools/split_pseudo_labels.py", "tools/train_stage3.py", "tools/eval.py",
    ]  # fmt: skip
    assert all(wanted in " ".join(commands) for wanted in TINY_K)  # the one value the tiny set changes
    run_dir = workdir / "runs" / "toy_stage3"
    assert {"config.yaml", "log.txt", "metrics.jsonl", "model_final.pth", "eval"} <= {
        p.name for p in run_dir.iterdir()
    }
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train_rows] == [1, 2, 3, 4]
    assert {"loss_classifier_unlabelled", "loss_objectness_unlabelled", "ema_momentum"} <= set(train_rows[0])
    assert not {"loss_box_reg_unlabelled", "loss_rpn_box_reg_unlabelled"} & set(train_rows[0])  # weight 0
    assert trained["iteration"] == 4 and split["labelled"] == 5
    # tools/eval.py reads the teacher, which the run's own final evaluation used.
    assert evaluation["mAP"] == pytest.approx(trained["final"]["mAP"])
    final = torch.load(run_dir / "model_final.pth", weights_only=True)
    teacher, metadata = load_detector(run_dir / "model_final.pth")
    assert metadata["model"]["eval_weights"] == "teacher" and isinstance(teacher, FasterRCNNDetector)
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, final["teacher"][name]), name
    assert any(not torch.equal(final["teacher"][k], final["model"][k]) for k in final["model"])


def test_the_split_keeps_the_k_lowest_losses_and_writes_them_beside_the_json(stage3, tiny_toy_root):
    workdir, (split, _, _) = stage3
    pseudo = workdir / "runs" / "toy_stage1" / "pseudo_labels"
    content = json.loads((pseudo / "split.json").read_text())
    images = content["images"]
    assert len(images) == TINY_TOY["num_train"] and content["info"]["k"] == 5
    for image in images:
        assert image["loss"] == pytest.approx(sum(image["losses"].values()))
        assert set(image["losses"]) == {
            "loss_classifier",
            "loss_box_reg",
            "loss_objectness",
            "loss_rpn_box_reg",
        }
    # The 5 labelled images are those of lowest loss (ties kept in the json's order).
    order = sorted(range(len(images)), key=lambda i: (images[i]["loss"], i))
    assert {images[i]["source_id"] for i in order[:5]} == {i["source_id"] for i in images if i["labelled"]}
    names = [i["file_name"] for i in json.loads((pseudo / "pseudo_labels.json").read_text())["images"]]
    assert [i["file_name"] for i in images] == names  # the pseudo-label json's images, in its order
    shares = content["per_class"]
    assert sum(c["labelled"] for c in shares.values()) >= 5 and all(
        0 <= (c["share"] or 0) <= 1 for c in shares.values()
    )
    assert "copypaste: labelled=5/12" in (pseudo / "log.txt").read_text()
    assert set(split["quality"]) == {"labelled", "unlabelled"} and content["quality"] == split["quality"]
    assert content["quality"]["labelled"]["images"] == 5
    assert read_split(pseudo / "split.json") == {i["source_id"]: i["labelled"] for i in images}


def test_the_split_is_a_function_of_its_inputs_and_refuses_to_overwrite(stage3, tiny_toy_root, tmp_path):
    workdir, _ = stage3
    pseudo = workdir / "runs" / "toy_stage1" / "pseudo_labels" / "pseudo_labels.json"
    checkpoint = workdir / "runs" / "toy_stage2" / "model_0001500.pth"
    base = [
        f"checkpoint={checkpoint}",
        f"pseudo_labels={pseudo}",
        "k=5",
        *short_overrides(tiny_toy_root, "split"),
    ]
    with pytest.raises(ConfigError, match="split.json exists: overwrite=true replaces it"):
        split_from_config(compose_config("split", base))
    split_from_config(compose_config("split", [*base, f"output_dir={tmp_path}"]))
    first = json.loads((pseudo.parent / "split.json").read_text())["images"]
    again = json.loads((tmp_path / "split.json").read_text())["images"]
    assert first == again  # the samplers are seeded per image: the same losses, the same split
    with pytest.raises(ConfigError, match=r"k=13: the pseudo-label json holds 12 training images"):
        split_from_config(
            compose_config("split", [*base[:2], "k=13", *base[3:], f"output_dir={tmp_path / 'k'}"])
        )
    first_stage = workdir / "runs" / "toy_stage1" / "model_final.pth"
    with pytest.raises(ConfigError, match="a first-stage checkpoint"):
        split_from_config(
            compose_config("split", [f"checkpoint={first_stage}", *base[1:], f"output_dir={tmp_path / 'c'}"])
        )


def _stage3_overrides(workdir: Path, root: Path, run_dir: Path) -> list[str]:
    pseudo = workdir / "runs" / "toy_stage1" / "pseudo_labels"
    return [
        f"initial_weights={workdir / 'runs' / 'toy_stage2' / 'model_final.pth'}",
        f"pseudo_labels={pseudo / 'pseudo_labels.json'}", f"split={pseudo / 'split.json'}",
        f"output_dir={run_dir}", *short_overrides(root, "stage3"), "solver.max_iter=5", "checkpoint_period=1",
        "random_baseline=false",
    ]  # fmt: skip


def test_a_third_stage_run_killed_mid_run_resumes_to_the_same_student_and_teacher(
    stage3, tiny_toy_root, tmp_path
):
    workdir, _ = stage3
    straight = tmp_path / "straight"
    threads = torch.get_num_threads()
    try:
        train_stage3_from_config(
            compose_config("stage3", _stage3_overrides(workdir, tiny_toy_root, straight))
        )
    finally:
        torch.set_num_threads(threads)
    killed = tmp_path / "killed"
    command = [sys.executable, "tools/train_stage3.py", *_stage3_overrides(workdir, tiny_toy_root, killed)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    kill_and_resume(command, killed, env, "model_0000002.pth")
    ours = torch.load(killed / "model_final.pth", weights_only=True)
    reference = torch.load(straight / "model_final.pth", weights_only=True)
    for part in ("model", "teacher"):
        assert ours[part].keys() == reference[part].keys()
        for name, value in reference[part].items():
            torch.testing.assert_close(ours[part][name], value, rtol=0, atol=0, msg=f"{part}.{name}")


def test_a_third_stage_refuses_another_detector_and_an_unknown_split(stage3, tiny_toy_root, tmp_path):
    workdir, _ = stage3
    base = _stage3_overrides(workdir, tiny_toy_root, tmp_path / "a")
    with pytest.raises(
        ConfigError, match=r"a detector of other settings; give the second stage's: detector.fpn_channels=16"
    ):
        train_stage3_from_config(compose_config("stage3", [*base, "detector.fpn_channels=8"]))
    other = tmp_path / "split.json"
    content = json.loads((workdir / "runs" / "toy_stage1" / "pseudo_labels" / "split.json").read_text())
    content["images"] = content["images"][1:]
    other.write_text(json.dumps(content))
    overrides = [
        o for o in _stage3_overrides(workdir, tiny_toy_root, tmp_path / "b") if not o.startswith("split=")
    ]
    with pytest.raises(ValueError, match=r"1 images of .* are not in it"):
        train_stage3_from_config(compose_config("stage3", [*overrides, f"split={other}"]))
    with pytest.raises(ConfigError, match=r"solver.ema.enabled=False: expected true"):
        train_stage3_from_config(compose_config("stage3", [*base, "solver.ema.enabled=false"]))
    # A second-stage run's folder is not continued as a third-stage run.
    second = tmp_path / "second"
    second.mkdir()
    shutil.copy(workdir / "runs" / "toy_stage2" / "model_0000004.pth", second)
    resumed = [o for o in _stage3_overrides(workdir, tiny_toy_root, second)] + ["resume=true"]
    with pytest.raises(ConfigError, match=r"belongs to a second-stage run \(tools/train_stage2.py\)"):
        train_stage3_from_config(compose_config("stage3", resumed))


@pytest.mark.slow
def test_the_third_stage_trains_under_torchrun_with_two_gloo_processes(stage3, tiny_toy_root, tmp_path):
    """DDP: two processes of 1 labelled + 1 unlabelled image each, each with its own EMA teacher (equal:
    DDP keeps the students equal), write one run directory and evaluate once."""
    workdir, _ = stage3
    run_dir = tmp_path / "ddp"
    overrides = [
        o for o in _stage3_overrides(workdir, tiny_toy_root, run_dir) if not o.startswith("solver.max_iter")
    ]
    extra = ["solver.max_iter=4", "solver.ims_per_batch=1", "semi_supervised.unlabelled_per_batch=1"]
    run_under_torchrun("tools/train_stage3.py", [*overrides, *extra], run_dir)
    final = torch.load(run_dir / "model_final.pth", weights_only=True)
    assert set(final) >= {"model", "teacher"}
