"""Method sweeps and their summary: tools/train.py -m gives each job its own run directory, and
tools/summarize_runs.py (wsod/engine/run_summary.py) groups runs by their settings and gives each group's
statistics over its seeds, listing every run it could not use with the reason.

The statistics are checked on fake run directories (config.yaml written with OmegaConf from the real
composed config, metrics.jsonl rows in RunLog's format) against values computed by hand; one tiny sweep
trains for real, end to end, and another reruns a sweep (refused job, resumed job).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict
from PIL import Image
from tiny_run import tiny_overrides

import wsod.runs.prologue as prologue
from wsod.engine.run_summary import (
    SECONDS_COLUMN,
    Stats,
    SummaryError,
    format_copypaste,
    format_markdown,
    plot_summary,
    read_run,
    summarize_runs,
    summary_figure,
    write_summary,
)

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "summarize_runs.py"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
CLASSES = ("red_circle", "green_square")
NAN = math.nan


# -- fake run directories ------------------------------------------------------------------------------


def _composed(overrides: tuple[str, ...]) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="train", overrides=list(overrides)), resolve=True)


_CONFIGS: dict[tuple[str, ...], dict] = {}


def _config(*overrides: str) -> dict:
    """The real composed training config (cached: composing takes a moment)."""
    if overrides not in _CONFIGS:
        _CONFIGS[overrides] = _composed(overrides)
    return json.loads(json.dumps(_CONFIGS[overrides]))  # a copy


def fake_run(
    directory: Path,
    *overrides: str,
    seed: int = 1,
    final: dict | None = None,
    train: Sequence[tuple[int, float]] = ((2, 0.5), (4, 0.5)),
    max_iter: int = 4,
    periodic: dict | None = None,
) -> Path:
    """A run directory as tools/train.py leaves it: ``config.yaml`` (the composed config with ``overrides``,
    ``seed``, ``max_iter`` and ``output_dir``) and ``metrics.jsonl``: train rows (iteration,
    seconds_per_iter), a periodic eval row at iteration 2 (``periodic``) and the final one (``final``:
    mAP, CorLoc and ``AP_<class>`` values; None: no final evaluation)."""
    config = _config(*overrides)
    config.update(seed=seed, output_dir=str(directory))
    config["solver"]["max_iter"] = max_iter
    directory.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(config), directory / "config.yaml")
    rows = []
    for iteration, seconds in train:
        rows.append({"kind": "train", "iteration": iteration, "loss_total": 0.7, "lr": 0.001,
                     "seconds_per_iter": seconds})  # fmt: skip
        if periodic is not None and iteration == 2:
            rows.append({"kind": "eval", "iteration": 2, **periodic})
    if final is not None:
        rows.append(
            {"kind": "eval", "iteration": max_iter, **final, "random_mAP": 0.01, "random_CorLoc": 0.02}
        )
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def evaluation(map_: float, corloc: float, *aps: float) -> dict:
    """An eval row's values as ``Evaluation.values`` holds them (the per-class APs in CLASSES order)."""
    return {"mAP": map_, "CorLoc": corloc, **{f"AP_{c}": ap for c, ap in zip(CLASSES, aps, strict=True)}}


@pytest.fixture
def method_sweep(tmp_path: Path) -> Path:
    """Three MIST seeds and two OICR seeds, finished, as a sweep directory holds them."""
    sweep = tmp_path / "methods"
    fake_run(sweep / "method=mist,seed=1", "method=mist", seed=1, final=evaluation(0.50, 0.40, 0.20, NAN),
             train=[(2, 1.0), (4, 3.0)])  # fmt: skip
    fake_run(sweep / "method=mist,seed=2", "method=mist", seed=2, final=evaluation(0.60, 0.50, 0.40, NAN),
             train=[(1, 1.0), (4, 2.0)])  # fmt: skip
    fake_run(sweep / "method=mist,seed=10", "method=mist", seed=10, final=evaluation(0.70, 0.90, 0.90, NAN),
             train=[(2, 2.0), (4, 2.0)])  # fmt: skip
    fake_run(sweep / "method=oicr,seed=1", "method=oicr", seed=1, final=evaluation(0.30, 0.20, 0.10, 0.50))
    fake_run(sweep / "method=oicr,seed=2", "method=oicr", seed=2, final=evaluation(0.40, 0.30, 0.30, 0.70))
    return sweep


