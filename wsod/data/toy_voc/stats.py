"""What the VOC-like set holds, measured: ``python -m wsod.data.toy_voc stats``.

Every difficulty ``wsod.data.toy_voc`` draws is counted on the generated folder (its xml files and
proposals) and on the objects' pixel masks (the images drawn again from their seeds), printed as a report
and written as ``{root}/stats.json``:

* objects: instances and images per class, instances per image (histogram, mean), the share of images
  with several objects of one class, the affinity pairs' co-occurrence (P(b | a): the share of the images
  holding a that also hold b, over non-difficult objects, as the image labels count them);
* occlusion (an object's pixels covered by a later one), truncation, difficult objects; object sides over
  the image's shorter side (percentiles), image sizes and aspect ratios; distractors per image;
* the most discriminative region of each class, measured: two logistic regressions (scikit-learn) learn
  the class from an object's body alone and from its part alone (colour statistics and outline shape on
  trainval objects); each class's recall on the test objects says which region tells it apart. Part
  domination is a real failure mode for the classes whose part wins;
* proposals: per image, recall at IoU 0.5 and 0.7 (``wsod.data.proposals.recall``) and part proposals
  per object by class (``wsod.data.proposals.parts``), after the same loading rules as training.

A folder that exists is measured as it is (its manifest says how it was drawn); an absent one is
generated first with ``--generator-seed`` (default 0).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from wsod.atomic import atomic_write
from wsod.data.json_files import read_json
from wsod.data.proposals.parts import records_part_proposals
from wsod.data.proposals.recall import records_recall
from wsod.data.toy_voc.generator import (
    AFFINITY_PAIRS,
    MANIFEST_NAME,
    PART_OF_CLASS,
    TOY_VOC_CLASSES,
    ToyVOCImage,
    ensure_toy_voc_dataset,
    render_toy_voc_image,
    split_ids,
)
from wsod.progress import progress_bar

__all__ = [
    "region_features",
    "discriminative_regions",
    "image_stats",
    "toy_voc_stats",
    "format_stats",
    "main",
]

logger = logging.getLogger(__name__)

MIN_REGION_PIXELS = 12  # a body or part with fewer visible pixels says too little to classify
_PERCENTILES = (5, 25, 50, 75, 95)


def region_features(image: np.ndarray, pixels: np.ndarray, outline: np.ndarray) -> np.ndarray:
    """(86,) float64 features of one region: its colour (mean and std of RGB and HSV over ``pixels``
    (H, W) bool) and its shape (``outline`` (H, W) bool cropped to its box: log Hu moments, fill ratio,
    log aspect, an 8 x 8 thumbnail)."""
    rgb = image[pixels].astype(np.float64)
    hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)[pixels].astype(np.float64)
    ys, xs = np.nonzero(outline)
    crop = outline[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].astype(np.float32)
    hu = cv2.HuMoments(cv2.moments(crop, binaryImage=True)).ravel()
    hu = np.sign(hu) * np.log10(np.abs(hu) + 1e-12)
    thumbnail = cv2.resize(crop, (8, 8), interpolation=cv2.INTER_AREA).ravel()
    shape = [crop.mean(), np.log(crop.shape[1] / crop.shape[0])]
    return np.concatenate([rgb.mean(0), rgb.std(0), hsv.mean(0), hsv.std(0), hu, shape, thumbnail])


def _regions(drawn: ToyVOCImage) -> list[tuple[int, np.ndarray | None, np.ndarray | None]]:
    """Per non-difficult object: (class, body features or None, part features or None)."""
    out = []
    for i in np.flatnonzero(~drawn.difficult):
        body, part = drawn.body_masks[i], drawn.part_masks[i]
        body_features = (
            region_features(drawn.image, body, drawn.body_shapes[i])
            if body.sum() >= MIN_REGION_PIXELS
            else None
        )
        part_features = region_features(drawn.image, part, part) if part.sum() >= MIN_REGION_PIXELS else None
        out.append((int(drawn.labels[i]), body_features, part_features))
    return out


def discriminative_regions(
    train: Sequence[tuple[int, np.ndarray | None, np.ndarray | None]],
    test: Sequence[tuple[int, np.ndarray | None, np.ndarray | None]],
    num_classes: int,
) -> dict[str, np.ndarray]:
    """Per class, the test recall (C,) of a classifier that sees the body only and of one that sees the
    part only, each fit on ``train``'s regions ((class, body features, part features) per object)."""
    recall = {}
    for name, column in (("body", 1), ("part", 2)):
        x_train = np.array([r[column] for r in train if r[column] is not None])
        y_train = np.array([r[0] for r in train if r[column] is not None])
        x_test = np.array([r[column] for r in test if r[column] is not None])
        y_test = np.array([r[0] for r in test if r[column] is not None])
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000))
        model.fit(x_train, y_train)
        predicted = model.predict(x_test)
        per_class = np.full(num_classes, np.nan)
        for c in range(num_classes):
            if (y_test == c).any():
                per_class[c] = float((predicted[y_test == c] == c).mean())
        recall[name] = per_class
    return recall


