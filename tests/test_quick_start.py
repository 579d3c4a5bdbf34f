"""The quick start's sentence: which commands count as the quick start, what the sentence says inside and
outside the measured range, and where it lands in the final report (right after the ``copypaste:`` line).
The default run itself prints it in the slow test of tests/test_readme.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from wsod.runs import quick_start
from wsod.runs.quick_start import QUICK_START_MAP_RANGE, is_quick_start, quick_start_sentence
from wsod.runs.train import _quick_start_note, insert_after_copypaste

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "overrides",
    [[], ["seed=3"], ["seed=4", "threads=1"], ["output_dir=runs/a", "resume=true"], ["progress=false"]],
)
def test_the_seed_threads_and_where_the_run_goes_keep_the_quick_start(overrides):
    assert is_quick_start(overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=pcl"],
        ["seed=3", "solver.max_iter=200"],
        ["data.train.min_proposal_size=2"],
        ["+model.extra=1"],
        ["~solver.gradnorm"],
        ["experiment=mist_r50-c4_voc07_1gpu"],
    ],
)
def test_any_other_override_is_another_experiment(overrides):
    assert not is_quick_start(overrides)


def test_the_sentence_says_whether_the_run_is_inside_the_measured_range(monkeypatch):
    monkeypatch.setattr(quick_start, "QUICK_START_MAP_RANGE", (80.0, 90.0))
    inside = quick_start_sentence(85.123)
    assert "mAP 80 to 90" in inside and "85.12 is inside that range." in inside
    for edge in (80.0, 90.0):
        assert "inside that range" in quick_start_sentence(edge)
    outside = quick_start_sentence(79.99)
    assert "79.99 is outside that range" in outside and "inside" not in outside
    assert outside.count(".") >= 1 and "\n" not in outside  # one sentence, one line


def test_the_measured_range_is_a_range_of_percent():
    low, high = QUICK_START_MAP_RANGE
    assert 0 <= low < high <= 100


def test_the_sentence_follows_the_copypaste_line():
    report = "class AP\nmean 1\ncopypaste: mAP(voc07,iou=0.5)=80.00\nrandom scores over the same proposals"
    lines = insert_after_copypaste(report, "the sentence.").split("\n")
    assert lines[2].startswith("copypaste:") and lines[3] == "the sentence." and lines[4].startswith("random")
    assert insert_after_copypaste("no such line", "s.") == "no such line\ns."


@pytest.fixture
def hydra_command():
    """Sets HydraConfig as tools/train.py with these overrides would see it."""
    saved = HydraConfig.instance().cfg

    def command(*overrides: str) -> None:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)

    yield command
    HydraConfig.instance().cfg = saved


def test_tools_train_prints_the_sentence_for_the_quick_start_only(hydra_command):
    hydra_command("seed=2", "threads=1")
    note = _quick_start_note()
    assert note is not None
    assert note({"mAP": 0.8512}).startswith("quick start:") and "85.12" in note({"mAP": 0.8512})
    hydra_command("seed=2", "method=oicr")
    assert _quick_start_note() is None


def test_the_readme_and_the_results_state_the_range_the_tool_prints():
    low, high = QUICK_START_MAP_RANGE
    stated = f"**{low:.0f} to {high:.0f} mAP**"
    assert stated in (ROOT / "README.md").read_text()
    assert stated in (ROOT / "docs" / "RESULTS.md").read_text()