# -- statistics and grouping ---------------------------------------------------------------------------


def test_each_groups_statistics_are_the_hand_computed_ones(method_sweep):
    summary = summarize_runs([method_sweep])
    # Grouped by method.name alone: method.p, method.tau, ... differ too but come with the method.
    assert summary.keys == ("method.name",) and not summary.skipped
    mist, oicr = summary.groups
    assert (mist.label, oicr.label) == ("method.name=mist", "method.name=oicr")
    assert mist.seeds == [1, 2, 10] and oicr.seeds == [1, 2]  # seeds as numbers: 10 after 2
    assert mist.metric("mAP") == pytest.approx(Stats(0.60, 0.50, 0.70, 3, 3))
    assert mist.metric("CorLoc") == pytest.approx(Stats(0.60, 0.40, 0.90, 3, 3))
    assert oicr.metric("mAP") == pytest.approx(Stats(0.35, 0.30, 0.40, 2, 2))
    assert mist.per_class("red_circle") == pytest.approx(Stats(0.50, 0.20, 0.90, 3, 3))
    assert oicr.per_class("green_square") == pytest.approx(Stats(0.60, 0.50, 0.70, 2, 2))
    undefined = mist.per_class("green_square")  # NaN in every run: a class without ground truth
    assert undefined.count == 0 and undefined.total == 3 and math.isnan(undefined.mean)
    # Seconds per step: each train row weighted by the steps it covers, then the mean over the runs:
    # (1*2 + 3*2)/4 = 2.0, (1*1 + 2*3)/4 = 1.75, (2*2 + 2*2)/4 = 2.0 -> 5.75/3.
    assert [r.seconds_per_step for r in mist.runs] == pytest.approx([2.0, 1.75, 2.0])
    assert mist.seconds_per_step.mean == pytest.approx(5.75 / 3)
    assert summary.metric_names == ["mAP", "CorLoc"] and summary.class_names == list(CLASSES)


def test_the_final_evaluation_is_the_row_at_max_iter_not_a_periodic_one(tmp_path):
    run_dir = fake_run(
        tmp_path / "r", final=evaluation(0.6, 0.7, 0.6, 0.6), periodic=evaluation(0.1, 0.1, 0.1, 0.1)
    )
    result = read_run(run_dir)
    assert result.iteration == 4 and result.metrics == {"mAP": 0.6, "CorLoc": 0.7}  # random_* left out
    assert result.per_class == {"red_circle": 0.6, "green_square": 0.6}


def _resumed(run_dir: Path, at: int, **changes: object) -> None:
    """What a resume at iteration ``at`` adds: config_resume_<at>.yaml, with resume=true and ``changes``
    (dotted keys) applied to the run's config."""
    config = OmegaConf.load(run_dir / "config.yaml")
    for key, value in {"resume": True, **changes}.items():
        OmegaConf.update(config, key, value)
    OmegaConf.save(config, run_dir / f"config_resume_{at:07d}.yaml")


def test_a_resumed_run_counts_with_its_newest_configs_settings_and_max_iter(method_sweep):
    resumed = fake_run(
        method_sweep / "method=oicr,seed=3", "method=oicr", seed=3, final=evaluation(0.5, 0.4, 0.5, 0.9)
    )
    _resumed(resumed, 2)  # interrupted at 2, resumed: same settings, resume=true
    assert [g.seeds for g in summarize_runs([method_sweep]).groups] == [[1, 2, 10], [1, 2, 3]]

    extended = method_sweep / "method=oicr,seed=4"  # finished at 4, then resumed with max_iter=6
    fake_run(extended, "method=oicr", seed=4, final=evaluation(0.1, 0.1, 0.1, 0.1))
    _resumed(extended, 4, **{"solver.max_iter": 6})
    with open(extended / "metrics.jsonl", "a") as stream:
        stream.write(json.dumps({"kind": "train", "iteration": 6, "seconds_per_iter": 0.5}) + "\n")
        stream.write(json.dumps({"kind": "eval", "iteration": 6, **evaluation(0.8, 0.8, 0.8, 0.8)}) + "\n")
    result = read_run(extended)
    assert result.iteration == 6 and result.metrics == {"mAP": 0.8, "CorLoc": 0.8}  # not the row at 4
    summary = summarize_runs([method_sweep])
    assert summary.keys == ("method.name", "solver.max_iter")  # a longer schedule is another group
    assert [(g.label, g.seeds) for g in summary.groups][1:] == [
        ("method.name=oicr, solver.max_iter=4", [1, 2, 3]),
        ("method.name=oicr, solver.max_iter=6", [4]),
    ]


