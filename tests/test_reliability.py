"""Never lose a run: what tools/train.py and tools/eval.py do with broken input, a diverging run, bad
settings and a changed resume, checked on the exit code, the message and the files left on disk.
docs/RELIABILITY.md lists each case with the test that checks it."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_run import tiny_overrides

from wsod.config_checks import ConfigError
from wsod.engine.checkpoint import save_checkpoint
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("HYDRA_FULL_ERROR", None)
QUIET = {"random_baseline": "false"}


def _tool(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


def _config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _finite(path: Path) -> bool:
    weights = torch.load(path, weights_only=True)["model"]
    return all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())


def test_a_failing_final_evaluation_keeps_the_weights_and_says_how_to_rerun_it(tiny_toy_root, tmp_path):
    toy = tmp_path / "my toy"  # a space: the printed command must still paste as one word per override
    shutil.copytree(tiny_toy_root, toy)
    test_ids = (toy / "VOCdevkit/VOC2007/ImageSets/Main/test.txt").read_text().split()
    (toy / "VOCdevkit/VOC2007/JPEGImages" / f"{test_ids[2]}.jpg").write_bytes(b"not a jpeg")
    run_dir = tmp_path / "run"
    result = _tool(["tools/train.py", *tiny_overrides(toy, run_dir, **QUIET), "data.test.scales=[160, 192]"])
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "FinalEvaluationError: the final evaluation failed (RuntimeError: cannot decode image" in output
    command = output.split("evaluate them alone with: ", 1)[1].splitlines()[0]
    assert shlex.split(command) == [
        "python", "tools/eval.py", f"checkpoint={run_dir / 'model_final.pth'}", "data=toy",
        f"data.root={toy}", "data.num_train=12", "data.num_test=6", "data.train.num_workers=0",
        "data.test.num_workers=0", "data.train.max_proposals=32", "data.test.scales=[160, 192]",
    ]  # fmt: skip
    assert "Traceback" not in output  # one clear message on the console ...
    assert "Traceback" in (run_dir / "log.txt").read_text()  # ... the traceback in the log
    assert (run_dir / "model_final.pth").is_file() and _finite(run_dir / "model_final.pth")
    assert "the final evaluation failed" in (run_dir / "error.txt").read_text()


def test_divergence_is_skipped_counted_and_stops_cleanly(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    # checkpoint_period as the default's: no periodic checkpoint before the stop, which saves one.
    diverging = {"solver.lr": 1e10, "max_nonfinite": 2, "solver.max_iter": 8, "checkpoint_period": 500}
    result = _tool(["tools/train.py", *tiny_overrides(tiny_toy_root, run_dir, **diverging, **QUIET)])
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "NonFiniteLossError: training stopped: 2 consecutive steps" in output
    assert "the last finite step was iteration 1" in output and "Traceback" not in output
    assert f"Its weights are saved in {run_dir / 'model_0000003.pth'}" in output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    checkpoints = sorted(run_dir.glob("model_*.pth"))
    assert [p.name for p in checkpoints] == ["model_0000003.pth"] and _finite(checkpoints[0])
    assert not (run_dir / "model_final.pth").exists() and (run_dir / "error.txt").is_file()


@pytest.mark.parametrize(
    "overrides,messages",
    [
        (
            ["solver.max_iter=-5", "solver.lr=0", "solver.milestones=[1800,1600]"],
            ["solver.max_iter=-5: expected an integer >= 1", "solver.lr=0.0: expected a number > 0",
             "solver.milestones=[1800, 1600]: expected a list of increasing positive integers"],
        ),
        (["solver.milestones=[3000]"], ["solver.milestones=[3000]: beyond solver.max_iter=2000"]),
        (["model.chunk_size=0", "model.backbone=resnet7"], ["model.chunk_size=0", "backbone='resnet7'"]),
    ],
    ids=["bounds", "beyond", "model"],
)  # fmt: skip
def test_impossible_settings_fail_before_anything_runs_naming_key_value_and_expectation(
    tmp_path, overrides, messages
):
    result = _tool(["tools/train.py", f"output_dir={tmp_path / 'run'}", *overrides])
    assert result.returncode == 1
    assert result.stderr.startswith("error: ConfigError: invalid configuration:")
    for message in messages:
        assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing ran: no run directory


def test_a_value_of_the_wrong_type_is_refused_by_the_schema_before_anything_runs(tmp_path):
    # wsod/config_schema.py types every key: Hydra refuses the override as it composes, naming the key
    # and what it expects (each type and choice: test_config_checks.py, in-process), before any run folder.
    override, message = "solver.optimizer=adam", "Invalid value 'adam', expected one of [sgd, adamw]"
    result = _tool(["tools/train.py", f"output_dir={tmp_path / 'run'}", override])
    assert result.returncode == 1
    assert f"Error merging override {override}" in result.stderr and message in result.stderr
    assert f"full_key: {override.split('=')[0]}" in result.stderr
    assert not (tmp_path / "run").exists()


def test_an_existing_run_is_never_overwritten_without_resume(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    train_from_config(_config(tiny_overrides(tiny_toy_root, run_dir, **QUIET)))
    before = (run_dir / "model_final.pth").read_bytes()
    with pytest.raises(ConfigError, match="already holds a run"):
        train_from_config(_config(tiny_overrides(tiny_toy_root, run_dir, **QUIET)))
    assert (run_dir / "model_final.pth").read_bytes() == before


def test_resume_applies_or_refuses_each_changed_setting(tiny_toy_root, tmp_path, caplog):
    run_dir = tmp_path / "run"
    train_from_config(_config(tiny_overrides(tiny_toy_root, run_dir, **QUIET)))
    for name in ("model_0000004.pth", "model_final.pth"):
        (run_dir / name).unlink()
    refused = tiny_overrides(tiny_toy_root, run_dir, resume="true", **{"data.train.scales": "[128]", **QUIET})
    with pytest.raises(ConfigError, match=r"data\.train\.scales: \[160\] -> \[128\] \(the training images"):
        train_from_config(_config(refused))
    assert "data.train.scales: [160] -> [128]" in (run_dir / "error.txt").read_text()

    applied = tiny_overrides(tiny_toy_root, run_dir, resume="true", **{"solver.lr": 0.002, **QUIET})
    train_from_config(_config(applied))
    assert "solver.lr: 0.001 -> 0.002" in caplog.text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train_rows] == [1, 2, 3, 4]
    assert train_rows[2]["lr"] == pytest.approx(0.002) and train_rows[3]["lr"] == pytest.approx(0.0002)
    assert "lr: 0.001" in (run_dir / "config.yaml").read_text()  # the original stays ...
    assert "lr: 0.002" in (run_dir / "config_resume_0000002.yaml").read_text()  # ... beside the resume's
    assert not (run_dir / "error.txt").exists()  # the failed attempt's marker goes with success


def test_model_best_is_replaced_only_by_a_better_value_than_the_recorded_one(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    train_from_config(_config(tiny_overrides(tiny_toy_root, run_dir, eval_period=1, **QUIET)))
    # A best evaluation that no resumed evaluation can beat, recorded only in model_best.pth (the
    # checkpoint of iteration 2 predates it).
    marker = {"model": {}, "best": {"value": 2.0, "iteration": 3, "metric": "mAP"}}
    save_checkpoint(marker, run_dir / "model_best.pth")
    before = (run_dir / "model_best.pth").read_bytes()
    for name in ("model_0000004.pth", "model_final.pth"):
        (run_dir / name).unlink()
    summary = train_from_config(
        _config(tiny_overrides(tiny_toy_root, run_dir, resume="true", eval_period=1, **QUIET))
    )
    assert summary["best"]["value"] == 2.0
    assert (run_dir / "model_best.pth").read_bytes() == before


def test_a_failing_evaluation_says_so_in_its_directory(tiny_toy_root, tmp_path):
    out_dir = tmp_path / "eval"
    result = _tool(
        ["tools/eval.py", f"checkpoint={tmp_path / 'missing.pth'}", f"output_dir={out_dir}",
         f"data.root={tiny_toy_root}", "data.num_train=12", "data.num_test=6"]
    )  # fmt: skip
    assert result.returncode == 1
    assert "FileNotFoundError: checkpoint not found" in result.stdout + result.stderr
    assert "checkpoint not found" in (out_dir / "error.txt").read_text()


def test_resume_without_naming_the_run_is_refused():
    with pytest.raises(ConfigError, match="resume=true needs the run to continue: output_dir="):
        train_from_config(_config(["resume=true"]))


def test_a_checkpoint_of_other_classes_is_refused_listing_both(tiny_toy_root, tmp_path):
    from wsod.build import build_model
    from wsod.runs.evaluate import evaluate_from_config

    settings = {"backbone": "resnet18", "width": 0.25, "weights": None, "chunk_size": 8}
    classes = ["cat", "dog", "cow", "bird", "fish"]  # five classes, like the toy set, other names
    metadata = {"model": settings, "method": {"name": "mist"}, "classes": classes}
    save_checkpoint(
        {"model": build_model(settings, 5).state_dict(), "metadata": metadata}, tmp_path / "c.pth"
    )
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="eval",
            overrides=[f"checkpoint={tmp_path / 'c.pth'}", f"output_dir={tmp_path / 'eval'}",
                       f"data.root={tiny_toy_root}", "data.num_train=12", "data.num_test=6"],
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"trained on classes \['cat', .*the test set has \['red_circle'"):
        evaluate_from_config(cfg)
    assert (tmp_path / "eval" / "error.txt").is_file()


def test_an_error_inside_a_loader_worker_is_one_line_naming_the_file(tiny_toy_root, tmp_path):
    toy = tmp_path / "toy"
    shutil.copytree(tiny_toy_root, toy)
    train_ids = (toy / "VOCdevkit/VOC2007/ImageSets/Main/trainval.txt").read_text().split()
    broken = toy / "VOCdevkit/VOC2007/JPEGImages" / f"{train_ids[0]}.jpg"
    broken.write_bytes(broken.read_bytes()[:200])  # truncated: the header reads, the pixels do not
    run_dir = tmp_path / "run"
    # Previews off: they read the first training images in the main process, where the broken one
    # would fail first (one line naming it too, but not the worker's error this test is about).
    extra = {"data.train.num_workers": 1, "solver.max_iter": 12, "pseudo_label_preview.period": 0}
    overrides = tiny_overrides(toy, run_dir, **QUIET, **extra)
    result = _tool(["tools/train.py", *overrides])
    assert result.returncode == 1
    errors = [line for line in result.stdout.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stdout[-3000:]
    assert f"RuntimeError: cannot decode image {broken}" in errors[0]
    assert "(in DataLoader worker process 0)" in errors[0]
    assert "Traceback" not in errors[0] and "Original Traceback" not in result.stdout + result.stderr
    assert "Original Traceback" in (run_dir / "log.txt").read_text()  # the worker's traceback is kept
    assert (run_dir / "error.txt").read_text().startswith(f"RuntimeError: cannot decode image {broken}")


def test_every_test_that_reliability_md_names_exists():
    text = (ROOT / "docs" / "RELIABILITY.md").read_text()
    named = re.findall(r"`([\w/]+\.py)::(\w+)", text)
    assert len(named) > 50
    missing = [
        f"{path}::{name}" for path, name in named if f"def {name}(" not in (ROOT / "tests" / path).read_text()
    ]
    assert not missing, f"docs/RELIABILITY.md names tests that do not exist: {missing}"
