"""The second stage end to end on the tiny toy set: the guide's pipeline (docs/guides/second_stage.md:
train -> export -> train stage 2 -> eval) word for word with a short schedule, the exported json's
guarantees, tools/predict.py on a second-stage checkpoint, and an exact resume of a second-stage run."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch
from guide_pipeline import ENTRY_POINTS, compose_config, guide_block, run_under_torchrun, short_overrides
from pycocotools.coco import COCO
from tiny_run import TINY_TOY

import wsod.engine.train as train_module
from wsod.config_checks import ConfigError
from wsod.data.toy import ensure_toy_dataset
from wsod.engine.interrupt import TrainingInterrupted
from wsod.engine.train import NonFiniteLossError
from wsod.runs.export import export_from_config
from wsod.runs.predict import predict_from_config
from wsod.runs.stage2 import train_stage2_from_config

ROOT = Path(__file__).resolve().parents[1]
_short, _compose = short_overrides, compose_config


@pytest.fixture
def pipeline(guide_pipeline):
    return guide_pipeline


def test_the_readme_pipeline_runs_word_for_word_with_a_short_schedule(pipeline):
    workdir, (stage1, export, stage2, evaluation) = pipeline
    assert [shlex.split(c)[1] for c in guide_block(0)] == list(ENTRY_POINTS)[:4]
    run_dir = workdir / "runs" / "toy_stage2"
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.yaml", "log.txt", "metrics.jsonl", "tb", "model_final.pth", "eval"} <= names
    assert {"model_0000002.pth", "model_0000004.pth"} <= names
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train_rows] == [1, 2, 3, 4]
    assert {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"} <= set(train_rows[0])
    assert "copypaste: mAP(voc07,iou=0.5)=" in (run_dir / "eval" / "report.txt").read_text()
    assert stage2["iteration"] == 4 and "mAP" in stage2["final"]
    # tools/eval.py on the second-stage checkpoint: the numbers its training's final evaluation gave.
    assert evaluation["mAP"] == pytest.approx(stage2["final"]["mAP"])
    assert evaluation["CorLoc"] == pytest.approx(stage2["final"]["CorLoc"])
    assert export["images"] == TINY_TOY["num_train"] and stage1["iteration"] == 4
    assert "pseudo_labels" in (workdir / "runs" / "toy_stage2" / "config.yaml").read_text()


def test_the_exported_json_loads_and_holds_a_box_for_every_label_and_only_for_labels(pipeline, tiny_toy_root):
    workdir, _ = pipeline
    out = workdir / "runs" / "toy_stage1" / "pseudo_labels"
    coco = COCO(str(out / "pseudo_labels.json"))
    summary = json.loads((out / "summary.json").read_text())
    assert {"images", "boxes", "boxes_per_image", "boxes_per_class", "quality"} <= set(summary)
    assert 0 <= summary["quality"]["precision"] <= 1 and 0 <= summary["quality"]["recall"] <= 1
    toy = ensure_toy_dataset(tiny_toy_root, **TINY_TOY).dataset("trainval")
    root = Path(coco.dataset["info"]["images_root"])
    by_name = {Path(r.path).name: r for r in toy.records}
    assert len(coco.imgs) == len(toy.records)
    for image_id, image in coco.imgs.items():
        record = by_name[image["file_name"]]
        assert (root / image["file_name"]).resolve() == Path(record.path).resolve()  # the source image
        assert image_id == int(record.image_id) and image["source_id"] == record.image_id
        annotations = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
        classes = {a["category_id"] - 1 for a in annotations}
        assert classes == set(torch.nonzero(torch.as_tensor(record.labels)).flatten().tolist())
        for a in annotations:
            x, y, w, h = a["bbox"]
            assert min(x, y, w, h) >= 0 and x + w <= record.width - 1 and y + h <= record.height - 1
    results = coco.loadRes(
        [{"image_id": next(iter(coco.imgs)), "category_id": 1, "bbox": [0, 0, 4, 4], "score": 1.0}]
    )
    assert len(results.anns) == 1


def test_an_export_does_not_overwrite_an_earlier_one_unless_asked(pipeline, tiny_toy_root):
    workdir, _ = pipeline
    checkpoint = workdir / "runs" / "toy_stage1" / "model_final.pth"
    overrides = [f"checkpoint={checkpoint}", *_short(tiny_toy_root, "export")]
    with pytest.raises(ConfigError, match="pseudo_labels.json exists: overwrite=true replaces it"):
        export_from_config(_compose("export", overrides))
    # min_score 1 and no containment step: exactly one box per image label.
    other = workdir / "other_export"
    rule = ["rule.min_score=1.0", "rule.containment=null"]
    one_box = export_from_config(_compose("export", [*overrides, f"output_dir={other}", *rule]))
    toy = ensure_toy_dataset(tiny_toy_root, **TINY_TOY).dataset("trainval")
    assert one_box["boxes"] == int(sum(r.labels.sum() for r in toy.records))
    # A second-stage checkpoint exports too, here at two views (each image and its flip, merged by NMS).
    stage2 = workdir / "runs" / "toy_stage2" / "model_final.pth"
    views = [f"checkpoint={stage2}", f"output_dir={workdir / 'from_stage2'}", "data.test.flip=true"]
    again = export_from_config(_compose("export", [*overrides[1:], *views]))
    assert again["images"] == TINY_TOY["num_train"] and again["boxes"] >= one_box["boxes"]
    assert "views [160] + flips" in (workdir / "from_stage2" / "log.txt").read_text()
    with pytest.raises(ConfigError, match=r"rule.containment_exempt=\['lion'\]"):
        export_from_config(
            _compose("export", [*overrides, "overwrite=true", "rule.containment_exempt=[lion]"])
        )


def test_a_ground_truth_export_holds_every_annotated_box_but_the_difficult_ones(tiny_toy_root, tmp_path):
    out = tmp_path / "true_boxes"
    overrides = ["ground_truth=true", f"output_dir={out}", *_short(tiny_toy_root, "export")]
    summary = export_from_config(_compose("export", overrides))
    toy = ensure_toy_dataset(tiny_toy_root, **TINY_TOY).dataset("trainval")
    coco = COCO(str(out / "pseudo_labels.json"))
    assert len(coco.imgs) == len(toy.records) == summary["images"]
    for record in toy.records:  # a naive reference: the record's own annotation, box by box
        annotations = coco.loadAnns(coco.getAnnIds(imgIds=[int(record.image_id)]))
        kept = [i for i in range(len(record.gt_labels)) if not record.gt_difficult[i]]
        assert sorted(a["category_id"] - 1 for a in annotations) == sorted(record.gt_labels[kept].tolist())
        written = sorted(tuple(a["bbox"]) for a in annotations)
        expected = sorted((x1, y1, x2 - x1, y2 - y1) for x1, y1, x2, y2 in record.gt_boxes[kept].tolist())
        assert written == pytest.approx(expected)
        assert all(a["score"] == 1.0 for a in annotations)
    assert summary["quality"]["precision"] == 1.0 and summary["quality"]["recall"] == 1.0


def test_an_export_takes_its_boxes_from_exactly_one_source(tiny_toy_root, tmp_path):
    data = _short(tiny_toy_root, "export")
    with pytest.raises(ConfigError, match="checkpoint=null: name a trained run's checkpoint"):
        export_from_config(_compose("export", data))
    with pytest.raises(ConfigError, match="with ground_truth=true: the boxes come from one of them"):
        export_from_config(_compose("export", ["ground_truth=true", "checkpoint=x.pth", *data]))
    with pytest.raises(ConfigError, match="output_dir=null with ground_truth=true: name the folder"):
        export_from_config(_compose("export", ["ground_truth=true", *data]))


def test_predict_takes_a_second_stage_checkpoint_without_selective_search(
    pipeline, tiny_toy_root, tmp_path, caplog
):
    workdir, _ = pipeline
    images = tmp_path / "images"
    images.mkdir()
    for record in ensure_toy_dataset(tiny_toy_root, **TINY_TOY).dataset("test").records[:2]:
        shutil.copy(record.path, images)
    cfg = _compose(
        "predict",
        [f"checkpoint={workdir / 'runs' / 'toy_stage2' / 'model_final.pth'}", f"input={images}",
         f"output={tmp_path / 'out'}", "score_threshold=0.0", "progress=false"],
    )  # fmt: skip
    summary = predict_from_config(cfg)
    assert summary["images"] == 2
    assert "its own region proposals" in caplog.text and "Selective Search" not in caplog.text
    predictions = json.loads((tmp_path / "out" / "predictions.json").read_text())
    assert all(0 <= p["category_id"] - 1 < 5 for p in predictions)


def test_a_second_stage_run_stopped_by_ctrl_c_resumes_to_the_same_weights(
    pipeline, tiny_toy_root, tmp_path, monkeypatch
):
    workdir, _ = pipeline
    pseudo = workdir / "runs" / "toy_stage1" / "pseudo_labels" / "pseudo_labels.json"
    base = [f"pseudo_labels={pseudo}", *_short(tiny_toy_root, "stage2"), "random_baseline=false"]
    straight = tmp_path / "straight"
    train_stage2_from_config(_compose("stage2", [*base, f"output_dir={straight}"]))

    logged = train_module._log_step

    def log_then_press_ctrl_c(run_log, bar, iteration, *rest):
        logged(run_log, bar, iteration, *rest)
        if iteration == 3:  # off the checkpoint period (2): the stop saves its own checkpoint
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(train_module, "_log_step", log_then_press_ctrl_c)
    interrupted = tmp_path / "interrupted"
    with pytest.raises(TrainingInterrupted, match="after iteration 3/4: saved"):
        train_stage2_from_config(_compose("stage2", [*base, f"output_dir={interrupted}"]))
    assert (interrupted / "model_0000003.pth").is_file() and not (interrupted / "model_final.pth").exists()
    monkeypatch.undo()
    summary = train_stage2_from_config(
        _compose("stage2", [*base, f"output_dir={interrupted}", "resume=true"])
    )
    assert summary["iteration"] == 4
    ours = torch.load(interrupted / "model_final.pth", weights_only=True)
    reference = torch.load(straight / "model_final.pth", weights_only=True)["model"]
    assert ours["metadata"]["architecture"] == "faster_rcnn"
    for name, value in reference.items():
        torch.testing.assert_close(ours["model"][name], value, rtol=0, atol=0, msg=name)
    two = torch.load(interrupted / "model_0000002.pth", weights_only=True)["model"]
    assert any(not torch.equal(two[n], v) for n, v in reference.items() if v.is_floating_point())
    with pytest.raises(ConfigError, match="detector.fpn_channels: 16 -> 32"):
        train_stage2_from_config(
            _compose(
                "stage2", [*base, f"output_dir={interrupted}", "resume=true", "detector.fpn_channels=32"]
            )
        )


@pytest.mark.slow
def test_the_second_stage_trains_under_torchrun_with_two_gloo_processes(pipeline, tiny_toy_root, tmp_path):
    """DDP: two processes of one image each write one run directory, log every step once, and evaluate
    once (the losses differ from one process's: RPN and box sampling draw per process, and train-mode
    BatchNorm normalises per process)."""
    workdir, _ = pipeline
    pseudo = workdir / "runs" / "toy_stage1" / "pseudo_labels" / "pseudo_labels.json"
    run_dir = tmp_path / "ddp"
    overrides = [f"pseudo_labels={pseudo}", f"output_dir={run_dir}", "solver.ims_per_batch=1"]
    run_under_torchrun("tools/train_stage2.py", [*overrides, *_short(tiny_toy_root, "stage2")], run_dir)


def test_a_diverging_second_stage_run_is_stopped_by_the_non_finite_guard(pipeline, tiny_toy_root, tmp_path):
    workdir, _ = pipeline
    pseudo = workdir / "runs" / "toy_stage1" / "pseudo_labels" / "pseudo_labels.json"
    overrides = [
        f"pseudo_labels={pseudo}", *_short(tiny_toy_root, "stage2"), f"output_dir={tmp_path / 'run'}",
        "solver.optimizer=sgd", "solver.lr=1e12", "solver.max_iter=8", "solver.milestones=[7]",
        "max_nonfinite=2",
    ]  # fmt: skip
    with pytest.raises(NonFiniteLossError, match="training stopped") as error:
        train_stage2_from_config(_compose("stage2", overrides))
    assert "Lower solver.lr" in str(error.value)
    assert (tmp_path / "run" / "error.txt").is_file()
