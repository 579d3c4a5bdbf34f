"""Compare finished training runs: read their directories, group the runs by their settings and give each
group's statistics over its runs (usually its seeds), as markdown tables, ``copypaste:`` lines and a plot.
tools/summarize_runs.py is the command line.

**A run directory** holds ``config.yaml``, the resolved config ``wsod.runs`` writes, and ``metrics.jsonl``
(``wsod.engine.run_log.RunLog``): ``train`` rows every ``log_period`` steps, with ``seconds_per_iter``,
and ``eval`` rows holding an evaluation's values (``wsod.engine.evaluate.Evaluation.values``): its
metrics (``mAP`` and ``CorLoc``; ``AP``, ``AP50``, ... for COCO; ``cls_mAP`` on a test set without
boxes), its per-class values (``AP_<class>``, or ``cls_AP_<class>``) and the random baseline
(``random_<metric>``, left out here). The final evaluation is the ``eval`` row at ``solver.max_iter``:
periodic evaluations only run before it (``wsod.engine.train``), and of a finished run resumed again (two
rows there) the last counts. A resumed run's settings are those of its newest
``config_resume_<iteration>.yaml``, the ones its last part (and the final evaluation) ran with.

Every directory under the given ones that holds ``config.yaml`` or ``metrics.jsonl``, or nothing at all
(what a sweep job that failed before its run started leaves: Hydra makes the job directories), is a run;
one without a final evaluation (still training, stopped, crashed: its ``error.txt`` says why) is
**skipped with the reason**, and counted, never dropped silently. A given directory without any run is an
error naming it.

**Groups**: runs whose settings are equal, apart from ``seed``, ``output_dir``, ``resume`` and the
``ignore``d keys; with ``by_folder``, also found under the same given folder (``folder`` is then a
setting of each run).
A group's label names the fewest of the differing keys that still tell the groups apart: for a method
sweep ``method.name=mist``, not every ``method.*`` key that comes with the method. Keys present in every
run are preferred, a choice's ``name`` first, then the config's order.

**Statistics** per group: the mean, min and max over the runs of each metric and per-class value,
counting the defined values only (NaN: a class without ground truth; negative: COCOeval's -1), and the
mean over the runs of each run's seconds per training step, which is the mean of its ``train`` rows'
``seconds_per_iter``, each weighted by the steps it covers. Values are fractions in [0, 1]; tables, plot
and ``copypaste:`` lines show percent with two decimals, as the evaluation reports do ("-" for undefined
in tables, "nan" in ``copypaste:`` lines).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from wsod.engine.pseudo_label_curves import (
    Curve,
    format_curves_markdown,
    has_curves,
    plot_pseudo_label_curves,
    read_curves,
)

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with the module
    from matplotlib.figure import Figure

__all__ = [
    "GROUPING_EXCLUDED",
    "Group",
    "RunResult",
    "SkippedRun",
    "Stats",
    "Summary",
    "SummaryError",
    "find_runs",
    "format_copypaste",
    "format_markdown",
    "group_runs",
    "plot_summary",
    "summary_figure",
    "read_run",
    "summarize_runs",
    "write_summary",
]

# Config keys that differ between the runs of one group: a sweep's seeds, every run's own directory, and
# resume (true in the config_resume_*.yaml of a run that was resumed: how it was run, not what).
GROUPING_EXCLUDED = ("seed", "output_dir", "resume")
# The metrics plotted, those of them that the runs have: VOC, COCO and label-only evaluations.
PLOTTED = ("mAP", "CorLoc", "on_part", "AP", "AP50", "cls_mAP")
# How a metric is named in the tables and plots where its key is not what the evaluation report calls it.
METRIC_LABELS = {"on_part": "on a part"}
# Per-class value prefixes of an eval row (``wsod.engine.evaluate.score_detections``).
PER_CLASS_PREFIXES = ("cls_AP_", "AP_")
BASELINE_PREFIX = "random_"
# The IoU of the final evaluation's VOC AP (``wsod.evaluation.voc.evaluate``'s default), for the
# copypaste line that mirrors the evaluation report's.
VOC_IOU = 0.5
SECONDS_COLUMN = "s/train step (mean of runs)"
PSEUDO_LABELS_PLOT = "pseudo_labels.png"  # written beside summary.png when a run logged pseudo/ keys
PSEUDO_LABELS_NOTE = (
    "Measured on the training batch at each logged step (wsod.engine.pseudo_label_quality): precision"
    " (percent) of the pseudo boxes at IoU >= 0.5 with a true box of their class, and pseudo boxes per"
    " image, in each third of the run; means over the group's runs (wsod.engine.pseudo_label_curves)."
    f" The curves: {PSEUDO_LABELS_PLOT}."
)


class SummaryError(ValueError):
    """Nothing to summarise: a directory without runs, or no run with a final evaluation."""


class _Absent:
    """The value of a key that a run's config does not have (an OICR run has no ``method.p``)."""

    def __repr__(self) -> str:
        return "unset"


