"""What tools/split_pseudo_labels.py does, importable: the first step of the third stage (docs/METHOD.md
§14; SoS-WSOD's split, ``wsod.engine.loss_split``).

``split_from_config`` (configs/split.yaml): a second-stage checkpoint (the reference's is the one from
just before the first learning-rate step), the pseudo-label json that stage trained on, and ``k`` in.
Each image of the json is scored by the detector's four training losses against its own pseudo boxes
(``image_losses``: both samplers' positive fraction ``positive_fraction``, one deterministic view at
``scale``, samplers seeded from ``seed``), and the ``k`` of lowest loss are "labelled": the third stage
trains on their boxes, and on the image labels alone of the others. Out, in ``output_dir`` (default:
the pseudo-label json's folder): ``split.json`` (``wsod.data.labelled_split``), and in that folder's
``log.txt`` a per-class table of the labelled share and, where the training set has ground-truth boxes,
the precision and recall at IoU 0.5 of the labelled and unlabelled images' pseudo boxes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from wsod.build import build_stage2_train_dataset, load_detector, prepare_data
from wsod.config_checks import SPLIT_RULES, ConfigError, check_config
from wsod.data.labelled_split import SPLIT_FILE, split_json, write_split
from wsod.data.loader import build_test_loader
from wsod.data.pseudo_boxes import check_pseudo_boxes_file, relative_file_names
from wsod.data.transforms import test_transform
from wsod.engine.loss_split import image_losses, lowest_loss
from wsod.engine.pseudo_boxes import pseudo_box_quality
from wsod.evaluation.coco import format_percent
from wsod.modeling.faster_rcnn import ARCHITECTURE
from wsod.progress import progress_bar
from wsod.runs.prologue import refuse_to_overwrite, run_in_directory

__all__ = ["split_from_config", "split_scale"]

logger = logging.getLogger("wsod")


def split_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Split the pseudo-labelled images of ``cfg.pseudo_labels`` (module docstring); returns the summary
    (``labelled``, ``images``, ``per_class``, and ``quality`` with ground truth). One process."""
    check_config(cfg, SPLIT_RULES)
    check_pseudo_boxes_file(cfg.pseudo_labels)
    output_dir = cfg.output_dir or str(Path(cfg.pseudo_labels).parent)
    return run_in_directory(cfg, output_dir, "runs/split", _split_in, claim=_refuse_overwrite)


