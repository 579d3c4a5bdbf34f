"""Compare runs over seeds: the statistics of each group of runs that share their settings.

    python tools/summarize_runs.py runs/methods

reads every run directory under the given directories (a run directory or a folder of them, such as the
``hydra.sweep.dir`` of a sweep of tools/train.py with ``-m method=mist,oicr seed=1,2,3
hydra.sweep.dir=runs/methods``), groups the runs by the settings in which they differ apart from ``seed``
and ``output_dir`` (for a method sweep: ``method.name``) and prints, per group: the number of runs and
their seeds; the mean, min and max over them of mAP, CorLoc and each class's AP (in percent); the mean
seconds per training step; and a ``copypaste:`` line of the means, like the one a training prints. The
runs without a final evaluation (still training, stopped, failed) are listed as skipped, with the reason.

It writes ``summary.md`` (the same tables) and ``summary.png`` (per group the mean of mAP and CorLoc
with a bar from the min to the max, and each run as a dot) into ``--out`` (default: the first directory);
when the runs logged pseudo-label quality (``pseudo/`` keys: data with true boxes), also its table (per
group and student, each third of the run) and ``pseudo_labels.png``, the curves over training
(``wsod/engine/pseudo_label_curves.py``).
``--ignore KEY`` (repeatable) leaves another setting's differences out of the grouping (``--ignore
progress``); ``--by-folder`` groups the runs of each given folder apart (second-stage runs, each seed on
its own pseudo boxes: ``python tools/summarize_runs.py runs/stage2 runs/stage2_top1 --ignore pseudo_labels
--by-folder``). How runs are read and grouped: ``wsod/engine/run_summary.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from wsod.cli import run_tool
from wsod.engine.run_summary import format_markdown, summarize_runs, write_summary


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/summarize_runs.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directories", nargs="+", type=Path, help="run directories, or folders holding them")
    parser.add_argument(
        "--out", type=Path, default=None, help="where summary.md and the PNGs go (default: the first one)"
    )
    parser.add_argument(
        "--ignore", action="append", default=[], metavar="KEY",
        help="a config key (or sub-tree, e.g. data.test) whose differences make no other group; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--by-folder", action="store_true",
        help="group the runs of each given folder apart (a run directory given itself: its parent folder)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    summary = summarize_runs(args.directories, ignore=args.ignore, by_folder=args.by_folder)
    print(format_markdown(summary), end="")
    written = write_summary(summary, args.out or args.directories[0])  # refuses when nothing finished
    print(f"\nwritten: {', '.join(str(path) for path in written)}")
    return 0


if __name__ == "__main__":
    run_tool(lambda _: main(), None)  # an error (no runs there): one line and exit status 1, as every tool