def image_stats(images: Sequence[ToyVOCImage], num_classes: int) -> dict[str, Any]:
    """The object, layout and distractor statistics of ``images`` (see the module doc)."""
    counts = np.array([len(d.labels) for d in images])
    labels = np.concatenate([d.labels for d in images])
    difficult = np.concatenate([d.difficult for d in images])
    truncated = np.concatenate([d.truncated for d in images])
    occluded = np.concatenate([d.occluded for d in images])
    shorts = np.array([min(d.image.shape[:2]) for d in images])
    relative = np.concatenate([d.sides / min(d.image.shape[:2]) for d in images])
    present = np.zeros((len(images), num_classes), bool)
    for i, d in enumerate(images):
        present[i, d.labels[~d.difficult]] = True
    aspects = {"landscape": 0, "portrait": 0, "square": 0}
    for d in images:
        h, w = d.image.shape[:2]
        aspects["landscape" if w > h else "portrait" if h > w else "square"] += 1
    several = [np.bincount(d.labels).max() >= 2 for d in images if len(d.labels)]
    pairs = []
    for a, b in AFFINITY_PAIRS:
        ia, ib = TOY_VOC_CLASSES.index(a), TOY_VOC_CLASSES.index(b)
        with_a, with_b = present[:, ia], present[:, ib]
        pairs.append(
            {
                "pair": [a, b],
                "p_b_given_a": float(with_b[with_a].mean()) if with_a.any() else None,
                "p_a_given_b": float(with_a[with_b].mean()) if with_b.any() else None,
            }
        )
    contexts = [d.context for d in images]
    return {
        "images": len(images),
        "instances_per_image": {
            "mean": float(counts.mean()),
            "histogram": {str(n): int((counts == n).sum()) for n in range(1, int(counts.max()) + 1)},
        },
        "images_with_several_of_one_class": float(np.mean(several)),
        "per_class_instances": np.bincount(labels, minlength=num_classes).tolist(),
        "per_class_images": present.sum(0).tolist(),
        "affinity": pairs,
        "objects": int(len(labels)),
        "occluded": float(occluded.mean()),
        "truncated": float(truncated.mean()),
        "difficult": float(difficult.mean()),
        "object_side_over_short_side": {f"p{q}": float(np.percentile(relative, q)) for q in _PERCENTILES},
        "short_side": {
            "min": int(shorts.min()),
            "median": float(np.median(shorts)),
            "max": int(shorts.max()),
        },
        "aspects": aspects,
        "loose_parts_per_image": float(np.mean([d.loose_parts for d in images])),
        "context_region_share": {
            k: float(np.mean([c == k for c in contexts])) for k in ("present", "absent")
        },
    }


def toy_voc_stats(
    root: str | Path = "data/toy_voc", *, generator_seed: int = 0, progress: bool = False
) -> dict:
    """The report of the set at ``root`` (generated first with ``generator_seed`` when absent)."""
    root = Path(root)
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_file():
        manifest = read_json(
            manifest_path, "the manifest the generator writes; delete the folder to remake it"
        )
        settings = {k: manifest.get(k) for k in ("generator_seed", "num_train", "num_test")}
    else:
        settings = {"generator_seed": generator_seed, "num_train": None, "num_test": None}
        settings = {k: v for k, v in settings.items() if v is not None}
    paths = ensure_toy_voc_dataset(root, progress=progress, **settings)  # checks the manifest
    manifest = read_json(manifest_path, "the manifest the generator writes")
    seed, num_train, num_test = manifest["generator_seed"], manifest["num_train"], manifest["num_test"]
    splits = split_ids(num_train, num_test)
    num_classes = len(TOY_VOC_CLASSES)

    report: dict[str, Any] = {"manifest": manifest, "classes": list(TOY_VOC_CLASSES)}
    regions: dict[str, list] = {}
    for split in ("trainval", "test"):
        numbers = [int(i) for i in splits[split]]
        drawn = []
        split_regions = []
        for number in progress_bar(numbers, shown=progress, desc=f"stats {split}"):
            image = render_toy_voc_image(seed, number)
            split_regions.extend(_regions(image))
            drawn.append(_light(image))
        regions[split] = split_regions
        report[split] = image_stats(drawn, num_classes)
        dataset = paths.dataset(split)
        recall = records_recall(dataset.proposals, dataset.records, thresholds=(0.5, 0.7))
        parts = records_part_proposals(dataset.proposals, dataset.records, TOY_VOC_CLASSES)
        assert recall is not None and parts is not None  # every image has boxes
        report[split]["proposals"] = {
            "per_image": recall.mean_proposals,
            "recall_0.5": recall.at(0.5),
            "recall_0.7": recall.at(0.7),
            "part_proposals_per_object": [None if np.isnan(v) else float(v) for v in parts.per_object()],
        }
    recall = discriminative_regions(regions["trainval"], regions["test"], num_classes)
    per_class = []
    for c, name in enumerate(TOY_VOC_CLASSES):
        body, part = recall["body"][c], recall["part"][c]
        per_class.append(
            {
                "class": name,
                "part": PART_OF_CLASS[c],
                "body_recall": float(body),
                "part_recall": float(part),
                "most_discriminative": "part" if part > body else "body",
            }
        )
    report["discriminative_region"] = per_class
    report["classes_told_apart_by_their_part"] = sum(r["most_discriminative"] == "part" for r in per_class)
    return report