def test_runs_are_grouped_by_every_setting_that_differs_except_seed_and_output_dir(tmp_path):
    root = tmp_path / "sweep"
    for lr in (0.01, 0.002):
        for method in ("mist", "oicr"):
            fake_run(root / f"lr={lr},{method}" / "seed=1", f"method={method}", f"solver.lr={lr}",
                     final=evaluation(lr, lr, lr, lr))  # fmt: skip
    summary = summarize_runs([root, root / "lr=0.01,mist"])  # nested runs found; one given twice counts once
    assert summary.keys == ("method.name", "solver.lr") and len(summary.runs) == 4
    assert [g.label for g in summary.groups] == [  # sorted by value, numbers as numbers
        "method.name=mist, solver.lr=0.002",
        "method.name=mist, solver.lr=0.01",
        "method.name=oicr, solver.lr=0.002",
        "method.name=oicr, solver.lr=0.01",
    ]
    merged = summarize_runs([root], ignore=["solver"])  # a whole sub-tree left out of the grouping
    assert [(g.label, len(g.runs)) for g in merged.groups] == [
        ("method.name=mist", 2),
        ("method.name=oicr", 2),
    ]
    alike = summarize_runs([root], ignore=["solver.lr", "method"])
    assert [(g.label, g.seeds) for g in alike.groups] == [("all runs", [1, 1, 1, 1])]


def test_a_method_that_sets_other_keys_is_named_by_its_name(tmp_path):
    # method=cbl also sets model.eval_weights, which comes first in the config: the label is the choice.
    root = tmp_path / "sweep"
    fake_run(root / "cbl", "method=cbl", final=evaluation(0.5, 0.5, 0.5, 0.5))
    fake_run(root / "mist", "method=mist", final=evaluation(0.4, 0.4, 0.4, 0.4))
    summary = summarize_runs([root])
    assert summary.keys == ("method.name",)
    assert [g.label for g in summary.groups] == ["method.name=cbl", "method.name=mist"]


def test_by_folder_keeps_the_runs_of_each_folder_apart(tmp_path):
    # Second-stage runs: each seed on its own pseudo boxes, two export rules whose configs name no rule.
    for folder, maps in (("stage2", (0.5, 0.7)), ("stage2_top1", (0.4, 0.6))):
        for seed, value in enumerate(maps, start=1):
            fake_run(tmp_path / folder / f"seed={seed}", f"solver.lr={0.001 * seed}", seed=seed,
                     final=evaluation(value, value, value, value))  # fmt: skip
    single = fake_run(tmp_path / "stage1" / "seed=1", final=evaluation(0.3, 0.3, 0.3, 0.3))
    folders = [tmp_path / "stage2", tmp_path / "stage2_top1", single]
    summary = summarize_runs(folders, ignore=["solver.lr"], by_folder=True)
    assert [(g.label, g.seeds, g.metric("mAP").mean) for g in summary.groups] == [
        (f"folder={(tmp_path / 'stage1').as_posix()}", [1], pytest.approx(0.3)),  # a run given: its parent
        (f"folder={(tmp_path / 'stage2').as_posix()}", [1, 2], pytest.approx(0.6)),
        (f"folder={(tmp_path / 'stage2_top1').as_posix()}", [1, 2], pytest.approx(0.5)),
    ]
    assert [g.label for g in summarize_runs(folders, ignore=["solver.lr"]).groups] == ["all runs"]