def split_scale(cfg: DictConfig) -> int:
    """The view's shorter side: ``scale``, or the middle of ``data.train.scales`` (sorted) when null."""
    if cfg.scale is not None:
        return int(cfg.scale)
    scales = sorted(int(s) for s in cfg.data.train.scales)
    return scales[len(scales) // 2]


def _refuse_overwrite(out_dir: Path, cfg: DictConfig) -> str | None:
    target = out_dir / SPLIT_FILE
    return refuse_to_overwrite([target] if target.exists() else [], cfg.overwrite)


def _split_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    logger.info("command: %s", " ".join(sys.argv))
    model, metadata = load_detector(
        cfg.checkpoint, device, trust=cfg.trust_checkpoint, eval_weights="student"
    )
    if metadata.get("architecture") != ARCHITECTURE:
        raise ConfigError(
            f"checkpoint={cfg.checkpoint}: a first-stage checkpoint; the split scores images with the"
            " second stage's Faster R-CNN (a model_<iteration>.pth of tools/train_stage2.py)"
        )
    prepare_data(cfg.data, progress=cfg.progress)
    scale = split_scale(cfg)
    view = test_transform(scale, cfg.data.train.max_size)  # deterministic: no flip, no lighting
    dataset = build_stage2_train_dataset(cfg.data, cfg.pseudo_labels, transform=view)
    classes = list(metadata["classes"])
    if list(dataset.classes) != classes:
        raise ValueError(
            f"{cfg.checkpoint} was trained on classes {classes}, data.train holds {list(dataset.classes)}:"
            " split with the data config of the second stage"
        )
    sets = getattr(dataset, "datasets", [dataset])
    records = [r for d in sets for r in d.records]
    if not 1 <= cfg.k <= len(records):
        raise ConfigError(
            f"k={cfg.k}: the pseudo-label json holds {len(records)} training images; give k in"
            f" 1..{len(records)}"
        )
    logger.info(
        "scoring %d pseudo-labelled images with %s (shorter side %d, positive fraction %s); the %d of"
        " lowest loss become labelled", len(records), cfg.checkpoint, scale, cfg.positive_fraction, cfg.k,
    )  # fmt: skip
    loader = build_test_loader(dataset, 1, num_workers=cfg.data.test.num_workers)
    batches = progress_bar(loader, shown=cfg.progress, desc="split")
    scores = image_losses(
        model, batches, device=device, seed=cfg.seed, positive_fraction=cfg.positive_fraction
    )
    chosen = set(lowest_loss(scores, cfg.k))
    labelled = [s.image_id in chosen for s in scores]
    per_class = _per_class(records, labelled, classes)
    info = {
        "description": "wsod third-stage split (tools/split_pseudo_labels.py)",
        "pseudo_labels": str(cfg.pseudo_labels),
        "checkpoint": str(cfg.checkpoint),
        "k": int(cfg.k),
        "images": len(records),
        "scale": scale,
        "max_size": cfg.data.train.max_size,
        "seed": int(cfg.seed),
        "positive_fraction": float(cfg.positive_fraction),
    }
    summary: dict[str, Any] = {"images": len(records), "labelled": int(cfg.k), "per_class": per_class}
    if all(d.has_ground_truth for d in sets):
        truth = [t for d in sets for t in d.ground_truth()]
        summary["quality"] = _quality(records, truth, labelled, len(classes))
    content = split_json(
        [r.image_id for r in records], relative_file_names(records), [s.losses for s in scores],
        labelled, per_class, info, summary.get("quality"),
    )  # fmt: skip
    write_split(content, out_dir / SPLIT_FILE)
    logger.info("%s\nsplit written to %s", _table(summary, classes), out_dir / SPLIT_FILE)
    return {**summary, "output": str(out_dir / SPLIT_FILE)}


def _per_class(records: list, labelled: list[bool], classes: list[str]) -> dict[str, dict[str, Any]]:
    """Per class: the images holding it among their labels, how many are labelled, the share."""
    out = {}
    for c, name in enumerate(classes):
        holding = [flag for r, flag in zip(records, labelled, strict=True) if r.labels[c] > 0]
        share = sum(holding) / len(holding) if holding else None
        out[name] = {"images": len(holding), "labelled": sum(holding), "share": share}
    return out


def _pseudo(record) -> dict[str, torch.Tensor]:
    boxes = torch.as_tensor(record.supervision["boxes"], dtype=torch.float32).reshape(-1, 4)
    labels = torch.as_tensor(record.supervision["box_labels"], dtype=torch.int64)
    return {"boxes": boxes, "labels": labels, "scores": torch.ones(len(labels))}


def _quality(
    records: list, truth: list[dict[str, torch.Tensor]], labelled: list[bool], num_classes: int
) -> dict[str, dict[str, float]]:
    """Precision and recall at IoU 0.5 of the labelled and of the unlabelled images' pseudo boxes against
    ``truth`` (the datasets' ``ground_truth()``, in ``records``' order)."""
    out = {}
    for part, wanted in (("labelled", True), ("unlabelled", False)):
        mine = [i for i, flag in enumerate(labelled) if flag == wanted]
        if not mine:
            continue
        pseudo = [_pseudo(records[i]) for i in mine]
        quality = pseudo_box_quality(pseudo, [truth[i] for i in mine], num_classes)
        out[part] = {"images": len(mine), "precision": quality["precision"], "recall": quality["recall"]}
    return out


def _table(summary: dict[str, Any], classes: list[str]) -> str:
    """The per-class labelled share and a ``copypaste:`` line."""
    width = max(len(n) for n in ("class", *classes))
    header = f"{'class':<{width}}{'images':>10}{'labelled':>10}{'share':>10}"
    lines = [header, "-" * len(header)]
    for name in classes:
        row = summary["per_class"][name]
        share = "-" if row["share"] is None else f"{100 * row['share']:.1f}"
        lines.append(f"{name:<{width}}{row['images']:>10}{row['labelled']:>10}{share:>10}")
    lines.append("-" * len(header))
    line = f"copypaste: labelled={summary['labelled']}/{summary['images']}"
    for part, q in summary.get("quality", {}).items():
        precision, recall = (format_percent(q[key], missing="-") for key in ("precision", "recall"))
        line += f", {part} precision@0.5={precision} recall@0.5={recall}"
    return "\n".join([*lines, line])
