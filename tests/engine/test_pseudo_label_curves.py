"""wsod.engine.pseudo_label_curves: the pseudo/ keys read back from metrics.jsonl rows, their windowed
means against hand-computed values, the thirds table and the curves' PNG through tools/summarize_runs.py."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from PIL import Image

from wsod.engine.pseudo_label_curves import (
    Curve,
    format_curves_markdown,
    group_curve,
    has_curves,
    pseudo_label_figure,
    read_curves,
    window_mean,
)


def _row(iteration: int, **values: float) -> dict:
    return {
        "kind": "train",
        "iteration": iteration,
        "loss_total": 0.5,
        **{f"pseudo/{k}": v for k, v in values.items()},
    }


def test_read_curves_keeps_each_pseudo_key_of_the_train_rows_with_its_boxes_as_weight():
    rows = [
        _row(20, precision_1=0.5, boxes_1=2.0, precision_teacher=0.25),
        {"kind": "eval", "iteration": 20, "mAP": 0.3, "pseudo/precision_1": 0.9},  # not a train row
        _row(40, precision_1=1.0, boxes_1=1.0, precision_2=0.0, boxes_2=3.0, precision_teacher=0.75),
        _row(60, boxes_1=0.0),  # no pseudo box of student 1: its precision is left out of the row
        {"kind": "train", "iteration": 80, "pseudo/precision_1": float("nan"), "pseudo/other": 1.0},
    ]
    curves = read_curves(rows)
    order = ["pseudo/precision_1", "pseudo/precision_2", "pseudo/precision_teacher", "pseudo/boxes_1"]
    assert list(curves) == [*order, "pseudo/boxes_2"]
    assert curves["pseudo/precision_1"] == Curve((20, 40), (0.5, 1.0), (2.0, 1.0))
    assert curves["pseudo/boxes_1"] == Curve((20, 40, 60), (2.0, 1.0, 0.0), (1.0, 1.0, 1.0))
    assert curves["pseudo/precision_teacher"].weights == (1.0, 1.0)  # no count of its own: a plain mean
    assert read_curves([{"kind": "train", "iteration": 1, "loss_total": 1.0}]) == {}


def test_a_window_mean_weights_each_precision_by_its_boxes_per_image():
    curve = Curve((20, 40, 60), (0.5, 1.0, 0.0), (2.0, 1.0, 3.0))
    # (0.5 * 2 + 1.0 * 1) / (2 + 1): the share of correct boxes among the window's boxes.
    assert window_mean(curve, 0, 40) == pytest.approx(2 / 3)
    assert window_mean(curve, 20, 60) == pytest.approx(1 / 4)  # (start, stop]: 20 is left out
    assert window_mean(curve, 20, 60, closed=True) == pytest.approx(2 / 6)
    assert math.isnan(window_mean(curve, 60, 100))
    assert math.isnan(window_mean(Curve((10,), (0.5,), (0.0,)), 0, 10))  # weights summing to 0


def test_a_groups_curve_is_the_mean_over_its_runs_of_each_runs_sliding_window():
    first = Curve((10, 20, 30), (0.2, 0.4, 0.6), (1.0, 1.0, 1.0))
    second = Curve((20,), (1.0,), (1.0,))
    # max_iter 100, smoothing 0.2: windows (i - 10, i + 10].
    iterations, values = group_curve([first, second], max_iter=100, smoothing=0.2)
    assert iterations == [10, 20, 30]
    assert values[0] == pytest.approx(((0.2 + 0.4) / 2 + 1.0) / 2)  # (0, 20]: both runs
    assert values[1] == pytest.approx(((0.4 + 0.6) / 2 + 1.0) / 2)  # (10, 30]
    assert values[2] == pytest.approx(0.6)  # (20, 40]: the second run has nothing there


def _run(label_seed: int, iteration: int, curves: dict[str, Curve]) -> SimpleNamespace:
    return SimpleNamespace(iteration=iteration, curves=curves, seed=label_seed)


def test_the_table_gives_each_third_of_the_run_for_each_student_and_the_teacher():
    def curve(*values: float) -> Curve:
        return Curve((10, 20, 30, 40, 50, 60), values, (1.0,) * 6)

    a = {"pseudo/precision_1": curve(0.1, 0.3, 0.5, 0.5, 0.9, 0.7), "pseudo/boxes_1": curve(1, 3, 2, 2, 4, 4),
         "pseudo/precision_teacher": curve(0, 0, 1, 1, 1, 1)}  # fmt: skip
    b = {"pseudo/precision_1": curve(0.3, 0.5, 0.7, 0.7, 0.9, 0.9), "pseudo/boxes_1": curve(1, 1, 2, 2, 2, 2)}
    group = SimpleNamespace(label="method.name=cbl", runs=(_run(1, 60, a), _run(2, 60, b)))
    assert has_curves(group.runs) and not has_curves([_run(3, 60, {})])
    table = format_curves_markdown([group]).splitlines()
    assert table[0] == (
        "| group | pseudo boxes of | precision, first third | precision, second third | precision, last third"
        " | boxes per image, first third | boxes per image, second third | boxes per image, last third |"
    )
    # Thirds of 60 steps: [0, 20], (20, 40], (40, 60]; run a 0.2, 0.5, 0.8 and run b 0.4, 0.7, 0.9.
    assert table[2] == "| method.name=cbl | student 1 | 30.0 | 60.0 | 85.0 | 1.50 | 2.00 | 3.00 |"
    assert table[3] == "| method.name=cbl | teacher | 0.0 | 100.0 | 100.0 |  |  |  |"  # one run has it
    assert format_curves_markdown([SimpleNamespace(label="x", runs=(_run(1, 60, {}),))]) == ""


def test_the_figure_draws_a_column_per_group_and_refuses_runs_without_pseudo_keys():
    curves = {"pseudo/precision_1": Curve((10, 20), (0.2, 0.4), (1.0, 1.0)),
              "pseudo/boxes_1": Curve((10, 20), (1.0, 2.0), (1.0, 1.0))}  # fmt: skip
    groups = [SimpleNamespace(label=f"method.name={m}", runs=(_run(1, 20, curves),)) for m in ("a", "b")]
    figure = pseudo_label_figure(groups)
    assert len(figure.axes) == 4
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["student 1"]
    with pytest.raises(ValueError, match="no run logged pseudo/ keys"):
        pseudo_label_figure([SimpleNamespace(label="x", runs=(_run(1, 20, {}),))])


def test_summarize_runs_writes_the_table_and_the_png_for_runs_that_logged_pseudo_keys(tmp_path, capsys):
    from test_summarize_runs import _tool, evaluation, fake_run

    sweep = tmp_path / "sweep"
    for seed in (1, 2):
        run = fake_run(
            sweep / f"method=oicr,seed={seed}", "method=oicr", seed=seed, final=evaluation(0.3, 0.2, 0.1, 0.5)
        )
        rows = (run / "metrics.jsonl").read_text().splitlines()
        extra = [_row(i, precision_1=0.25 * seed, boxes_1=2.0) for i in (1, 2, 3, 4)]
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in extra) + "\n".join(rows) + "\n"
        )
    assert _tool().main([str(sweep)]) == 0
    printed = capsys.readouterr().out
    assert "## Pseudo-label quality over training" in printed
    assert "| all runs | student 1 | 37.5 | 37.5 | 37.5 | 2.00 | 2.00 | 2.00 |" in printed
    assert printed.rstrip().endswith(f"{sweep / 'pseudo_labels.png'}")
    with Image.open(sweep / "pseudo_labels.png") as image:
        image.load()
        assert image.format == "PNG" and image.width > 300
