"""Pseudo-label quality over training, compared between groups of runs: the ``pseudo/`` keys that a run
logs on its training batch (``wsod.engine.pseudo_label_quality``) read back from its ``metrics.jsonl``,
averaged over a group's seeds, as a table of thirds of the run and as curves (``tools/summarize_runs.py``
writes both beside its summary).

One logged step scores the pseudo boxes of one training batch (a few images), so a single row is noisy.
Both views therefore pool rows over a span of iterations:

- a window's value for one run is the mean of its rows' values in that window, each precision weighted by
  the row's pseudo boxes per image (``pseudo/boxes_k``; with a fixed batch this is the share of correct
  boxes over the window's boxes); the teacher's precision, which has no count of its own, and the boxes
  per image are plain means;
- a group's value is the mean of its runs' values (every run counts once, as in the summary's tables).

The table cuts each run into thirds of its ``solver.max_iter`` (``THIRDS``); the curves use a sliding
window of a fifteenth of the run (``SMOOTHING``) at the group's logged iterations.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wsod.engine.pseudo_label_quality import PREFIX, TEACHER

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the summary
    from matplotlib.figure import Figure

__all__ = [
    "SMOOTHING",
    "THIRDS",
    "Curve",
    "format_curves_markdown",
    "group_curve",
    "has_curves",
    "plot_pseudo_label_curves",
    "pseudo_label_figure",
    "read_curves",
    "window_mean",
]

THIRDS = ((0.0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.0))  # the table's windows, as shares of the run
THIRD_NAMES = ("first third", "second third", "last third")
SMOOTHING = 1 / 15  # the curves' sliding window, as a share of the run (200 of toy_voc's 3,000 steps)
_KEY = re.compile(rf"^{PREFIX}/(precision|boxes)_(\d+|{TEACHER})$")


@dataclass(frozen=True)
class Curve:
    """One ``pseudo/`` key of one run: its logged ``iterations`` (ascending), the ``values`` there, and
    each row's ``weights`` (``pseudo/boxes_k`` for ``pseudo/precision_k``, else 1)."""

    iterations: tuple[int, ...]
    values: tuple[float, ...]
    weights: tuple[float, ...]


def read_curves(rows: Iterable[Mapping[str, Any]]) -> dict[str, Curve]:
    """The ``pseudo/`` curves of a run's ``metrics.jsonl`` rows (its ``kind == "train"`` rows), keyed as
    logged (``pseudo/precision_1``, ``pseudo/boxes_1``, ..., ``pseudo/precision_teacher``); ``{}`` for a
    run that logged none (data without boxes, or a method without pseudo boxes)."""
    points: dict[str, list[tuple[int, float, float]]] = {}
    for row in rows:
        if row.get("kind") != "train":
            continue
        for key, value in row.items():
            match = _KEY.match(key)
            if match is None or not _finite(value):
                continue
            weight = 1.0
            if match.group(1) == "precision" and match.group(2) != TEACHER:
                weight = row.get(f"{PREFIX}/boxes_{match.group(2)}", 1.0)
                weight = float(weight) if _finite(weight) else 1.0
            points.setdefault(key, []).append((int(row["iteration"]), float(value), weight))
    curves = {}
    for key in sorted(points, key=_key_order):
        iterations, values, weights = zip(*sorted(points[key]), strict=True)
        curves[key] = Curve(iterations, values, weights)
    return curves


def window_mean(curve: Curve, start: float, stop: float, *, closed: bool = False) -> float:
    """The weighted mean of ``curve``'s rows at iterations in ``(start, stop]`` (``closed``: ``[start,
    stop]``); NaN when none falls there or their weights sum to 0."""
    total = weight_sum = 0.0
    for iteration, value, weight in zip(curve.iterations, curve.values, curve.weights, strict=True):
        inside = (start <= iteration if closed else start < iteration) and iteration <= stop
        if inside:
            total, weight_sum = total + value * weight, weight_sum + weight
    return total / weight_sum if weight_sum > 0 else math.nan


def group_curve(
    curves: Sequence[Curve], max_iter: int, smoothing: float = SMOOTHING
) -> tuple[list[int], list[float]]:
    """A group's curve: at each iteration that some run logged, the mean over the runs of each run's
    weighted mean over the sliding window ``(i - w/2, i + w/2]``, ``w = smoothing * max_iter`` (runs
    with nothing in a window are left out of that point's mean)."""
    half = max(smoothing * max_iter, 1.0) / 2
    iterations = sorted({i for curve in curves for i in curve.iterations})
    means = []
    for iteration in iterations:
        values = [window_mean(c, iteration - half, iteration + half) for c in curves]
        values = [v for v in values if not math.isnan(v)]
        means.append(sum(values) / len(values) if values else math.nan)
    return iterations, means


