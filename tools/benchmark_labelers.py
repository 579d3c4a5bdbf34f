"""Pseudo-labelling time per image and student of MIST, OICR, PCL and CBL, and of CBL's R-CNN seeds
(``cbl_rcnn``, once per image), on synthetic inputs in one process.

    python tools/benchmark_labelers.py --proposals 500,2000 --device cpu --repeats 3

Prints a markdown table (median and least ms per call, and the ratio to MIST at the same size); see
wsod/benchmarks/labelers.py for the inputs. ``--device cuda`` times on the GPU (waiting for it).
"""

from __future__ import annotations

import argparse

import torch

from wsod.benchmarks.labelers import format_table, time_labeling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods", default="mist,oicr,pcl,cbl,cbl_rcnn", help="comma list of methods with students"
    )
    parser.add_argument("--proposals", default="2000", help="comma list of proposal counts per image")
    parser.add_argument("--classes", type=int, default=20, help="classes (VOC: 20)")
    parser.add_argument("--positive", type=int, default=3, help="classes present in the image")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per row")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [
        time_labeling(
            method,
            int(count),
            num_classes=args.classes,
            positive_classes=args.positive,
            repeats=args.repeats,
            device=args.device,
        )
        for count in args.proposals.split(",")
        for method in args.methods.split(",")
    ]
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
