"""tools/gpu_check.sh: its CPU dry run end to end (so that the GPU script cannot rot), and the report
from partial results."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from wsod.benchmarks.gpu_check import _annotation, loss_trend, make_voc_like, write_report
from wsod.data.voc import VOC_CLASSES, VOCDataset, parse_voc_xml

ROOT = Path(__file__).resolve().parents[2]


# About a minute on 2 cores (every benchmark's CPU dry run): slow, to keep the default suite under 10 min.
@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_writes_one_report(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        ["bash", "tools/gpu_check.sh", str(out), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert result.returncode == 0, result.stdout[-2000:] + log[-4000:]
    report = (out / "report.md").read_text()
    assert report.startswith("# GPU check (DRY RUN on CPU")
    for part in ("env", "rois_r50_c4", "rois_compile", "budget_16gb", "data", "train", "eval"):
        assert f"| {part} | ok |" in report, part
    assert "| rois_vgg16 | skipped |" in report
    assert "auto (1 GB) at 8 ROIs: plain autograd" in report and "- auto (1 GB): >= 8" in report
    assert "chunk_size=auto: budget 0.005 GB" in report and "sequential backprop in chunks of" in report
    assert "14 views on 4 images" in report
    assert "## ROI benchmark, torch.compile" in report and "| compile |" in report
    # At most 8 flat files: what the device tool brings back (7 here: VGG16's table is skipped).
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["report.md", "gpu_check.log", "rois_r50_c4.csv", "rois_r50_c4.png", "rois_compile.csv",
         "budget_16gb.csv"]
    )  # fmt: skip
    assert "4 iterations" in report and "loss finite" in report


def test_the_report_says_what_did_not_run_or_timed_out(tmp_path):
    work = tmp_path / "work"
    (work / "rois_r50_c4").mkdir(parents=True)
    (work / "parts.tsv").write_text("env\t0\t3\t30\nrois_r50_c4\t124\t140\t140\ntrain\t1\t20\t110\n")
    (work / "rois_r50_c4" / "results.csv").write_text(
        "strategy,chunk,rois,peak_mb,step_ms,device,model,image_size,dtype,baseline_mb,status\n"
        "plain,,256,1400.0,80.0,NVIDIA H200,r50_c4,600x1000,fp32,300.0,ok\n"
    )
    report = write_report(work, tmp_path / "out").read_text()
    assert "| env | ok | 3 (30) |" in report
    assert "| rois_r50_c4 | TIMED OUT at 140 s |" in report
    assert "| train | FAILED (exit 1, see gpu_check.log) |" in report and "| eval | not run |" in report
    assert "Interrupted; the rows measured before" in report
    assert "plain chunk= fp32 256 ROIs: 1400.0" in report
    assert (tmp_path / "out" / "rois_r50_c4.csv").exists()


def test_loss_trend_compares_the_first_and_last_windows():
    rows = [{"kind": "train", "loss_total": v} for v in (3.0, 2.5, 2.0, 1.9, 1.5, 1.0)]
    trend = loss_trend(rows + [{"kind": "eval", "mAP": 0.1}])
    assert trend["finite"] and trend["decreasing"]
    assert trend["first_mean"] == pytest.approx(2.5) and trend["last_mean"] == pytest.approx(4.4 / 3)
    assert not loss_trend(rows[::-1])["decreasing"]
    assert not loss_trend(rows + [{"kind": "train", "loss_total": float("nan")}])["finite"]
    assert not loss_trend([])["finite"]


def test_generated_voc_data_opens_as_a_voc_dataset(tmp_path):
    files = make_voc_like(tmp_path, size=(50, 40), proposals=30, train_images=3, test_images=2)
    train = VOCDataset(files["devkit"], "2007", "trainval", files["trainval"])
    test = VOCDataset(files["devkit"], "2007", "test", files["test"])
    assert len(train) == 3 and len(test) == 2
    item = train[0]
    assert item["image"].shape[-2:] == (40, 50) and len(item["proposals"]) == 30
    assert item["labels"].sum() >= 1


def test_generated_annotations_read_back_as_the_boxes_written(tmp_path):
    # The xml is 1-based through box_formats.to_one_based; the VOC reader's from_one_based undoes it.
    boxes = np.array([[0, 0, 9, 19], [12, 3, 49, 39]], np.float32)
    path = tmp_path / "000001.xml"
    path.write_bytes(_annotation("000001", (50, 40), boxes, ["cat", "dog"]))
    size, read, labels, difficult = parse_voc_xml(path, {name: i for i, name in enumerate(VOC_CLASSES)})
    assert size == (40, 50) and read.tolist() == boxes.tolist() and not difficult.any()
    assert [VOC_CLASSES[i] for i in labels] == ["cat", "dog"]
    assert "<xmin>1</xmin><ymin>1</ymin><xmax>10</xmax><ymax>20</ymax>" in path.read_text()
