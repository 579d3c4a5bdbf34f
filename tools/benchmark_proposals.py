"""Memory and lookup speed of a proposal pickle versus a memory-mapped .proposals store (synthetic set).

    python tools/benchmark_proposals.py --images 20000 --boxes 2000 --reads 5000 \\
        --report docs/benchmarks/proposal_store.md --machine "2-core CPU development machine"

Writes both files into a temporary directory (deleted afterwards unless --keep), measures each in fresh
processes (see wsod/benchmarks/proposals.py), prints a table and writes a markdown report.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import sys
from pathlib import Path

from wsod.benchmarks.proposals import format_table, run_benchmark, write_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=20_000, help="images in the synthetic set")
    parser.add_argument("--boxes", type=int, default=2_000, help="boxes per image")
    parser.add_argument("--reads", type=int, default=5_000, help="random images read (and DataLoader items)")
    parser.add_argument("--lookups", type=int, default=100_000, help="random lookups timed")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument(
        "--index-ids", type=int, default=120_000, help="ids for the id-index memory measurement (0: skip)"
    )
    parser.add_argument(
        "--contexts", default="fork,spawn", help="comma list of DataLoader start methods (fork, spawn)"
    )
    parser.add_argument(
        "--loader-sources", default="none,store,pickle", help="comma list of none, store, pickle"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary directory goes")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic files")
    parser.add_argument("--report", type=Path, default=Path("benchmark_out/proposal_store.md"))
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core CPU machine", help="for the report")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="measure in this process, not in fresh ones: only checks that the code runs (tests)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    result = run_benchmark(
        args.images,
        args.boxes,
        reads=args.reads,
        lookups=args.lookups,
        workers=args.workers,
        contexts=[c for c in args.contexts.split(",") if c],
        loader_sources=[s for s in args.loader_sources.split(",") if s],
        directory=args.dir,
        keep=args.keep,
        fresh_processes=not args.in_process,
        index_ids=args.index_ids,
    )
    print(format_table(result))
    arguments = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "tools/benchmark_proposals.py", *arguments])
    today = str(datetime.date.today())
    write_markdown(result, args.report, command=command, machine=args.machine, date=today)
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
