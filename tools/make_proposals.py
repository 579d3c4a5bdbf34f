"""Make Selective Search proposals for a dataset, report their recall, or convert proposal files.

    python tools/make_proposals.py folder --root data/my_images     # your own images (wsod/data/folder.py)
    python tools/make_proposals.py toy --split test --output outputs/proposals/toy_test.pkl
    python tools/make_proposals.py voc --devkit data/VOCdevkit --year 2007 --image-set trainval \\
        --output data/proposals/ss_voc_2007_trainval.pkl --workers 16
    python tools/make_proposals.py coco --annotations data/coco/annotations/instances_val2017.json \\
        --images data/coco/val2017 --output data/proposals/ss_coco_val2017.pkl
    python tools/make_proposals.py voc --devkit data/VOCdevkit --year 2007 --image-set test \\
        --proposals data/proposals/given.pkl    # the recall of a file only
    python tools/make_proposals.py toy --root data/toy_parts --object-size 25 70 --split trainval \\
        --proposals data/toy_parts/proposals/selective_search_trainval.pkl   # its part proposals
    python tools/make_proposals.py convert SelectiveSearchVOC2007trainval.mat voc_2007_trainval.pkl
    python tools/make_proposals.py convert ss_coco_train2017.pkl ss_coco_train2017.proposals  # mmap store
    python tools/make_proposals.py convert sam_boxes.json sam_boxes.proposals   # boxes from any tool
    python tools/make_proposals.py merge ss_trainval.pkl rpn/train_0.proposals --output union.proposals

``folder`` makes proposals for every image of ``<root>/labels.csv`` (both splits) and writes them where
the folder dataset reads them, ``<root>/proposals/selective_search.proposals``: ``--output`` is not needed.
Generation is resumable: rerun the same command after an interruption. Wherever the dataset has
ground-truth boxes, recall at IoU 0.5 and 0.7 versus the number of proposals is printed and plotted
(``--recall-plot``, default next to the output file), and per class the part proposals per object:
proposals inside an object that cover under half of it, what part domination feeds on
(``wsod.data.proposals.parts``; ``--min-size 28`` reports what the default toy config loads). An output
or destination ending with ``.proposals`` is a memory-mapped proposal store (``wsod.data.proposals.store``):
one copy of the boxes in the page cache for all training processes instead of one unpickled copy per
process. ``convert`` reads reference and detectron2 pickles, ``.mat`` releases, a COCO-style ``.json`` of
boxes and a folder of per-image ``.npy`` / ``.txt`` arrays, keeping each box's score (data/README.md,
Proposal files).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from wsod.cli import run_tool
from wsod.data.coco import load_coco_records
from wsod.data.folder import load_folder_records, proposals_path
from wsod.data.proposals import (
    STORE_DTYPES,
    convert_proposals,
    load_proposals,
    save_proposals,
    union_proposals,
)
from wsod.data.proposals.parts import format_part_table, records_part_proposals
from wsod.data.proposals.recall import format_recall_table, plot_recall, records_recall
from wsod.data.proposals.selective_search import MODES, generate_proposals
from wsod.data.toy import OBJECT_SIZE, ensure_toy_dataset
from wsod.data.voc import VOC_CLASSES, load_voc_records


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output",
        type=Path,
        help="proposal pickle, or .proposals store, to write (required unless --proposals)",
    )
    parser.add_argument("--proposals", type=Path, help="report the recall of this file instead of generating")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--shard-size", type=int, default=25, help="images per resumable shard")
    parser.add_argument("--mode", choices=MODES, default="fast", help="Selective Search strategy set")
    parser.add_argument("--top-k", type=int, default=None, help="keep at most this many boxes per image")
    parser.add_argument(
        "--min-size",
        type=float,
        default=2.0,
        help="drop boxes narrower or shorter (inclusive px, x2 - x1 + 1)",
    )
    parser.add_argument(
        "--recall-plot", type=Path, help="PNG of recall vs proposals (default: next to output)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    voc = commands.add_parser("voc", help="a VOCdevkit image set")
    voc.add_argument("--devkit", type=Path, required=True)
    voc.add_argument("--year", required=True)
    voc.add_argument("--image-set", required=True)
    voc.add_argument("--classes", help="comma-separated class names (default: the 20 VOC classes)")
    coco = commands.add_parser("coco", help="a COCO-format json (instances or label-only)")
    coco.add_argument("--annotations", type=Path, required=True)
    coco.add_argument(
        "--images", type=Path, required=True, help="folder the json's file names are relative to"
    )
    folder = commands.add_parser(
        "folder", help="your own images: <root>/images/ and <root>/labels.csv (wsod/data/folder.py)"
    )
    folder.add_argument("--root", type=Path, required=True, help="the folder holding images/ and labels.csv")
    folder.add_argument("--classes", help="comma-separated class names (default: classes.txt or the labels)")
    toy = commands.add_parser("toy", help="a split of the toy dataset (generated first if absent)")
    toy.add_argument("--root", type=Path, default=Path("data/toy"))
    toy.add_argument("--split", default="test", choices=("trainval", "train", "val", "test"))
    toy.add_argument(
        "--object-size", type=int, nargs=2, default=list(OBJECT_SIZE), metavar=("MIN", "MAX"),
        help=f"the objects' sides in pixels, as data.object_size (default {OBJECT_SIZE[0]} {OBJECT_SIZE[1]};"
        " data=toy_parts: 25 70)",
    )  # fmt: skip
    for sub in (voc, coco, folder, toy):
        _add_generation_options(sub)
    convert = commands.add_parser(
        "convert",
        help="convert proposals: .pkl, .mat, a .json of boxes, a .npy/.txt folder, a .proposals store",
    )
    convert.add_argument("source", type=Path)
    convert.add_argument("destination", type=Path)
    convert.add_argument("--mat-order", choices=("yxyx", "xyxy"), default="yxyx", help="box order in .mat")
    convert.add_argument("--mat-zero-based", action="store_true", help=".mat boxes are 0-based")
    convert.add_argument(
        "--dtype",
        choices=STORE_DTYPES,
        default="float32",
        help="box dtype of a .proposals destination (float16: half the size, see wsod.data.proposals.store)",
    )
    merge = commands.add_parser("merge", help="the union of proposal files, image by image")
    merge.add_argument("sources", type=Path, nargs="+", help="proposal files (any format convert reads)")
    merge.add_argument("--output", type=Path, required=True, help="the union: a .pkl, .mat or .proposals")
    merge.add_argument(
        "--dtype", choices=STORE_DTYPES, default="float32", help="box dtype of a .proposals output"
    )
    return parser


def _records(args: argparse.Namespace) -> tuple[list, tuple[str, ...]]:
    """The dataset's image records and its class names."""
    if args.command == "voc":
        classes = tuple(args.classes.split(",") if args.classes else VOC_CLASSES)
        return load_voc_records(args.devkit, args.year, args.image_set, classes), classes
    if args.command == "coco":
        records, _, classes = load_coco_records(args.annotations, args.images)
        return records, classes
    if args.command == "folder":
        classes = args.classes.split(",") if args.classes else None
        return load_folder_records(args.root, None, classes)
    toy = ensure_toy_dataset(args.root, object_size=args.object_size, progress=not args.no_progress)
    return load_voc_records(toy.devkit, toy.year, args.split, toy.classes), tuple(toy.classes)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "convert":
        proposals = convert_proposals(
            args.source,
            args.destination,
            box_order=args.mat_order,
            one_based=not args.mat_zero_based,
            dtype=args.dtype,
        )
        print(
            f"converted {len(proposals)} images ({proposals.num_boxes} boxes):"
            f" {args.source} -> {args.destination}"
        )
        return 0
    if args.command == "merge":
        union = union_proposals([load_proposals(source) for source in args.sources])
        save_proposals(union, args.output, dtype=args.dtype)
        kept = "with" if union.scores(union.image_ids[0]) is not None else "without"
        summary = f"{len(union)} images, {union.num_boxes} boxes ({kept} scores)"
        print(f"merged {len(args.sources)} files: {summary} -> {args.output}")
        return 0
    if args.command == "folder" and args.output is None and args.proposals is None:
        args.output = proposals_path(args.root)  # where the folder dataset reads them
    if (args.output is None) == (args.proposals is None):
        sys.exit("give exactly one of --output (generate) and --proposals (report an existing file)")

    records, classes = _records(args)
    if args.proposals is not None:
        proposals, source = load_proposals(args.proposals), args.proposals
    else:
        proposals, stats = generate_proposals(
            [(r.image_id, r.path) for r in records],
            args.output,
            workers=args.workers,
            shard_size=args.shard_size,
            mode=args.mode,
            top_k=args.top_k,
            min_size=args.min_size,
            progress=not args.no_progress,
        )
        source = args.output
        print(
            f"{len(proposals)} images -> {args.output}:"
            f" {proposals.num_boxes / len(proposals):.1f} boxes per image; Selective Search"
            f" {stats.seconds_per_image:.3f} s per image per worker ({stats.images} images computed now,"
            f" {stats.wall_seconds:.1f} s wall with {args.workers} workers)"
        )
    proposals.require([r.image_id for r in records])
    report = records_recall(proposals, records, min_size=args.min_size, top_k=args.top_k)
    if report is None:
        print("no ground-truth boxes in this dataset: no recall report")
        return 0
    print(format_recall_table(report))
    print(
        format_part_table(
            records_part_proposals(proposals, records, classes, min_size=args.min_size, top_k=args.top_k)
        )
    )
    plot_path = args.recall_plot or Path(source).with_suffix(".recall.png")
    plot_recall(report, plot_path, title=f"{Path(source).name}")
    print(f"recall plot: {plot_path}")
    return 0


if __name__ == "__main__":
    run_tool(lambda _: main(), None)  # an error (bad input): one line and exit status 1, as every tool
