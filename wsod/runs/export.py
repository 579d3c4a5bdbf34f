"""What tools/export_pseudo_labels.py does, importable: the first half of the second stage
(docs/METHOD.md §11, docs/guides/second_stage.md; ``wsod.runs.stage2`` trains on what it writes).

``export_from_config`` (configs/export.yaml): a trained checkpoint and a data config in; the training
sets' images predicted at the data config's test views (``data.test.scales``, ``max_size``, ``flip``: the
evaluation's test-time augmentation), every detection after the model's NMS kept
(``detections_per_image: null``), then each image's pseudo boxes chosen by the rule
(``wsod.engine.pseudo_boxes``, restricted to the image's labels, at least one box per label). Out, in
``output_dir`` (default ``<the checkpoint's folder>/pseudo_labels``): ``pseudo_labels.json`` (a COCO
instances json, ``wsod.data.pseudo_boxes``), ``summary.json`` (images, boxes per image, boxes per class,
labels given the whole image, and, where the training set has ground-truth boxes, the pseudo boxes'
precision and recall at IoU 0.5 per class), ``log.txt`` with the same table.

``ground_truth=true`` (no checkpoint, an ``output_dir``) writes the training sets' annotated boxes instead,
less the ``difficult`` ones: the file for the fully supervised bound (a second stage on the true boxes,
docs/RESULTS.md).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from wsod.build import build_export_datasets, load_detector, prepare_data
from wsod.config_checks import EXPORT_RULES, ConfigError, check_config
from wsod.data.dataset import ConcatWeakDataset
from wsod.data.pseudo_boxes import pseudo_boxes_json, write_pseudo_boxes
from wsod.engine.inference import predict
from wsod.engine.pseudo_boxes import PseudoBoxRule, pseudo_box_quality, select_pseudo_boxes
from wsod.evaluation.coco import format_percent
from wsod.runs.prologue import refuse_to_overwrite, run_in_directory

__all__ = ["export_from_config", "PSEUDO_LABELS_FILE", "SUMMARY_FILE"]

logger = logging.getLogger("wsod")

PSEUDO_LABELS_FILE = "pseudo_labels.json"
SUMMARY_FILE = "summary.json"


def export_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Export the pseudo boxes of ``cfg.checkpoint`` on ``cfg.data``'s training sets (module docstring);
    returns the summary. One process."""
    check_config(cfg, EXPORT_RULES)
    # ground_truth=true has no checkpoint folder: check_config has made sure output_dir is named then
    output_dir = cfg.output_dir or str(Path(cfg.checkpoint).parent / "pseudo_labels")
    return run_in_directory(cfg, output_dir, "runs/export", _export_in, claim=_refuse_overwrite)


def _refuse_overwrite(out_dir: Path, cfg: DictConfig) -> str | None:
    target = out_dir / PSEUDO_LABELS_FILE
    return refuse_to_overwrite([target] if target.exists() else [], cfg.overwrite)


def _rule(cfg: DictConfig, classes: list[str]) -> PseudoBoxRule:
    exempt = list(cfg.rule.containment_exempt or [])
    unknown = [name for name in exempt if name not in classes]
    if unknown:
        raise ConfigError(f"rule.containment_exempt={exempt}: {unknown} are not among the classes {classes}")
    return PseudoBoxRule(
        min_score=cfg.rule.min_score,
        containment=cfg.rule.containment,
        containment_exempt=tuple(classes.index(name) for name in exempt),
    )


def _export_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    logger.info("command: %s", " ".join(sys.argv))
    if cfg.ground_truth:
        return _export_ground_truth(out_dir, cfg)
    model, metadata = load_detector(cfg.checkpoint, device, trust=cfg.trust_checkpoint)
    classes = list(metadata["classes"])
    prepare_data(cfg.data, progress=cfg.progress)
    sets = build_export_datasets(cfg.data)
    if list(sets[0].classes) != classes:
        raise ValueError(
            f"{cfg.checkpoint} was trained on classes {classes}, data.train holds {list(sets[0].classes)}:"
            " export with the data config the checkpoint was trained on"
        )
    dataset = sets[0] if len(sets) == 1 else ConcatWeakDataset(sets)
    records = [r for d in sets for r in d.records]
    _check_distinct_ids(records)
    rule = _rule(cfg, classes)
    test = cfg.data.test
    # Without a cap, every detection after NMS: the rule, not a cap, decides what is kept.
    cap = sys.maxsize if cfg.detections_per_image is None else cfg.detections_per_image
    settings = replace(model.detection_settings, detections_per_image=cap)
    logger.info(
        "exporting pseudo boxes of %s on %d training images (%s), views %s%s, rule %s",
        cfg.checkpoint, len(records), ", ".join(str(dict(s)) for s in cfg.data.train.sets), list(test.scales),
        " + flips" if test.flip else "", rule,
    )  # fmt: skip
    with torch.no_grad():
        detections = predict(
            model, dataset, scales=list(test.scales), max_size=test.max_size, flip=test.flip,
            batch_size=test.batch_size, num_workers=test.num_workers, device=device, amp=test.amp,
            progress=cfg.progress, settings=settings,
        )  # fmt: skip
    chosen, whole_image = [], 0
    for record, found in zip(records, detections, strict=True):
        labels = torch.as_tensor(record.labels)
        boxes, fallback = select_pseudo_boxes(found, labels, (record.height, record.width), rule)
        chosen.append(boxes)
        whole_image += len(fallback)
    category_ids = list(getattr(sets[0], "category_ids", range(1, len(classes) + 1)))
    info = {
        "description": "wsod pseudo ground truth (tools/export_pseudo_labels.py)",
        "checkpoint": str(cfg.checkpoint),
        "rule": {
            "min_score": rule.min_score,
            "containment": rule.containment,
            "containment_exempt": list(cfg.rule.containment_exempt or []),
        },
        "views": {"scales": list(test.scales), "max_size": test.max_size, "flip": bool(test.flip)},
    }
    return _write(out_dir, records, chosen, classes, category_ids, info, whole_image, sets)