def test_a_train_set_setting_groups_by_its_command_line_name(tmp_path):
    root = tmp_path / "sweep"
    for partial in ("null", "data/toy/partial/points.json"):
        for seed in (1, 2):
            fake_run(root / f"p={partial.replace('/', '_')},seed={seed}",
                     f"data.train.sets.0.partial_labels={partial}", seed=seed,
                     final=evaluation(1.0, 1.0, 1.0, 1.0))  # fmt: skip
    summary = summarize_runs([root])
    assert summary.keys == ("data.train.sets.0.partial_labels",)
    assert sorted((g.label, g.seeds) for g in summary.groups) == [
        ("data.train.sets.0.partial_labels=data/toy/partial/points.json", [1, 2]),
        ("data.train.sets.0.partial_labels=null", [1, 2]),
    ]


# -- skipped runs and errors ---------------------------------------------------------------------------


def test_runs_without_a_final_evaluation_are_listed_with_the_reason_never_dropped(method_sweep):
    fake_run(method_sweep / "training", "method=mist", seed=3, train=[(2, 0.5)], max_iter=4)
    fake_run(method_sweep / "periodic_only", "method=mist", seed=4, periodic=evaluation(0.9, 0.9, 0.9, 0.9))
    failed = fake_run(method_sweep / "failed", "method=oicr", seed=3)
    (failed / "error.txt").write_text("NonFiniteLossError: 10 non-finite losses in a row\n\nTraceback ...\n")
    evaluating = fake_run(method_sweep / "evaluating", "method=oicr", seed=4)
    (evaluating / "model_final.pth").write_bytes(b"")
    (method_sweep / "method=pcl,seed=1").mkdir()  # a sweep job that stopped before its run started
    broken = fake_run(method_sweep / "broken", final=evaluation(0.5, 0.5, 0.5, 0.5))
    (broken / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1}\n{"kind": "tr\n' + "{}\n")
    partial = fake_run(method_sweep / "writing_a_row", seed=5, final=evaluation(0.5, 0.5, 0.5, 0.5))
    with open(partial / "metrics.jsonl", "a") as stream:
        stream.write('{"kind": "eval", "iteration": 4, "mA')  # being written: the run still counts
    (method_sweep / "no_config").mkdir()
    (method_sweep / "no_config" / "metrics.jsonl").write_text("")

    summary = summarize_runs([method_sweep])
    reasons = {s.directory.name: s.reason for s in summary.skipped}
    assert reasons == {
        "broken": "metrics.jsonl line 2 is not JSON (Unterminated string starting at)",
        "evaluating": "trained (model_final.pth), but no final evaluation in metrics.jsonl: evaluating, or"
        " stopped",
        "failed": "failed (error.txt): NonFiniteLossError: 10 non-finite losses in a row",
        "method=pcl,seed=1": "empty directory: nothing was written (a sweep job that failed before its run"
        " started? the sweep's console output says why)",
        "no_config": "no config.yaml: not a run that tools/train.py started",
        "periodic_only": "no final evaluation: logged up to iteration 4 of 4 (still training, or stopped)",
        "training": "no final evaluation: logged up to iteration 2 of 4 (still training, or stopped)",
    }
    assert len(summary.runs) == 6 and "writing_a_row" in {r.directory.name for r in summary.runs}
    text = format_markdown(summary)
    assert "## Skipped runs (7)" in text and "; 7 skipped." in text
    assert f"- `{method_sweep / 'training'}`: no final evaluation: logged up to iteration 2 of 4" in text


def test_a_directory_without_runs_is_an_error_naming_it(tmp_path, method_sweep):
    empty, unrelated, missing = tmp_path / "empty", tmp_path / "unrelated", tmp_path / "missing"
    empty.mkdir()
    (unrelated / "eval").mkdir(parents=True)
    (unrelated / "eval" / "metrics.json").write_text("{}")  # tools/eval.py's output is not a run
    for directory in (empty, unrelated):
        with pytest.raises(SummaryError, match=f"^{re.escape(str(directory))} holds no run directory"):
            summarize_runs([method_sweep, directory])
    with pytest.raises(SummaryError, match=f"^{re.escape(str(missing))} is not a directory"):
        summarize_runs([missing])


def test_with_no_finished_run_nothing_is_written_and_the_command_fails_after_listing_them(tmp_path):
    sweep = tmp_path / "sweep"
    fake_run(sweep / "method=mist,seed=1", "method=mist", train=[(2, 0.5)])
    summary = summarize_runs([sweep])
    assert not summary.groups and len(summary.skipped) == 1
    with pytest.raises(
        SummaryError, match=re.escape(f"no run under {sweep} has a final evaluation (1 skipped")
    ):
        write_summary(summary, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = subprocess.run(
        [sys.executable, str(TOOL), str(sweep)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "no final evaluation: logged up to iteration 2 of 4" in result.stdout  # listed first
    assert result.stderr.strip().splitlines() == [
        f"error: SummaryError: no run under {sweep} has a final evaluation (1 skipped, each with its reason"
        " above): nothing to summarise yet"
    ]


# -- what is written -----------------------------------------------------------------------------------


def test_summary_md_holds_the_tables_and_copypaste_lines_and_summary_png_is_a_readable_image(method_sweep):
    summary = summarize_runs([method_sweep])
    markdown, plot = write_summary(summary, method_sweep)
    text = markdown.read_text()
    assert text == format_markdown(summary)
    header = "| group | runs | seeds | mAP mean | mAP min | mAP max | CorLoc mean | CorLoc min | CorLoc max |"
    assert f"{header} {SECONDS_COLUMN} |" in text
    assert (
        "| method.name=mist | 3 | 1, 2, 10 | 60.00 | 50.00 | 70.00 | 60.00 | 40.00 | 90.00 | 1.917 |" in text
    )
    assert "| method.name=oicr | 2 | 1, 2 | 35.00 | 30.00 | 40.00 | 25.00 | 20.00 | 30.00 | 0.500 |" in text
    assert "| class | method.name=mist | method.name=oicr |" in text
    assert "| red_circle | 50.00 [20.00, 90.00] | 20.00 [10.00, 30.00] |" in text
    assert "| green_square | - | 60.00 [50.00, 70.00] |" in text
    mist, oicr = summary.groups
    assert format_copypaste(mist) == (
        "copypaste: method.name=mist, 3 runs (seeds 1,2,10), mean mAP(voc07,iou=0.5)=60.00, CorLoc=60.00,"
        " per-class AP: 50.00,nan"
    )
    assert f"```\n{format_copypaste(mist)}\n{format_copypaste(oicr)}\n```" in text
    assert "## Skipped runs (0)\n\nNone." in text
    with Image.open(plot) as image:
        image.load()
        assert image.format == "PNG" and image.width > 400 and image.height > 300


def _tool():
    """tools/summarize_runs.py as a module (its main() takes the arguments)."""
    spec = importlib.util.spec_from_file_location("summarize_runs_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_prints_the_summary_and_writes_it_into_out_or_else_the_first_directory(
    method_sweep, tmp_path, capsys
):
    tool = _tool()
    assert tool.main([str(method_sweep), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(format_markdown(summarize_runs([method_sweep])))
    assert printed.endswith(
        f"written: {tmp_path / 'out' / 'summary.md'}, {tmp_path / 'out' / 'summary.png'}\n"
    )
    assert not (method_sweep / "summary.md").exists()
    assert tool.main([str(method_sweep)]) == 0  # no --out: into the (first) directory summarised
    assert {p.name for p in method_sweep.iterdir()} >= {"summary.md", "summary.png"}


# -- Hydra multirun: each job's run directory ----------------------------------------------------------


@pytest.fixture
def hydra_job():
    """Sets HydraConfig as a job of a sweep would see it (``compose(..., return_hydra_config=True)``)."""
    saved = HydraConfig.instance().cfg

    def job(*overrides: str, mode: RunMode = RunMode.MULTIRUN) -> None:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.mode = mode
        HydraConfig.instance().set_config(cfg)

    yield job
    HydraConfig.instance().cfg = saved


def test_a_sweep_job_runs_in_its_own_directory_unless_output_dir_is_given(hydra_job, tmp_path):
    hydra_job("method=oicr", "seed=2", "resume=true", f"hydra.sweep.dir={tmp_path / 'methods'}")
    # Sorted overrides, resume left out (a rerun with resume=true finds the run), hydra.* too.
    assert prologue.sweep_job_dir() == str(tmp_path / "methods" / "method=oicr,seed=2")
    assert prologue.choose_output_dir(None, "runs", sweep=True) == tmp_path / "methods" / "method=oicr,seed=2"
    assert prologue.choose_output_dir(str(tmp_path / "mine"), "runs", sweep=True) == tmp_path / "mine"
    parent = tmp_path / "runs"
    assert prologue.choose_output_dir(None, str(parent)).parent == parent  # eval and predict: as before
    hydra_job("method=oicr", mode=RunMode.RUN)  # python tools/train.py without -m: runs/<date>_<time>
    assert prologue.sweep_job_dir() is None
    assert prologue.choose_output_dir(None, str(parent), sweep=True).parent == parent


def test_the_default_sweep_directory_is_under_runs_multirun(hydra_job):
    hydra_job("seed=1", "method=mist")
    directory = Path(prologue.sweep_job_dir())
    assert directory.name == "method=mist,seed=1" and directory.parent.parent == Path("runs/multirun")


# -- end to end ----------------------------------------------------------------------------------------


def _sweep(root: Path, sweep_dir: Path, *arguments: str) -> subprocess.CompletedProcess:
    """tools/train.py -m on the tiny toy data, 2 steps per job. The tiny run's fixed settings are
    overrides too: they are left out of the jobs' directory names, as a user may (the sweep's own keys
    name them)."""
    short = {
        "solver.max_iter": 2,
        "solver.warmup_iters": 1,
        "solver.milestones": "[]",
        "random_baseline": "false",
    }
    fixed = {o.split("=", 1)[0]: o for o in tiny_overrides(root, Path("."), **short)}
    fixed.pop("output_dir")  # the sweep's to choose
    exclude = ",".join(["resume", *fixed])
    command = [
        sys.executable, str(ROOT / "tools" / "train.py"), "-m", *fixed.values(), *arguments,
        f"hydra.sweep.dir={sweep_dir}", f"hydra.job.config.override_dirname.exclude_keys=[{exclude}]",
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def _usage_command() -> str:
    """The command the tool's usage docstring shows (tests/test_readme.py collects it from there)."""
    docstring = ast.get_docstring(ast.parse(TOOL.read_text()))
    (command,) = [line.strip() for line in docstring.splitlines() if line.strip().startswith("python tools/")]
    return command


def test_a_method_sweep_trains_each_job_in_its_directory_and_the_summary_compares_them(
    tiny_toy_root, tmp_path
):
    sweep_dir = tmp_path / "runs" / "methods"
    result = _sweep(tiny_toy_root, sweep_dir, "method=mist,oicr", "seed=1,2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    names = sorted(p.name for p in sweep_dir.iterdir())
    # Hydra writes nothing of its own: no multirun.yaml, no .hydra/ (hydra.output_subdir: null).
    assert names == ["method=mist,seed=1", "method=mist,seed=2", "method=oicr,seed=1", "method=oicr,seed=2"]
    for name in names:
        run_dir = sweep_dir / name
        config = OmegaConf.load(run_dir / "config.yaml")
        # output_dir stays null, as in a run without -m: the sweep chose the directory.
        assert config.output_dir is None and name == f"method={config.method.name},seed={config.seed}"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["kind"] == "eval" and rows[-1]["iteration"] == 2 and "mAP" in rows[-1]
        assert not list(run_dir.rglob(".hydra"))
        assert "sweep job #" in (run_dir / "log.txt").read_text()

    words = shlex.split(_usage_command())  # word for word, from the directory that holds runs/methods
    assert words[2:] == ["runs/methods"]
    summary = subprocess.run(
        [sys.executable, str(ROOT / words[1]), *words[2:]], cwd=tmp_path, env=ENV, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert summary.returncode == 0, summary.stdout[-3000:] + summary.stderr[-3000:]
    assert "4 runs with a final evaluation in 2 groups, told apart by method.name" in summary.stdout
    lines = [line for line in summary.stdout.splitlines() if line.startswith("copypaste: ")]
    assert [line.split(", mean ")[0] for line in lines] == [
        "copypaste: method.name=mist, 2 runs (seeds 1,2)",
        "copypaste: method.name=oicr, 2 runs (seeds 1,2)",
    ]
    assert {p.name for p in sweep_dir.iterdir()} >= {"summary.md", "summary.png"}


@pytest.mark.slow  # three tiny sweeps (about 30 s): keeps the default suite under its 10 minutes
def test_a_sweep_rerun_refuses_finished_jobs_goes_on_with_the_others_and_resumes_with_resume_true(
    tiny_toy_root, tmp_path
):
    sweep_dir = tmp_path / "sweep"
    assert _sweep(tiny_toy_root, sweep_dir, "seed=1").returncode == 0
    # Rerun with one more seed, first: the new job trains, then the finished one is refused with its one
    # line (on the console, not in the log of the job before it), and the command fails naming it.
    result = _sweep(tiny_toy_root, sweep_dir, "seed=2,1")
    assert result.returncode == 1
    refused = f"error: ConfigError: {sweep_dir / 'seed=1'} already holds a run (checkpoints up to"
    assert refused in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"error: 1 of 2 sweep jobs failed (their errors above): #1 {sweep_dir / 'seed=1'}"
    )
    assert (sweep_dir / "seed=2" / "model_final.pth").is_file()
    assert "already holds a run" not in (sweep_dir / "seed=2" / "log.txt").read_text()
    # resume=true continues each job's run in the same directory (resume is not part of its name).
    result = _sweep(tiny_toy_root, sweep_dir, "seed=1", "resume=true")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["seed=1", "seed=2"]
    assert "resumed from" in (sweep_dir / "seed=1" / "log.txt").read_text()


def test_the_on_a_part_column_and_the_labels_of_many_groups_that_do_not_overlap(tmp_path):
    """Issue 54, item 6: the evaluation's on_part mean is a column named as the report names it, and the
    plot's group labels stay apart for 8+ groups (their drawn boxes measured)."""
    sweep = tmp_path / "many"
    for n, method in enumerate(("mist", "oicr", "pcl")):
        for lr in ("0.001", "0.002", "0.004"):
            final = {**evaluation(0.5, 0.4, 0.2, 0.3), "on_part": 0.1 * (n + 1)}
            fake_run(sweep / f"{method}_{lr}", f"method={method}", f"solver.lr={lr}", final=final)
    summary = summarize_runs([sweep])
    assert len(summary.groups) == 9
    text = format_markdown(summary)
    assert "| on a part mean | on a part min | on a part max |" in text
    assert "| 10.00 | 10.00 | 10.00 |" in text  # the MIST groups' on_part, in percent
    figure = summary_figure(summary)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    panels = figure.get_axes()
    assert [axes.get_title() for axes in panels] == ["mAP", "CorLoc", "on a part"]
    for axes in panels:
        labels = axes.get_xticklabels()
        assert len(labels) == 9 and {label.get_rotation() for label in labels} == {45.0}
        ticks = [axes.transData.transform((x, 0))[0] for x in axes.get_xticks()]
        spacing = min(b - a for a, b in zip(ticks, ticks[1:], strict=False))
        for label in labels:  # parallel labels at 45 degrees, one tick apart: sin(45) x spacing between
            label.set_rotation(0)  # them, which must exceed a label's own height (all its lines)
            height = label.get_window_extent(renderer).height
            label.set_rotation(45)
            assert spacing * math.sin(math.radians(45)) > height, (label.get_text(), spacing, height)
        boxes = [label.get_window_extent(renderer) for label in labels]
        assert all(box.y1 <= axes.get_window_extent(renderer).y0 + 1 for box in boxes)  # under the panel
        assert all(box.x0 >= 0 and box.y0 >= 0 for box in boxes)  # inside the figure
    plot_summary(summary, tmp_path / "s.png")
    with Image.open(tmp_path / "s.png") as image:
        assert image.format == "PNG"