ABSENT = _Absent()


@dataclass(frozen=True)
class RunResult:
    """A run with a final evaluation.

    Attributes:
        directory: the run directory.
        config: its settings, flattened (``{"solver.lr": 0.01, ...}``, lists as tuples).
        iteration: the iteration of the final evaluation (``solver.max_iter``).
        metrics: the final evaluation's metrics (``mAP``, ``CorLoc``, ...), in the row's order.
        per_class: class name -> the final evaluation's per-class value (``AP_<class>``).
        seconds_per_step: seconds per training step (module docstring); None without train rows.
        curves: its train rows' ``pseudo/`` keys over training (``wsod.engine.pseudo_label_curves``);
            empty when it logged none.
    """

    directory: Path
    config: dict[str, Any]
    iteration: int
    metrics: dict[str, float]
    per_class: dict[str, float]
    seconds_per_step: float | None
    curves: Mapping[str, Curve] = field(default_factory=dict)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")


@dataclass(frozen=True)
class SkippedRun:
    """A run directory without a final evaluation, and why."""

    directory: Path
    reason: str


@dataclass(frozen=True)
class Stats:
    """Mean, min and max of the defined values among ``total``; all NaN when none is defined."""

    mean: float
    min: float
    max: float
    count: int
    total: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stats:
        values = list(values)
        defined = [v for v in values if _defined(v)]
        if not defined:
            return cls(math.nan, math.nan, math.nan, 0, len(values))
        return cls(sum(defined) / len(defined), min(defined), max(defined), len(defined), len(values))


@dataclass(frozen=True)
class Group:
    """Runs with equal settings apart from the excluded keys; ``settings``: the label keys' values."""

    settings: dict[str, Any]
    runs: tuple[RunResult, ...]

    @property
    def label(self) -> str:
        """``method.name=mist`` (``, `` between keys), or "all runs" when every run has equal settings."""
        return ", ".join(f"{key}={_show(value)}" for key, value in self.settings.items()) or "all runs"

    @property
    def seeds(self) -> list[Any]:
        return [run.seed for run in self.runs]

    def metric(self, name: str) -> Stats:
        return Stats.of(run.metrics.get(name) for run in self.runs)

    def per_class(self, name: str) -> Stats:
        return Stats.of(run.per_class.get(name) for run in self.runs)

    @property
    def seconds_per_step(self) -> Stats:
        return Stats.of(run.seconds_per_step for run in self.runs)


@dataclass(frozen=True)
class Summary:
    """The groups of the runs under ``directories`` (in the order of their settings) and the skipped runs;
    ``keys``: the settings that tell the groups apart."""

    directories: tuple[Path, ...]
    groups: tuple[Group, ...]
    skipped: tuple[SkippedRun, ...]
    keys: tuple[str, ...]

    @property
    def runs(self) -> list[RunResult]:
        return [run for group in self.groups for run in group.runs]

    @property
    def metric_names(self) -> list[str]:
        """Every metric of the runs' final evaluations, in the order the rows hold them."""
        return list(dict.fromkeys(name for run in self.runs for name in run.metrics))

    @property
    def class_names(self) -> list[str]:
        return list(dict.fromkeys(name for run in self.runs for name in run.per_class))