def has_curves(runs: Iterable[Any]) -> bool:
    """Whether any run (``wsod.engine.run_summary.RunResult``) logged a ``pseudo/`` key."""
    return any(run.curves for run in runs)


def _thirds(run: Any, key: str) -> list[float]:
    curve = run.curves.get(key)
    if curve is None:
        return [math.nan] * len(THIRDS)
    return [
        window_mean(curve, a * run.iteration, b * run.iteration, closed=index == 0)
        for index, (a, b) in enumerate(THIRDS)
    ]


def _group_keys(group: Any) -> list[str]:
    return sorted({key for run in group.runs for key in run.curves}, key=_key_order)


def format_curves_markdown(groups: Sequence[Any]) -> str:
    """The table of the curves: per group (``wsod.engine.run_summary.Group``) and pseudo-label source (the
    students 1..K and the teacher), the precision (percent) and the pseudo boxes per image in each third
    of the run, means over the group's runs. Empty when no run logged a ``pseudo/`` key."""
    lines: list[str] = []
    header = ["group", "pseudo boxes of", *(f"precision, {name}" for name in THIRD_NAMES)]
    header += [f"boxes per image, {name}" for name in THIRD_NAMES]
    for group in groups:
        for source in dict.fromkeys(_KEY.match(k).group(2) for k in _group_keys(group)):
            cells = [group.label, f"student {source}" if source != TEACHER else "teacher"]
            for name in ("precision", "boxes"):
                key = f"{PREFIX}/{name}_{source}"
                per_run = [_thirds(run, key) for run in group.runs]  # (runs, 3)
                thirds = [_mean(window) for window in zip(*per_run, strict=True)]
                scale, digits = (100, 1) if name == "precision" else (1, 2)
                cells += ["" if math.isnan(v) else f"{scale * v:.{digits}f}" for v in thirds]
            lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return ""
    rule = "|" + "---|" * len(header)
    return "\n".join(["| " + " | ".join(header) + " |", rule, *lines]) + "\n"


def pseudo_label_figure(groups: Sequence[Any]) -> Figure:
    """Per group a column of two panels: the precision (percent) of each student's and the teacher's
    pseudo boxes over training, and their number per image (``group_curve``, smoothed, mean over the
    group's runs). Raises ``ValueError`` when no run logged a ``pseudo/`` key."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = [group for group in groups if _group_keys(group)]
    if not shown:
        raise ValueError("no run logged pseudo/ keys: nothing to plot (data with true boxes logs them)")
    figure = Figure(figsize=(3.6 * len(shown) + 0.8, 6.4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, len(shown), squeeze=False, sharex="col", sharey="row")
    for column, group in enumerate(shown):
        max_iter = max(run.iteration for run in group.runs)
        for key in _group_keys(group):
            name, source = _KEY.match(key).groups()
            curves = [run.curves[key] for run in group.runs if key in run.curves]
            iterations, values = group_curve(curves, max_iter)
            row = 0 if name == "precision" else 1
            scale = 100 if row == 0 else 1
            teacher = source == TEACHER
            axes[row][column].plot(
                iterations, [scale * v for v in values], linewidth=2.2 if teacher else 1.4,
                linestyle="--" if teacher else "-", color="black" if teacher else None,
                label="teacher" if teacher else f"student {source}",
            )  # fmt: skip
        title = group.label if len(group.label) <= 40 else group.label[:37] + "..."
        axes[0][column].set_title(f"{title}\n({len(group.runs)} runs)", fontsize=9)
        axes[1][column].set_xlabel("iteration")
        for row in (0, 1):
            axes[row][column].grid(alpha=0.3)
        axes[0][column].legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("precision of the pseudo boxes (%, IoU >= 0.5)")
    axes[1][0].set_ylabel("pseudo boxes per image")
    figure.tight_layout()
    return figure


def plot_pseudo_label_curves(groups: Sequence[Any], path: str | os.PathLike) -> Path:
    """``pseudo_label_figure`` as a PNG at ``path``."""
    path = Path(path)
    pseudo_label_figure(groups).savefig(path, format="png")
    return path


def _key_order(key: str) -> tuple[int, int, str]:
    """precision before boxes; students by number, the teacher last."""
    match = _KEY.match(key)
    if match is None:
        return (2, 0, key)
    name, source = match.groups()
    return (0 if name == "precision" else 1, 10**6 if source == TEACHER else int(source), key)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _mean(values: Iterable[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan
