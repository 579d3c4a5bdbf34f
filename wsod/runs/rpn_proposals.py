"""What tools/rpn_proposals.py does, importable: proposals learned by the second stage (issue 39).

``rpn_proposals_from_config`` (configs/rpn_proposals.yaml): a second- or third-stage checkpoint's region
proposal network (the teacher's, for a third stage) runs over every image of the data config's training
sets and test set (``wsod.engine.rpn_proposals``) at one view (shorter side ``scale``), with
``pre_nms_top_n``, ``nms_iou`` and ``post_nms_top_n``. Out, in ``output_dir`` (default: the checkpoint's
folder's ``rpn_proposals``): one memory-mapped store per set (``train_<i>.proposals``, ``test.proposals``)
with each box's objectness score, a ``summary.json`` (boxes per image and, where a set has ground-truth
boxes, recall at IoU 0.5 and 0.7), and the ``data.*`` overrides that train on them in ``log.txt``.

No test label is used: the detector learnt from the training images' pseudo boxes, and the test images
are only seen here, as at evaluation.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from wsod.build import build_proposal_datasets, load_detector, prepare_data
from wsod.config_checks import RPN_PROPOSALS_RULES, ConfigError, check_config
from wsod.data.proposals import STORE_SUFFIX, save_proposals
from wsod.data.proposals.recall import records_recall
from wsod.engine.rpn_proposals import rpn_proposal_set
from wsod.modeling.faster_rcnn import ARCHITECTURE
from wsod.runs.prologue import refuse_to_overwrite, run_in_directory

__all__ = ["rpn_proposals_from_config", "SUMMARY_FILE"]

logger = logging.getLogger("wsod")

SUMMARY_FILE = "summary.json"


def rpn_proposals_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Write the region proposals of ``cfg.checkpoint`` for ``cfg.data``'s sets (module docstring);
    returns the summary. One process."""
    check_config(cfg, RPN_PROPOSALS_RULES)
    output_dir = cfg.output_dir or str(Path(cfg.checkpoint).parent / "rpn_proposals")
    return run_in_directory(cfg, output_dir, "runs/rpn_proposals", _propose_in, claim=_refuse_overwrite)


def _refuse_overwrite(out_dir: Path, cfg: DictConfig) -> str | None:
    existing = sorted(out_dir.glob(f"*{STORE_SUFFIX}")) if out_dir.is_dir() else []
    return refuse_to_overwrite(existing, cfg.overwrite)


def _propose_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    logger.info("command: %s", " ".join(sys.argv))
    model, metadata = load_detector(cfg.checkpoint, device, trust=cfg.trust_checkpoint)
    if metadata.get("architecture") != ARCHITECTURE:
        raise ConfigError(
            f"checkpoint={cfg.checkpoint}: a first-stage checkpoint has no region proposal network; give a"
            " second- or third-stage one (tools/train_stage2.py, tools/train_stage3.py)"
        )
    prepare_data(cfg.data, progress=cfg.progress)
    scale = int(cfg.scale if cfg.scale is not None else cfg.data.test.scales[0])
    summary: dict[str, Any] = {"checkpoint": str(cfg.checkpoint), "scale": scale, "sets": {}}
    for name, dataset in build_proposal_datasets(cfg.data).items():
        proposals = rpn_proposal_set(
            model, dataset, scale=scale, max_size=cfg.data.test.max_size, pre_nms_top_n=cfg.pre_nms_top_n,
            post_nms_top_n=cfg.post_nms_top_n, nms_iou=cfg.nms_iou, device=device, progress=cfg.progress,
        )  # fmt: skip
        path = out_dir / f"{name}{STORE_SUFFIX}"
        save_proposals(proposals, path)
        row: dict[str, Any] = {
            "images": len(proposals),
            "boxes_per_image": proposals.num_boxes / max(1, len(proposals)),
        }
        report = records_recall(proposals, dataset.records, thresholds=(0.5, 0.7))
        if report is not None:
            row["recall"] = {"0.5": report.at(0.5), "0.7": report.at(0.7)}
        summary["sets"][name] = {**row, "path": str(path)}
        key = (
            "data.test.set.proposals" if name == "test" else f"data.train.sets.{name.split('_')[1]}.proposals"
        )
        logger.info(
            "%s: %d images, %.1f boxes per image%s -> %s (%s=%s)",
            name,
            row["images"],
            row["boxes_per_image"],
            "".join(f", recall@{t} {100 * r:.2f}" for t, r in row.get("recall", {}).items()),
            path,
            key,
            path,
        )
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