def _light(drawn: ToyVOCImage) -> ToyVOCImage:
    """``drawn`` without its masks (what image_stats reads is kept): 3,500 images' masks do not fit."""
    empty = np.zeros((0, 1, 1), bool)
    return ToyVOCImage(
        **{**drawn.__dict__, "body_masks": empty, "part_masks": empty, "body_shapes": empty}  # fmt: skip
    )


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_stats(report: dict) -> str:
    """The report as text: one block per split, then the per-class table."""
    lines = [f"VOC-like set: {report['manifest']}"]
    for split in ("trainval", "test"):
        s = report[split]
        histogram = " ".join(f"{n}:{v}" for n, v in s["instances_per_image"]["histogram"].items())
        sides = " ".join(f"{k} {v:.2f}" for k, v in s["object_side_over_short_side"].items())
        pairs = ", ".join(
            f"{p['pair'][0]}+{p['pair'][1]} {_share(p['p_b_given_a'])}/{_share(p['p_a_given_b'])}"
            for p in s["affinity"]
        )
        proposals = s["proposals"]
        lines += [
            "",
            f"{split}: {s['images']} images, {s['objects']} objects",
            f"  instances per image: mean {s['instances_per_image']['mean']:.2f} ({histogram})",
            f"  images with several objects of one class: {s['images_with_several_of_one_class']:.1%}",
            f"  affinity P(b|a)/P(a|b): {pairs}",
            f"  occluded {s['occluded']:.1%}, truncated {s['truncated']:.1%}, difficult {s['difficult']:.1%}",
            f"  object side / shorter side: {sides}",
            f"  shorter side: {s['short_side']['min']}-{s['short_side']['max']} px (median"
            f" {s['short_side']['median']:.0f}); aspects {s['aspects']}",
            f"  distractors: {s['loose_parts_per_image']:.2f} loose parts per image; context regions in a"
            f" present class's colour {s['context_region_share']['present']:.1%}, an absent one's"
            f" {s['context_region_share']['absent']:.1%}",
            f"  proposals: {proposals['per_image']:.0f} per image, recall {proposals['recall_0.5']:.3f} at"
            f" IoU 0.5, {proposals['recall_0.7']:.3f} at 0.7",
        ]
    width = max(len(n) for n in TOY_VOC_CLASSES)
    header = (
        f"{'class':<{width}} {'part':<13} {'body recall':>11} {'part recall':>11} {'told by':>8}"
        f" {'parts/obj':>9}"
    )
    lines += ["", header, "-" * len(header)]
    part_counts = report["test"]["proposals"]["part_proposals_per_object"]
    for row, parts in zip(report["discriminative_region"], part_counts, strict=True):
        parts_text = "-" if parts is None else f"{parts:.1f}"
        lines.append(
            f"{row['class']:<{width}} {row['part']:<13} {row['body_recall']:>11.2f}"
            f" {row['part_recall']:>11.2f} {row['most_discriminative']:>8} {parts_text:>9}"
        )
    lines.append(
        f"{report['classes_told_apart_by_their_part']} of {len(TOY_VOC_CLASSES)} classes are told apart best"
        " by their part (test recall of a classifier on the part alone above one on the body alone)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m wsod.data.toy_voc", description="The VOC-like set (wsod.data.toy_voc)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    stats = commands.add_parser("stats", help="measure what the set holds; writes {root}/stats.json")
    stats.add_argument("--root", default="data/toy_voc", help="the set's folder (default: data/toy_voc)")
    stats.add_argument(
        "--generator-seed",
        type=int,
        default=0,
        help="the draw to generate when the folder is absent (default 0)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Asked for, but drawn on a terminal only (wsod.progress): in a log file frames would bury the report.
    report = toy_voc_stats(args.root, generator_seed=args.generator_seed, progress=True)
    print(format_stats(report))
    path = Path(args.root) / "stats.json"
    with atomic_write(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written: {path}")
    return 0