# -- reading -----------------------------------------------------------------------------------------


def _is_run_directory(names: Sequence[str]) -> bool:
    """Whether a directory holding ``names`` (its files and folders) is a run (module docstring)."""
    return "config.yaml" in names or "metrics.jsonl" in names or not names


def find_runs(directory: str | os.PathLike) -> list[Path]:
    """The run directories (module docstring) at or under ``directory``, in sorted order; a run's own
    sub-folders (``eval/``, ``tb/``) are not searched. Raises ``SummaryError`` naming ``directory`` when
    it is not a directory or holds no run."""
    root = Path(directory)
    if not root.is_dir():
        raise SummaryError(f"{root} is not a directory")
    found = []
    for current, folders, files in os.walk(root):
        path = Path(current)
        if _is_run_directory(files + folders):
            found.append(path)
            folders.clear()  # its eval/ and tb/ are the run's, not runs
        else:
            folders.sort()
    if found == [root] and not os.listdir(root):
        found = []  # the given directory itself, empty: no run at all
    if not found:
        raise SummaryError(
            f"{root} holds no run directory (one with config.yaml and metrics.jsonl, as tools/train.py"
            " writes): give a run directory or a folder of them, e.g. a sweep's hydra.sweep.dir"
        )
    return sorted(found, key=lambda p: _natural(str(p)))


