"""Simulate partial labels (points, scribbles, boxes) on a dataset with boxes, as researchers do.

    python tools/make_partial_labels.py toy --points 1 --output data/toy/partial/points.json
    python tools/make_partial_labels.py toy --scribbles 1 --output data/toy/partial/scribbles.json
    python tools/make_partial_labels.py toy --boxes 0.1 --output data/toy/partial/boxes10.json
    python tools/make_partial_labels.py toy --points 1/3 --scribbles 1/3 --boxes 1/3 --per object \\
        --output data/toy/partial/mixed.json
    python tools/make_partial_labels.py voc --devkit data/VOCdevkit --year 2007 --image-set trainval \\
        --points 1 --output data/partial/voc07_trainval_points.json
    python tools/make_partial_labels.py coco --annotations data/coco/annotations/instances_train2014.json \\
        --points 1 --output data/coco/annotations/instances_train2014_points.json

``--points``, ``--scribbles`` and ``--boxes`` are the fractions of the units (images; single objects with
``--per object``) that get each kind (``0.1``, ``1/3``; together at most 1); the others keep image labels
only. Points and scribbles lie inside each object's mask where the data has one (COCO's segmentations,
the toy set's drawn shapes), else inside its box; ``wsod/data/partial_label_simulation.py`` has the
rules. ``--seed`` makes another draw; the same command writes the same file. A fraction that gives no
unit a kind (``--boxes 0.001`` of 600 images rounds to none) is an error, not a file that labels nothing.

``toy`` reads the toy set at ``--root``, which must hold one; without ``--root`` it reads ``data/toy``,
making it there on first use as ``tools/train.py`` does (800 images and their proposals: minutes).

Output: for ``toy`` and ``voc`` a side file (``data/README.md``) that a train set names with
``data.train.sets.0.partial_labels=<file>``; for ``coco`` a copy of the annotation json whose every
non-crowd annotation has ``use_as`` (tag, point, scribble or box) and its ``point`` / ``scribble``, to
train with ``data.train.sets.0.annotations=<file>``. Difficult VOC objects and crowd annotations are
never labelled (they give no image label).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import NoReturn

import numpy as np

from wsod.atomic import atomic_write
from wsod.cli import run_tool
from wsod.data.box_formats import coco_xywh_to_xyxy
from wsod.data.coco import normalise_coco
from wsod.data.json_files import read_json, whole_number
from wsod.data.partial_label_simulation import (
    SimulatedObject,
    choose_kinds,
    parse_fraction,
    simulate_partial_label,
)
from wsod.data.partial_labels import write_partial_labels_file
from wsod.data.toy import OBJECT_SIZE, ensure_toy_dataset, toy_object_masks
from wsod.data.voc import VOC_CLASSES, load_voc_records

# (image id, file path, [(class name, SimulatedObject)]) per image.
Image = tuple[object, str, list[tuple[str, SimulatedObject]]]
# Where the toy set is read (and made on first use) without --root: tools/train.py's data.root.
DEFAULT_TOY_ROOT = Path("data/toy")
COCO_EXPECTED = "a COCO instances json with 'images', 'categories' and 'annotations' (with a bbox each)"
OPTIONS = {"point": "--points", "scribble": "--scribbles", "box": "--boxes"}


def _voc_images(
    devkit: Path,
    year: str,
    image_set: str,
    classes,
    toy_seed: int | None = None,
    toy_object_size: tuple[int, int] = OBJECT_SIZE,
) -> list[Image]:
    images = []
    for record in load_voc_records(devkit, year, image_set, classes):
        masks = None
        if toy_seed is not None:  # the toy's objects drawn again, as the set was made
            masks = toy_object_masks(toy_seed, int(record.image_id), object_size=toy_object_size)
        objects = []
        for j, (box, label, difficult) in enumerate(
            zip(record.gt_boxes, record.gt_labels, record.gt_difficult, strict=True)
        ):
            if not difficult:
                objects.append((classes[label], SimulatedObject(box, None if masks is None else masks[j])))
        images.append((record.image_id, record.path, objects))
    return images


# The numpy 2 DeprecationWarning pycocotools' mask decoding raises (pycocotools/mask.py, decode).
_PYCOCOTOOLS_COPY_WARNING = r"__array__ implementation doesn't accept a copy keyword"


def _read_coco(path: Path) -> dict:
    """The COCO json at ``path``, checked as training checks it (``normalise_coco``: the lists, ids and
    bboxes; its defaults filled in, so the copy written trains as the source does) and for what the
    simulation needs: a box on every annotation and a name on every category. Errors: one line naming
    the file and the field (a json of another kind used to fail with a bare ``KeyError``)."""
    if not path.is_file():
        raise FileNotFoundError(f"--annotations {path}: no such file; give a COCO instances json")
    data = normalise_coco(read_json(path, COCO_EXPECTED), path)
    if data["annotations"] and "bbox" not in data["annotations"][0]:
        raise ValueError(
            f"{path}: its annotations have no 'bbox' (image labels only); simulated points, scribbles and"
            " boxes are drawn from each object's box, so give a COCO instances json with boxes"
        )
    for i, category in enumerate(data["categories"]):
        if not isinstance(category.get("name"), str):
            raise ValueError(
                f"{path}: categories[{i}] (id {category['id']!r}) has name {category.get('name')!r};"
                " expected the class name, a string"
            )
    return data


def _coco_images(data: dict, path: Path) -> tuple[list[Image], list[dict]]:
    """Images and, in the same order as their objects, the annotations they come from."""
    from pycocotools.coco import COCO

    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
        coco.createIndex()
    names = {c["id"]: c["name"] for c in data["categories"]}
    images, annotations = [], []
    for i, image in enumerate(data["images"]):
        objects = []
        for ann in coco.imgToAnns.get(image["id"], []):
            if ann.get("iscrowd", 0):
                continue
            box = coco_xywh_to_xyxy(np.array([ann["bbox"]], np.float32))[0]
            mask = None
            if ann.get("segmentation"):
                if not all(whole_number(image.get(key)) for key in ("height", "width")):
                    raise ValueError(
                        f"{path}: images[{i}] (id {image['id']!r}) has height {image.get('height')!r} and"
                        f" width {image.get('width')!r}; its objects' segmentations are drawn at that size,"
                        " so give both, whole numbers of pixels"
                    )
                with warnings.catch_warnings():
                    # pycocotools' mask decoder (its _mask.decode, up to 2.0.11 at least) asks numpy 2 for
                    # an array without copying from an object that cannot say so: its warning, not ours.
                    warnings.filterwarnings("ignore", _PYCOCOTOOLS_COPY_WARNING, DeprecationWarning)
                    mask = coco.annToMask(ann).astype(bool)
            objects.append((names[ann["category_id"]], SimulatedObject(box, mask)))
            annotations.append(ann)
        images.append((image["id"], image.get("file_name", ""), objects))
    return images, annotations


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, the option and the value named (the usage block
    argparse prints first is left to ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fraction(text: str) -> float:
    """``parse_fraction`` for argparse: its message kept (argparse would print ``invalid
    parse_fraction value`` for a plain ValueError)."""
    try:
        return parse_fraction(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _toy_root(parser: argparse.ArgumentParser, root: Path | None) -> Path:
    """The toy set's folder. ``--root`` must hold a toy set: a mistyped folder would otherwise get a whole
    new set made in it, minutes of work, silently. Without it (or naming data/toy itself), data/toy,
    made on first use as tools/train.py does."""
    if root is None or root.resolve() == DEFAULT_TOY_ROOT.resolve():
        chosen = root or DEFAULT_TOY_ROOT
        if not (chosen / "toy.json").is_file():
            print(f"{chosen}: no toy set yet; making it (800 images and their proposals)", file=sys.stderr)
        return chosen
    if not (root / "toy.json").is_file():
        what = "no such folder" if not root.exists() else f"no toy set in it ({root / 'toy.json'} is missing)"
        parser.error(
            f"--root {root}: {what}; give the folder of a toy set made before (tools/train.py"
            f" data.root=<folder> makes one there) or leave --root out to use {DEFAULT_TOY_ROOT},"
            " made on first use"
        )
    return root


def simulate(images: list[Image], fractions: dict[str, float], per: str, seed: int) -> list[list[str | None]]:
    """Each object's kind (None: image label only), per image, by ``choose_kinds`` over the units."""
    if per == "image":
        labelled = [i for i, (_, _, objects) in enumerate(images) if objects]
        chosen = choose_kinds(len(labelled), fractions, seed)
        kinds: list[list[str | None]] = [[None] * len(objects) for _, _, objects in images]
        for i, kind in zip(labelled, chosen, strict=True):
            kinds[i] = [kind] * len(images[i][2])
        return kinds
    flat = choose_kinds(sum(len(objects) for _, _, objects in images), fractions, seed)
    kinds, start = [], 0
    for _, _, objects in images:
        kinds.append(flat[start : start + len(objects)])
        start += len(objects)
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)  # subparsers are _Parsers too
    toy = sub.add_parser("toy", help="the toy set (points and scribbles inside the drawn shapes)")
    toy.add_argument(
        "--root",
        type=Path,
        default=None,
        help=f"a toy set's folder (default {DEFAULT_TOY_ROOT}, made if absent)",
    )
    toy.add_argument("--image-set", default="trainval")
    voc = sub.add_parser("voc", help="a VOCdevkit image set (inside the boxes)")
    voc.add_argument("--devkit", type=Path, default=Path("data/VOCdevkit"))
    voc.add_argument("--year", default="2007")
    voc.add_argument("--image-set", default="trainval")
    coco = sub.add_parser("coco", help="a COCO instances json (inside the segmentation masks)")
    coco.add_argument("--annotations", type=Path, required=True)
    for command in (toy, voc, coco):
        command.add_argument("--points", type=_fraction, default=0.0, help="fraction given points")
        command.add_argument("--scribbles", type=_fraction, default=0.0, help="fraction given scribbles")
        command.add_argument("--boxes", type=_fraction, default=0.0, help="fraction given boxes")
        command.add_argument(
            "--per",
            choices=("image", "object"),
            default="image",
            help="what a fraction counts (default image)",
        )
        command.add_argument("--seed", type=int, default=0)
        command.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    subcommand = {"toy": toy, "voc": voc, "coco": coco}[args.command]  # its errors name the subcommand
    fractions = {"point": args.points, "scribble": args.scribbles, "box": args.boxes}
    fractions = {kind: f for kind, f in fractions.items() if f > 0}
    if not fractions:
        subcommand.error("give at least one of --points, --scribbles and --boxes")
    if sum(fractions.values()) > 1.0 + 1e-9:
        subcommand.error(
            f"{' + '.join(f'{OPTIONS[k]} {f:g}' for k, f in fractions.items())} add up to"
            f" {sum(fractions.values()):g} > 1; each {args.per} gets one kind at most"
        )

    if args.command == "toy":
        root = _toy_root(toy, args.root)
        manifest = root / "toy.json"  # a toy set made before: its own sizes and seed
        made = read_json(manifest, "a toy set's manifest") if manifest.is_file() else {}
        sizes = {key: made[key] for key in ("num_train", "num_test", "seed", "object_size") if key in made}
        dataset = ensure_toy_dataset(root, progress=not manifest.is_file(), **sizes)
        images = _voc_images(
            dataset.devkit, dataset.year, args.image_set, dataset.classes, sizes.get("seed", 0),
            sizes.get("object_size", OBJECT_SIZE),
        )  # fmt: skip
    elif args.command == "voc":
        images = _voc_images(args.devkit, str(args.year), args.image_set, VOC_CLASSES)
    else:
        data = _read_coco(args.annotations)
        images, annotations = _coco_images(data, args.annotations)
    kinds = simulate(images, fractions, args.per, args.seed)
    _refuse_empty_kinds(subcommand, images, kinds, fractions, args.per)

    counts: Counter[str] = Counter()
    side_file: dict[str, list[dict]] = {}
    coco_fields = []
    for index, ((image_id, _, objects), image_kinds) in enumerate(zip(images, kinds, strict=True)):
        rng = np.random.default_rng([args.seed, index])
        entries = []
        for (name, obj), kind in zip(objects, image_kinds, strict=True):
            counts[kind or "tag"] += 1
            if kind is None:
                coco_fields.append({"use_as": "tag"})
                continue
            geometry = simulate_partial_label(kind, obj, rng)
            entries.append({"class": name, kind: geometry})
            coco_fields.append({"use_as": kind, **({} if kind == "box" else {kind: geometry})})
        if entries:
            side_file[str(image_id)] = entries

    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.command == "coco":
        for ann, fields in zip(annotations, coco_fields, strict=True):
            ann.update(fields)
        with atomic_write(args.output, "w") as f:
            json.dump(data, f)
    else:
        write_partial_labels_file(args.output, side_file)
    print(
        f"{args.output}: {len(images)} images, {len(side_file)} with partial labels; objects:"
        f" {counts['point']} points, {counts['scribble']} scribbles, {counts['box']} boxes,"
        f" {counts['tag']} image labels only"
    )
    return 0


def _refuse_empty_kinds(
    parser: argparse.ArgumentParser,
    images: list[Image],
    kinds: list[list[str | None]],
    fractions: dict[str, float],
    per: str,
) -> None:
    """Each kind asked for is given to some unit: a fraction that rounds to none (``--boxes 0.001`` of
    600 images) would write a file without it, which trains as image labels alone while the command
    says otherwise."""
    if per == "image":
        units, unit = sum(bool(objects) for _, _, objects in images), "image with objects"
    else:
        units, unit = sum(len(objects) for _, _, objects in images), "object"
    if not units:
        parser.error("nothing to label: no image has an object (difficult and crowd objects never count)")
    drawn = {kind for image_kinds in kinds for kind in image_kinds if kind is not None}
    for kind, fraction in fractions.items():
        if kind not in drawn:
            parser.error(
                f"{OPTIONS[kind]} {fraction:g} gives no {unit} a {kind} ({fraction:g} of {units} rounds to"
                f" none); give at least 1/{units}"
            )


if __name__ == "__main__":
    run_tool(lambda _: main(), None)  # an error (bad input): one line and exit status 1, as every tool
