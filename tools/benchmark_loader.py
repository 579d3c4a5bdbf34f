"""Images per second the training data loader delivers on the toy dataset (nothing consumes the batches).

python tools/benchmark_loader.py --workers 2 --batch-size 8 --scales 320 384 448 --max-size 800
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from wsod.benchmarks.loader import measure_loader_throughput
from wsod.data.loader import build_train_loader
from wsod.data.toy import ensure_toy_dataset
from wsod.data.transforms import train_transform


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path("data/toy"), help="toy dataset folder")
    parser.add_argument("--split", default="trainval")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=150, help="timed batches (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches first")
    parser.add_argument("--scales", type=int, nargs="+", default=[320, 384, 448], help="shorter-side choices")
    parser.add_argument("--max-size", type=int, default=800)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    toy = ensure_toy_dataset(args.root)
    dataset = toy.dataset(args.split, transform=train_transform(args.scales, args.max_size))
    loader = build_train_loader(dataset, args.batch_size, num_workers=args.workers)
    result = measure_loader_throughput(loader, args.batches, args.warmup)
    print(
        f"{result.images_per_second:.1f} images/s ({result.images} images in {result.batches} batches of"
        f" {args.batch_size}, {result.seconds:.2f} s; {args.workers} workers; scales {args.scales};"
        f" {result.proposals_per_image:.1f} proposals per image)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
