"""The labelling-time benchmark runs, times what it says and refuses what it cannot time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wsod.benchmarks.labelers import format_table, synthetic_image, time_labeling

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_command_prints_one_row_per_method_and_size():
    command = "python tools/benchmark_labelers.py --proposals 500,2000 --device cpu --repeats 3"
    result = subprocess.run(
        [sys.executable, *command.split()[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "cpu" in line]
    methods = ["mist", "oicr", "pcl", "cbl", "cbl_rcnn"]
    assert [row.split(" | ")[0:3] for row in rows] == [
        [f"| {method}", "cpu", size] for size in ("500", "2000") for method in methods
    ]
    assert all(row.endswith(" |") for row in rows) and rows[0].split(" | ")[-1] == "1.00 |"


def test_synthetic_scores_are_teacher_like_and_the_labels_have_the_asked_positives():
    proposals, scores, targets = synthetic_image(300, 20, 3)
    assert proposals.shape == (300, 4) and (proposals[:, 2:] > proposals[:, :2]).all()
    assert scores.shape == (300, 20) and (scores > 0).all()
    assert (scores.sum(dim=0) <= 1 + 1e-6).all()  # per class at most the detection softmax's total
    assert int(targets["labels"].sum()) == 3


def test_time_labeling_reports_its_repeats_and_refuses_a_method_without_students():
    result = time_labeling("pcl", 200, repeats=2, warmup=1)
    assert result.repeats == 2 and 0 < result.min_ms <= result.median_ms
    assert "| pcl | cpu | 200 | 3 |" in format_table([result])
    with pytest.raises(ValueError, match="'wsddn' trains no students"):
        time_labeling("wsddn", 200)
    with pytest.raises(ValueError, match="unknown method 'pcll'"):
        time_labeling("pcll", 200)
    assert time_labeling("cbl_rcnn", 200, repeats=1, warmup=0).method == "cbl_rcnn"