def _export_ground_truth(out_dir: Path, cfg: DictConfig) -> dict[str, Any]:
    """The training sets' annotated boxes as the pseudo-label file: what a second stage trained on them
    reaches is the fully supervised bound of the first stages' results. The ``difficult`` objects are left
    out, as they are from the image labels (``wsod.data.voc``), so the bound is supervised on exactly the
    objects the weak labels name; each box scores 1."""
    prepare_data(cfg.data, progress=cfg.progress)
    sets = build_export_datasets(cfg.data)
    if not all(d.has_ground_truth for d in sets):
        raise ValueError(
            f"ground_truth=true: data.train.sets={[dict(s) for s in cfg.data.train.sets]} have images without"
            " annotated boxes; the true boxes need a data config whose training images are annotated"
        )
    classes = list(sets[0].classes)
    records = [r for d in sets for r in d.records]
    _check_distinct_ids(records)
    chosen = []
    for truth in (t for d in sets for t in d.ground_truth()):
        kept = ~truth["difficult"]
        labels = truth["labels"][kept]
        chosen.append({"boxes": truth["boxes"][kept], "labels": labels, "scores": torch.ones(len(labels))})
    logger.info("exporting the annotated boxes of %d training images as pseudo labels", len(records))
    category_ids = list(getattr(sets[0], "category_ids", range(1, len(classes) + 1)))
    info = {"description": "wsod ground-truth boxes (tools/export_pseudo_labels.py ground_truth=true)"}
    return _write(out_dir, records, chosen, classes, category_ids, info, 0, sets)


def _write(
    out_dir: Path,
    records: list,
    chosen: list[dict],
    classes: list[str],
    category_ids: list[int],
    info: dict[str, Any],
    whole_image: int,
    sets: list,
) -> dict[str, Any]:
    """Write the pseudo-label json and its summary into ``out_dir``; returns the summary."""
    content = pseudo_boxes_json(records, chosen, classes, category_ids, info)
    write_pseudo_boxes(content, out_dir / PSEUDO_LABELS_FILE)
    summary = _summary(records, chosen, classes, whole_image, sets)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    logger.info(
        "%s\npseudo boxes written to %s", _format_summary(summary, classes), out_dir / PSEUDO_LABELS_FILE
    )
    return {**summary, "output": str(out_dir / PSEUDO_LABELS_FILE)}


def _check_distinct_ids(records: list) -> None:
    seen: dict[Any, str] = {}
    for r in records:
        if r.image_id in seen:
            raise ValueError(
                f"image id {r.image_id!r} names two training images ({seen[r.image_id]}, {r.path})"
            )
        seen[r.image_id] = r.path


def _summary(
    records: list, chosen: list[dict], classes: list[str], whole_image: int, sets: list
) -> dict[str, Any]:
    counts = torch.tensor([len(c["labels"]) for c in chosen])
    per_class = torch.zeros(len(classes), dtype=torch.long)
    for c in chosen:
        per_class += torch.bincount(c["labels"], minlength=len(classes))
    summary: dict[str, Any] = {
        "images": len(records),
        "boxes": int(counts.sum()),
        "boxes_per_image": {"mean": counts.float().mean().item(), "max": int(counts.max())},
        "boxes_per_class": dict(zip(classes, per_class.tolist(), strict=True)),
        "labels_given_the_whole_image": whole_image,
    }
    if all(d.has_ground_truth for d in sets):
        truth = [t for d in sets for t in d.ground_truth()]
        quality = pseudo_box_quality(chosen, truth, len(classes))
        summary["quality"] = {
            "iou": 0.5,
            "precision": quality["precision"],
            "recall": quality["recall"],
            "per_class": {
                name: {
                    "precision": quality["class_precision"][c].item(),
                    "recall": quality["class_recall"][c].item(),
                    "boxes": int(quality["pseudo_boxes"][c]),
                    "objects": int(quality["objects"][c]),
                }
                for c, name in enumerate(classes)
            },
        }
    return summary


def _format_summary(summary: dict[str, Any], classes: list[str]) -> str:
    """A per-class table of the export (boxes, and precision / recall where there is ground truth) and a
    ``copypaste:`` line."""
    quality = summary.get("quality")
    width = max(len(n) for n in ("class", *classes))
    header = f"{'class':<{width}}{'boxes':>10}" + (
        f"{'objects':>10}{'precision':>12}{'recall':>10}" if quality else ""
    )
    lines = [header, "-" * len(header)]
    for name in classes:
        row = f"{name:<{width}}{summary['boxes_per_class'][name]:>10}"
        if quality:
            q = quality["per_class"][name]
            precision, recall = (format_percent(q[k], missing="-") for k in ("precision", "recall"))
            row += f"{q['objects']:>10}{precision:>12}{recall:>10}"
        lines.append(row)
    lines.append("-" * len(header))
    line = (
        f"copypaste: images={summary['images']}, boxes={summary['boxes']},"
        f" boxes/image={summary['boxes_per_image']['mean']:.2f},"
        f" whole-image labels={summary['labels_given_the_whole_image']}"
    )
    if quality:
        precision, recall = format_percent(quality["precision"]), format_percent(quality["recall"])
        line += f", precision@0.5={precision}, recall@0.5={recall}"
    return "\n".join([*lines, line])
