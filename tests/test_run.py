"""Training end to end: tools/train.py and tools/eval.py on CPU, exact resume, DDP with gloo."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tiny_run import tiny_overrides

import wsod.runs.evaluate as evaluate_run
import wsod.runs.prologue as prologue
import wsod.runs.train as train_run
from wsod.build import load_detector
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(args: list[str], timeout: int = 300) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def _config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _eval_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="eval", overrides=overrides)


def test_train_tool_writes_a_complete_run_directory_and_eval_tool_reads_it(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    output = _run(["tools/train.py", *tiny_overrides(tiny_toy_root, run_dir)])
    assert "copypaste: mAP(voc07,iou=0.5)=" in output and "random scores over the same proposals" in output
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.yaml", "log.txt", "metrics.jsonl", "tb", "model_final.pth", "eval"} <= names
    assert {"model_0000002.pth", "model_0000004.pth"} <= names
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train_rows] == [1, 2, 3, 4]
    assert all(r["loss_total"] > 0 and "lr" in r for r in train_rows)
    assert [r["kind"] for r in rows].count("eval") == 1
    assert "iter 4/4" in (run_dir / "log.txt").read_text()
    assert "max_iter: 4" in (run_dir / "config.yaml").read_text()
    report = (run_dir / "eval" / "report.txt").read_text()
    assert "copypaste:" in report and "red_circle" in report
    assert len(list((run_dir / "eval" / "voc_results").glob("comp4_det_test_*.txt"))) == 5

    eval_dir = tmp_path / "eval"
    data = [o for o in tiny_overrides(tiny_toy_root, run_dir) if o.startswith("data.")]
    common = [f"checkpoint={run_dir / 'model_final.pth'}", "progress=false", *data]
    _run(["tools/eval.py", *common, f"output_dir={eval_dir}"])
    fresh = json.loads((eval_dir / "metrics.json").read_text())
    trained = json.loads((run_dir / "eval" / "metrics.json").read_text())
    assert fresh["mAP"] == pytest.approx(trained["mAP"]) and fresh["CorLoc"] == pytest.approx(
        trained["CorLoc"]
    )
    # Reusing them: the same entry in this process (the tool ran above), a fresh interpreter saved.
    reused_dir = tmp_path / "reused"
    evaluate_run.evaluate_from_config(
        _eval_config([*common, f"predictions={eval_dir / 'predictions.pth'}", f"output_dir={reused_dir}"])
    )
    assert "reusing predictions" in (reused_dir / "log.txt").read_text()
    assert json.loads((reused_dir / "metrics.json").read_text())["mAP"] == pytest.approx(fresh["mAP"])


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model_final.pth", weights_only=True)["model"]


# The third variant (about 20 s) is slow: tests/engine/test_balancing.py resumes inside the window too.
@pytest.mark.parametrize(
    "variant",
    ["plain", "dropblock+gradnorm", pytest.param("single_pass+gradnorm_window", marks=pytest.mark.slow)],
)
def test_resumed_run_reaches_the_same_weights(tiny_toy_root, tmp_path, caplog, monkeypatch, variant):
    # With DropBlock the adversary's optimizer state is restored too, and its samples come from the
    # restored RNG stream; with GradNorm its weights, recorded initial losses, Adam state and schedule
    # (the resume at iteration 2 falls after its start in the second variant, inside its baseline
    # window in the third).
    dropblock = variant != "plain"
    extra = {
        "data.test.batch_size": 6, "random_baseline": "false", "model.dropblock": str(dropblock).lower(),
        "solver.gradnorm.enabled": str(dropblock).lower(), "solver.gradnorm.start_iter": 1,
        "solver.gradnorm.window": 1,
    }  # fmt: skip
    if variant == "single_pass+gradnorm_window":
        extra.update({"solver.dropblock.single_pass": "true", "solver.gradnorm.start_iter": 3,
                      "solver.gradnorm.window": 2})  # fmt: skip
    straight = tmp_path / "straight"
    train_from_config(_config(tiny_overrides(tiny_toy_root, straight, **extra)))

    # A run killed during iteration 4: checkpoints of 2 and 3 (the one of 3 left truncated by the kill).
    interrupted = tmp_path / "interrupted"
    shutil.copytree(straight, interrupted)
    for name in ("model_0000004.pth", "model_final.pth", "eval"):
        shutil.rmtree(interrupted / name) if name == "eval" else (interrupted / name).unlink()
    (interrupted / "model_0000003.pth").write_bytes((interrupted / "model_0000002.pth").read_bytes()[:1000])
    loads = []
    real = train_run.latest_valid_checkpoint
    monkeypatch.setattr(
        train_run, "latest_valid_checkpoint", lambda *a, **k: loads.append((a, k)) or real(*a, **k)
    )
    summary = train_from_config(
        _config(tiny_overrides(tiny_toy_root, interrupted, **{**extra, "resume": "true"}))
    )
    assert summary["iteration"] == 4
    assert "skipping unreadable checkpoint" in caplog.text and "resumed from" in caplog.text
    # Loaded to host memory (the default): a GPU map_location would move the RNG states off the CPU.
    assert loads == [((interrupted,), {"trust": False})]
    rows = [json.loads(line) for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]  # 3 logged once
    assert (interrupted / "config.yaml").is_file() and (interrupted / "config_resume_0000002.yaml").is_file()
    ours, reference = _final_weights(interrupted), _final_weights(straight)
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)
    # The interrupted run really diverged from scratch: the weights moved between iterations 2 and 4.
    two = torch.load(interrupted / "model_0000002.pth", weights_only=True)
    assert any(not torch.equal(two["model"][n], v) for n, v in reference.items() if v.is_floating_point())
    assert ("adversary" in two) == ("balancer" in two) == dropblock
    if dropblock:  # the adversarial step moved the DropBlock between iterations 2 and 4
        moved = [n for n, v in reference.items() if "dropblock" in n and not torch.equal(two["model"][n], v)]
        assert moved


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss_total"] for r in rows if r["kind"] == "train"]


# accumulation 2 (23 s) runs with the slow tests: the default suite keeps 1 within its 10 minutes.
@pytest.mark.parametrize("accumulation", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ddp_two_gloo_processes_match_one_process_at_the_same_global_batch(
    tiny_toy_root, tmp_path, accumulation
):
    # GroupNorm in the base: train-mode BatchNorm statistics are per process (no SyncBN), so they would
    # differ between 1 x 2 and 2 x 1 images by design.
    # SGD: AdamW divides by running gradient magnitudes, which turns float32 rounding of near-zero
    # gradients into visible weight differences; SGD keeps weights linear in the gradients.
    # With accumulation 2 each step takes 4 images: 2 processes x 1 image x 2 batches (the first
    # backward under DDP's no_sync) against 1 process x 2 images x 2 batches.
    extra = {
        "model.norm": "gn", "solver.optimizer": "sgd", "solver.lr": 0.01, "random_baseline": "false",
        "solver.accumulation": accumulation,
    }  # fmt: skip
    single = tmp_path / "single"  # the reference, in this process: the same entry as the tool's
    train_from_config(_config(tiny_overrides(tiny_toy_root, single, **{**extra, "solver.ims_per_batch": 2})))
    double = tmp_path / "ddp"
    _run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "tools/train.py",
         *tiny_overrides(tiny_toy_root, double, **{**extra, "solver.ims_per_batch": 1})]
    )  # fmt: skip
    single_losses, ddp_losses = _losses(single), _losses(double)
    assert len(single_losses) == len(ddp_losses) == 4
    # Same images, same seeds: the trajectories agree to float32 rounding (the sums run in another order).
    assert ddp_losses == pytest.approx(single_losses, rel=1e-4)
    torch.testing.assert_close(
        _final_weights(double)["roi_head.body.module.neck.0.conv1.weight"],
        _final_weights(single)["roi_head.body.module.neck.0.conv1.weight"],
        rtol=1e-3, atol=1e-6,
    )  # fmt: skip


def test_eval_under_torchrun_writes_one_directory_and_scores_once(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    short = {"solver.max_iter": 1, "solver.milestones": "[1]", "random_baseline": "false"}
    overrides = tiny_overrides(tiny_toy_root, run_dir, **short)
    train_from_config(_config(overrides))  # the checkpoint to evaluate; torchrun runs the tool below
    data = [o for o in overrides if o.startswith("data.")]
    # No output_dir: rank 0 picks runs/eval/<date>_<time> under the working directory and shares it.
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "tools" / "eval.py"), f"checkpoint={run_dir / 'model_final.pth'}", "progress=false",
         "random_baseline=false", *data],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (eval_dir,) = (tmp_path / "runs" / "eval").iterdir()
    assert json.loads((eval_dir / "metrics.json").read_text()) == pytest.approx(
        json.loads((run_dir / "eval" / "metrics.json").read_text())
    )
    assert result.stdout.count("copypaste:") == 1  # the report is made and logged by rank 0 only


@pytest.mark.parametrize("entry", ["train_from_config", "evaluate_from_config"])
def test_the_process_group_is_left_even_when_the_run_fails(monkeypatch, entry):
    events = []
    module = train_run if entry == "train_from_config" else evaluate_run
    monkeypatch.setattr(module, "setup_distributed", lambda: events.append("setup"))
    monkeypatch.setattr(module, "cleanup_distributed", lambda: events.append("cleanup"))

    def fail(cfg):
        raise RuntimeError("boom")

    monkeypatch.setattr(module, "_train" if entry == "train_from_config" else "_evaluate", fail)
    cfg = _config([]) if entry == "train_from_config" else _eval_config(["checkpoint=x.pth"])
    with pytest.raises(RuntimeError, match="boom"):
        getattr(module, entry)(cfg)
    assert events == ["setup", "cleanup"]


# The method tests below compose the command line's overrides in this process (the tool's own entry,
# tools/train.py, runs in the tests above and in test_summarize_runs' method sweep): a fresh interpreter
# costs about 3 s of imports on 2 cores, and the override is the same words either way.
def test_method_oicr_switches_the_refinement_method_from_the_command_line(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "oicr"
    overrides = tiny_overrides(
        tiny_toy_root, run_dir, **{"method": "oicr", "solver.max_iter": 2, "solver.milestones": "[1]"}
    )
    train_from_config(_config(overrides))
    assert "name: oicr" in (run_dir / "config.yaml").read_text()
    model, metadata = load_detector(run_dir / "model_final.pth")
    method = {"name": "oicr", "num_students": 3, "fg_iou": 0.5, "first_student_loss_weight": 3.0}
    method |= {"mil_std": 0.01, "student_cls_std": 0.01, "student_box_std": 0.001}  # pcl.pytorch's heads
    assert metadata["method"] == method
    assert type(model.labeler).__name__ == "OICRLabeler"


def test_chunk_size_auto_from_the_command_line_logs_its_choice_and_its_checkpoint_evaluates(
    tiny_toy_root, tmp_path
):
    # A budget of about 100 ROIs of this model's neck (0.24 MB per ROI in float32): the toy images'
    # Selective Search proposals (several hundred; all of them, not the tiny run's 32) are chunked.
    run_dir = tmp_path / "auto"
    extra = {"model.chunk_size": "auto", "model.memory_budget_gb": 0.025, "solver.max_iter": 2,
             "solver.milestones": "[1]", "random_baseline": "false",
             "data.train.max_proposals": "null"}  # fmt: skip
    summary = train_from_config(_config(tiny_overrides(tiny_toy_root, run_dir, **extra)))
    assert summary["iteration"] == 2 and all(map(math.isfinite, summary["losses"].values()))
    log = (run_dir / "log.txt").read_text()
    assert "chunk_size=auto: budget 0.025 GB (memory_budget_gb=0.025)" in log
    assert "MB per ROI in float32" in log and "sequential backprop in chunks of" in log
    model, metadata = load_detector(run_dir / "model_final.pth")
    assert metadata["model"]["chunk_size"] == "auto" and model.roi_head.memory_budget_gb == 0.025


def test_every_entry_point_shares_one_setup_that_claims_the_directory_and_leaves_error_txt(tmp_path, caplog):
    cfg = OmegaConf.create({"device": "cpu", "threads": 0})
    seen = []

    def fail(directory, cfg, device):
        raise RuntimeError("boom")

    def refuse(directory, cfg):
        raise ValueError("not this one")

    with pytest.raises(ValueError, match="not this one"):
        prologue.run_in_directory(cfg, str(tmp_path / "refused"), "unused", fail, claim=refuse)
    assert not (tmp_path / "refused").exists()  # refused before anything was written there
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        prologue.run_in_directory(cfg, str(out), "unused", fail)
    assert (out / "error.txt").read_text().startswith("RuntimeError: boom")
    result = prologue.run_in_directory(
        cfg, str(out), "unused", lambda d, c, device: seen.append((d, device)) or "done",
        claim=lambda directory, cfg: f"claimed {directory.name}",
    )  # fmt: skip
    assert result == "done" and seen == [(out, torch.device("cpu"))]
    assert not (out / "error.txt").exists()  # the earlier attempt's marker goes with success
    assert "claimed out" in (out / "log.txt").read_text()


@pytest.mark.parametrize(
    ("method", "loss_names", "students"),
    [("pcl", ["loss_mil", "loss_pcl_1", "loss_pcl_2", "loss_pcl_3"], 3), ("wsddn", ["loss_mil"], 0)],
)
def test_method_pcl_and_wsddn_train_from_the_command_line_and_their_checkpoints_evaluate(
    tiny_toy_root, tmp_path, method, loss_names, students
):
    # python tools/train.py method=pcl / method=wsddn, a few steps on the tiny toy set.
    run_dir = tmp_path / method
    overrides = tiny_overrides(
        tiny_toy_root, run_dir, **{"method": method, "solver.max_iter": 2, "solver.milestones": "[1]"}
    )
    train_from_config(_config(overrides))
    assert "copypaste:" in (run_dir / "log.txt").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if row["kind"] == "train"]
    assert train_rows and all(name in train_rows[-1] for name in loss_names)
    assert not any(key.startswith("loss_ref") for key in train_rows[-1])
    model, metadata = load_detector(run_dir / "model_final.pth")
    assert metadata["method"]["name"] == method and len(model.students) == students
    assert list(model.loss_names) == loss_names
