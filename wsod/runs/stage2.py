"""What tools/train_stage2.py does, importable: the second half of the second stage (docs/METHOD.md §11,
docs/guides/second_stage.md; ``wsod.runs.export`` writes the pseudo boxes it trains on).

``train_stage2_from_config`` (configs/stage2.yaml): torchvision's Faster R-CNN (``configs/detector/``)
trained on those boxes by the weakly-supervised model's own loop (``wsod.engine.train``: the run
directory with ``config.yaml``, ``log.txt``, ``metrics.jsonl`` and tensorboard, atomic checkpoints, exact
resume, the non-finite guard, gradient accumulation, AMP, DDP under torchrun, sweeps with ``-m``), then
evaluated by the same ``Evaluator`` on the data config's test set. Its checkpoints record
``architecture: faster_rcnn``, so tools/eval.py, tools/predict.py and the export itself take them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from wsod.build import (
    build_evaluator,
    build_optimizer,
    build_scheduler,
    build_stage2_model,
    build_stage2_train_dataset,
    prepare_data,
)
from wsod.config_checks import STAGE2_RULES, check_config
from wsod.data.pseudo_boxes import check_pseudo_boxes_file
from wsod.distributed import cleanup_distributed, is_main_process, main_process_first, setup_distributed
from wsod.modeling.faster_rcnn import ARCHITECTURE
from wsod.runs.train import begin_training_run, run_training, train_and_evaluate

__all__ = ["train_stage2_from_config"]


def train_stage2_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Train the second-stage detector as ``cfg`` (configs/stage2.yaml) says; returns the loop's summary
    plus the final metrics (like ``wsod.runs.train.train_from_config``)."""
    check_config(cfg, STAGE2_RULES)
    check_pseudo_boxes_file(cfg.pseudo_labels)  # a wrong file is refused before the run folder exists
    setup_distributed()
    try:
        return run_training(cfg, _train_stage2_in)
    finally:
        cleanup_distributed()


def _train_stage2_in(run_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    resolved, resume_from, resumed_at = begin_training_run(run_dir, cfg, device)
    prepare_data(cfg.data, progress=cfg.progress and is_main_process())
    train_set = build_stage2_train_dataset(cfg.data, cfg.pseudo_labels)
    evaluator = build_evaluator(cfg.data, device, cfg.progress, random_baseline=cfg.random_baseline)
    with main_process_first():  # ImageNet weights: fetched into torch hub's cache once, then read
        model = build_stage2_model(cfg.detector, train_set.num_classes).to(device)
    optimizer = build_optimizer(cfg.solver, model)
    scheduler = build_scheduler(cfg.solver, optimizer)
    metadata = {
        "architecture": ARCHITECTURE,  # load_detector rebuilds a FasterRCNNDetector from these
        "model": resolved["detector"],
        "classes": list(train_set.classes),
        "pseudo_labels": str(cfg.pseudo_labels),
        "config": resolved,
    }
    return train_and_evaluate(
        run_dir, cfg, device, model=model, optimizer=optimizer, scheduler=scheduler, train_set=train_set,
        evaluator=evaluator, metadata=metadata, resume_from=resume_from, resumed_at=resumed_at,
    )  # fmt: skip