def read_run(directory: str | os.PathLike) -> RunResult | SkippedRun:
    """A run directory's final evaluation and settings, or why it has none (``SkippedRun``)."""
    directory = Path(directory)
    if not any(directory.iterdir()):
        return SkippedRun(
            directory, "empty directory: nothing was written (a sweep job that failed before its run"
            " started? the sweep's console output says why)"
        )  # fmt: skip
    config_file = _newest_config(directory)
    if config_file is None:
        return SkippedRun(directory, "no config.yaml: not a run that tools/train.py started")
    try:
        config = _flatten(OmegaConf.to_container(OmegaConf.load(config_file), resolve=False))
    except Exception as error:  # any YAML or OmegaConf error: this run is unreadable, the others are not
        return SkippedRun(directory, f"{config_file.name} is not readable: {type(error).__name__}: {error}")
    max_iter = config.get("solver.max_iter")
    if not isinstance(max_iter, int) or isinstance(max_iter, bool):
        return SkippedRun(directory, f"{config_file.name} holds no integer solver.max_iter")
    rows = _read_rows(directory / "metrics.jsonl")
    if isinstance(rows, str):
        return SkippedRun(directory, rows)
    final = next((r for r in reversed(rows) if r["kind"] == "eval" and r["iteration"] == max_iter), None)
    if final is None:
        return SkippedRun(directory, _why_unfinished(directory, rows, max_iter))
    metrics, per_class = {}, {}
    for key, value in final.items():
        if key in ("kind", "iteration") or key.startswith(BASELINE_PREFIX) or not _is_number(value):
            continue
        prefix = next((p for p in PER_CLASS_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            metrics[key] = float(value)
        else:
            per_class[key[len(prefix) :]] = float(value)
    return RunResult(
        directory, config, max_iter, metrics, per_class, _seconds_per_step(rows), read_curves(rows)
    )


def _newest_config(directory: Path) -> Path | None:
    """``config.yaml``, or the newest ``config_resume_<iteration>.yaml`` of a resumed run (zero-padded
    iterations: the names sort in order)."""
    resumed = sorted(directory.glob("config_resume_*.yaml"))
    if resumed:
        return resumed[-1]
    config = directory / "config.yaml"
    return config if config.is_file() else None


def _read_rows(path: Path) -> list[dict[str, Any]] | str:
    """The rows of a ``metrics.jsonl``, or the reason they cannot be read. A last line that is not JSON
    is left out: the run may be writing it now."""
    if not path.is_file():
        return "no metrics.jsonl: the run has not logged a step"
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            return f"{path.name} line {number} is not JSON ({error.msg})"
        if not (isinstance(row, dict) and isinstance(row.get("kind"), str) and _is_int(row.get("iteration"))):
            return f"{path.name} line {number} is not a metrics row (no kind and iteration)"
        rows.append(row)
    return rows


def _why_unfinished(directory: Path, rows: Sequence[Mapping[str, Any]], max_iter: int) -> str:
    error_file = directory / "error.txt"
    if error_file.is_file():
        first = next((line.strip() for line in error_file.read_text().splitlines() if line.strip()), "")
        return f"failed (error.txt): {first or 'no message'}"
    if (directory / "model_final.pth").is_file():
        return "trained (model_final.pth), but no final evaluation in metrics.jsonl: evaluating, or stopped"
    last = max((row["iteration"] for row in rows), default=0)
    return f"no final evaluation: logged up to iteration {last} of {max_iter} (still training, or stopped)"


def _seconds_per_step(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The train rows' ``seconds_per_iter``, each weighted by the steps since the previous train row."""
    total, steps, previous = 0.0, 0, 0
    for row in rows:
        if row["kind"] != "train":
            continue
        span, previous = row["iteration"] - previous, max(previous, row["iteration"])
        seconds = row.get("seconds_per_iter")
        if span > 0 and _defined(seconds):
            total, steps = total + seconds * span, steps + span
    return total / steps if steps else None


# -- grouping ----------------------------------------------------------------------------------------


def group_runs(runs: Sequence[RunResult], ignore: Sequence[str] = ()) -> tuple[list[Group], list[str]]:
    """The groups of ``runs`` (module docstring), sorted by their settings (numbers as numbers), each
    group's runs by seed; and the label keys. ``ignore``: more keys (or whole sub-trees: ``data.test``)
    whose differences do not make another group."""
    excluded = (*GROUPING_EXCLUDED, *ignore)
    keys = [
        key
        for key in dict.fromkeys(key for run in runs for key in run.config)
        if not any(key == e or key.startswith(f"{e}.") for e in excluded)
    ]
    varying = [key for key in keys if len({_value(run, key) for run in runs}) > 1]
    blocks = _partition(runs, varying)
    # The fewest keys that split the runs as all varying keys do: keys every run has first, because a
    # key that only some runs have comes with a choice another key names (method.p with method.name).
    everywhere = [key for key in varying if all(key in run.config for run in runs)]
    # A choice's name first (method.name): the settings that come with a choice (method=cbl also sets
    # model.eval_weights and solver.ema) would otherwise name the group when they come earlier.
    everywhere.sort(key=lambda key: not key.endswith(".name"))
    label_keys: list[str] = []
    for key in everywhere + [key for key in varying if key not in everywhere]:
        if len(_partition(runs, label_keys)) == len(blocks):
            break
        if len(_partition(runs, [*label_keys, key])) > len(_partition(runs, label_keys)):
            label_keys.append(key)
    groups = []
    for members in blocks.values():
        ordered = sorted(members, key=lambda run: (_sort_key(run.seed), _natural(str(run.directory))))
        groups.append(Group({key: members[0].config.get(key, ABSENT) for key in label_keys}, tuple(ordered)))
    groups.sort(key=lambda group: tuple(_sort_key(value) for value in group.settings.values()))
    return groups, label_keys


def _partition(runs: Sequence[RunResult], keys: Sequence[str]) -> dict[tuple, list[RunResult]]:
    blocks: dict[tuple, list[RunResult]] = {}
    for run in runs:
        blocks.setdefault(tuple(_value(run, key) for key in keys), []).append(run)
    return blocks


def _value(run: RunResult, key: str) -> Any:
    return run.config.get(key, ABSENT)


# The setting ``by_folder`` adds to each run: the folder it was found under.
FOLDER_KEY = "folder"


def summarize_runs(
    directories: Sequence[str | os.PathLike], ignore: Sequence[str] = (), by_folder: bool = False
) -> Summary:
    """Read, group and skip the runs under ``directories`` (``find_runs``, ``read_run``, ``group_runs``).
    A run found under two of the directories counts once. ``by_folder``: each run also carries the
    setting ``folder``, the directory given that it was found under (for a run directory given itself,
    its parent), so that runs of different folders never share a group: rows of runs whose configs
    differ in a setting no key names (a second stage's pseudo boxes exported by another rule)."""
    if not directories:
        raise SummaryError("no directory given: name a run directory or a folder of them")
    paths: dict[Path, tuple[Path, str]] = {}
    for directory in directories:
        for path in find_runs(directory):
            folder = (
                Path(directory).parent if Path(directory).resolve() == path.resolve() else Path(directory)
            )
            paths.setdefault(path.resolve(), (path, folder.as_posix()))
    results = []
    for path, folder in paths.values():
        result = read_run(path)
        if by_folder and isinstance(result, RunResult):  # first, so that it labels the group
            result = replace(result, config={FOLDER_KEY: folder, **result.config})
        results.append(result)
    finished = [r for r in results if isinstance(r, RunResult)]
    skipped = tuple(r for r in results if isinstance(r, SkippedRun))
    groups, keys = group_runs(finished, ignore) if finished else ([], [])
    return Summary(tuple(Path(d) for d in directories), tuple(groups), skipped, tuple(keys))


# -- output ------------------------------------------------------------------------------------------


def format_copypaste(group: Group) -> str:
    """The group's line in the evaluation report's ``copypaste:`` form, with the means over its runs:

    ``copypaste: method.name=mist, 3 runs (seeds 1,2,3), mean mAP(voc07,iou=0.5)=52.31, CorLoc=60.12,
    per-class AP: 45.30,60.10,...``
    """
    names = list(dict.fromkeys(name for run in group.runs for name in run.metrics))
    classes = list(dict.fromkeys(name for run in group.runs for name in run.per_class))
    metric = group.runs[0].config.get("data.test.metric")
    means = {name: _percent(group.metric(name).mean) for name in names}
    parts = []
    if "mAP" in means:
        parts.append(f"mAP({metric},iou={VOC_IOU:g})={means.pop('mAP')}")
    elif "cls_mAP" in means:
        parts.append(f"cls_mAP({metric})={means.pop('cls_mAP')}")
    elif metric == "coco":
        parts.append(f"COCO bbox {','.join(means)}: {','.join(means.values())}")
        means = {}
    parts += [f"{name}={value}" for name, value in means.items()]
    if classes:
        parts.append("per-class AP: " + ",".join(_percent(group.per_class(c).mean) for c in classes))
    seeds = ",".join(_show(seed) for seed in group.seeds)
    runs = f"{_count(len(group.runs), 'run')} ({'seed' if len(group.runs) == 1 else 'seeds'} {seeds})"
    return f"copypaste: {group.label}, {runs}, mean {', '.join(parts)}"


def format_markdown(summary: Summary) -> str:
    """The summary as markdown: the groups' table, the per-class table, the copypaste lines and the
    skipped runs (also what the command prints)."""
    where = ", ".join(str(d) for d in summary.directories)
    lines = [f"# Runs under {where}", ""]
    if summary.groups:
        by = ", ".join(summary.keys) or "nothing (equal settings)"
        lines.append(
            f"{_count(len(summary.runs), 'run')} with a final evaluation in"
            f" {_count(len(summary.groups), 'group')}, told apart by {by} (the runs of a group differ in"
            f" {_words(GROUPING_EXCLUDED)} only); {len(summary.skipped)} skipped. Metrics in percent:"
            " the mean, min and max over a group's runs."
        )
        lines += ["", *_groups_table(summary), "", "## AP per class", ""]
        classes = summary.class_names
        if classes:
            rows = [[name, *(_range(group.per_class(name)) for group in summary.groups)] for name in classes]
            lines += ["Percent: the mean [min, max] over each group's runs.", ""]
            lines += _table(["class", *(group.label for group in summary.groups)], rows)
        else:
            lines.append("The final evaluations hold no per-class values (COCO evaluations).")
        lines += ["", "## copypaste", "", "```", *(format_copypaste(g) for g in summary.groups), "```"]
        if has_curves(summary.runs):
            lines += ["", "## Pseudo-label quality over training", "", PSEUDO_LABELS_NOTE, ""]
            lines.append(format_curves_markdown(summary.groups).rstrip("\n"))
    else:
        lines.append(f"No run with a final evaluation; {len(summary.skipped)} skipped.")
    lines += ["", f"## Skipped runs ({len(summary.skipped)})", ""]
    lines += [f"- `{s.directory}`: {s.reason}" for s in summary.skipped] or ["None."]
    return "\n".join(lines) + "\n"


def _groups_table(summary: Summary) -> list[str]:
    """One row per group: runs, seeds, each metric's mean, min and max, and the seconds per step."""
    names = summary.metric_names
    header = ["group", "runs", "seeds"]
    header += [f"{_label(name)} {stat}" for name in names for stat in ("mean", "min", "max")]
    header.append(SECONDS_COLUMN)
    rows = []
    for group in summary.groups:
        row = [group.label, str(len(group.runs)), ", ".join(_show(seed) for seed in group.seeds)]
        for name in names:
            stats = group.metric(name)
            row += [_percent(stats.mean, "-"), _percent(stats.min, "-"), _percent(stats.max, "-")]
        seconds = group.seconds_per_step
        rows.append([*row, f"{seconds.mean:.3f}" if seconds.count else "-"])
    return _table(header, rows)


def plot_summary(summary: Summary, path: str | os.PathLike) -> Path:
    """``summary_figure`` as a PNG at ``path``."""
    path = Path(path)
    summary_figure(summary).savefig(path, format="png")
    return path


def summary_figure(summary: Summary) -> Figure:
    """Per plotted metric (``PLOTTED``: mAP, CorLoc and on a part, or COCO's AP and AP50, and cls_mAP)
    one panel, with each group's mean, a bar from its min to its max, and its runs as dots."""
    # The object-oriented API with the Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not summary.groups:
        raise SummaryError("nothing to plot: no run with a final evaluation")
    names = [name for name in PLOTTED if name in summary.metric_names] or summary.metric_names[:2]
    count = len(summary.groups)
    labels = [group.label.replace(", ", "\n") for group in summary.groups]
    # Beyond a few groups the labels are turned 45 degrees (anchored at their right end, under their
    # tick), and each group gets room for its label's lines: neighbours never overlap (the test measures).
    turned = count > 3
    lines = [label.split("\n") for label in labels]
    tallest, longest = max(map(len, lines)), max(len(line) for label in lines for line in label)
    step = max(1.0, 0.16 * tallest + 0.45) if turned else max(1.0, 0.065 * longest)
    width = max(3.5, step * count + 1.5)
    height = 4.5 + (0.6 if turned else 0)
    # Side by side while the panels are narrow; one above the other once they are wide (many groups).
    columns = max(len(names), 1) if width * len(names) <= 16 else 1
    rows = math.ceil(max(len(names), 1) / columns)
    figure = Figure(figsize=(width * columns, height * rows), dpi=100)
    FigureCanvasAgg(figure)
    for index, name in enumerate(names):
        axes = figure.add_subplot(rows, columns, index + 1)
        for x, group in enumerate(summary.groups):
            stats = group.metric(name)
            if stats.count == 0:
                continue
            mean, low, high = (100 * v for v in (stats.mean, stats.min, stats.max))
            axes.errorbar(
                [x], [mean], yerr=[[mean - low], [high - mean]], fmt="s", color="tab:blue", markersize=7,
                capsize=8, elinewidth=1.5, label="mean, min to max" if x == 0 else None, zorder=2,
            )  # fmt: skip
            values = [100 * run.metrics[name] for run in group.runs if _defined(run.metrics.get(name))]
            offsets = [0.2 + o for o in _spread(len(values))]  # beside the bar, not on it
            axes.scatter(
                [x + o for o in offsets], values, s=18, color="black", alpha=0.7, zorder=3,
                label="runs" if x == 0 else None,
            )  # fmt: skip
        axes.set_xticks(range(count), labels, fontsize=8)
        if turned:
            for tick in axes.get_xticklabels():
                tick.set(rotation=45, ha="right", rotation_mode="anchor")
        axes.set_xlim(-0.6, count - 0.4)
        axes.set_title(_label(name))
        axes.set_ylabel("%")
        axes.grid(axis="y", alpha=0.3)
        if index == 0:
            axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    return figure


def write_summary(summary: Summary, out_dir: str | os.PathLike) -> list[Path]:
    """Write ``summary.md`` (``format_markdown``), ``summary.png`` (``plot_summary``) and, when a run
    logged ``pseudo/`` keys, ``pseudo_labels.png`` (``wsod.engine.pseudo_label_curves``) into ``out_dir``;
    returns their paths in that order. Raises ``SummaryError`` when no run has a final evaluation."""
    if not summary.groups:
        where = ", ".join(str(d) for d in summary.directories)
        raise SummaryError(
            f"no run under {where} has a final evaluation ({len(summary.skipped)} skipped, each with its"
            " reason above): nothing to summarise yet"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = out_dir / "summary.md"
    # Written in place (not wsod.atomic: its temporary files are private, 0600): a summary is made again
    # in seconds, and the people who read it need not be the one who made it.
    markdown.write_text(format_markdown(summary))
    written = [markdown, plot_summary(summary, out_dir / "summary.png")]
    if has_curves(summary.runs):
        written.append(plot_pseudo_label_curves(summary.groups, out_dir / PSEUDO_LABELS_PLOT))
    return written


# -- helpers -----------------------------------------------------------------------------------------


def _label(name: str) -> str:
    """A metric's name in tables and plots (``METRIC_LABELS``, else its key)."""
    return METRIC_LABELS.get(name, name)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys, as ``wsod.config_checks.flatten``, but lists become tuples: grouping
    hashes the values. A list of mappings (``data.train.sets``) is flattened by index, as the command
    line names its items: ``data.train.sets.0.partial_labels``."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value):
            for index, item in enumerate(value):
                flat.update(_flatten(item, f"{prefix}{key}.{index}."))
        else:
            flat[f"{prefix}{key}"] = _frozen(value)
    return flat


def _frozen(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, Mapping):  # a mapping inside a list
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _defined(value: Any) -> bool:
    """A number that means something: not None, not NaN, not COCOeval's -1 for "undefined"."""
    return _is_number(value) and math.isfinite(value) and value >= 0


def _percent(value: float, missing: str = "nan") -> str:
    # The reports' rule (wsod.evaluation.coco.format_percent), without importing pycocotools for it.
    return f"{100 * value:.2f}" if _defined(value) else missing


def _words(items: Sequence[str]) -> str:
    """``a, b and c``."""
    return " and ".join([", ".join(items[:-1]), items[-1]]) if len(items) > 1 else "".join(items)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _spread(count: int, width: float = 0.2) -> list[float]:
    """Offsets along x that keep ``count`` dots of a group apart: equal values of two seeds stay visible."""
    return [0.0] if count <= 1 else [width * (i / (count - 1) - 0.5) for i in range(count)]


def _range(stats: Stats) -> str:
    if stats.count == 0:
        return "-"
    return f"{_percent(stats.mean)} [{_percent(stats.min)}, {_percent(stats.max)}]"


def _show(value: Any) -> str:
    """A config value as the command line writes it: null, true, [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return [line(header), "|" + "|".join("---" for _ in header) + "|", *(line(row) for row in rows)]


def _natural(text: str) -> list[Any]:
    """Sort key: digit runs as numbers (seed=2 before seed=10)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _sort_key(value: Any) -> tuple:
    """Numbers by value, then everything else by its natural text, unset last."""
    if value is ABSENT:
        return (2, [])
    if _is_number(value):
        return (0, float(value))
    return (1, _natural(_show(value)))
