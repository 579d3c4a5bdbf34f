"""What tools/eval.py does, importable: ``evaluate_from_config``, a composed config (configs/eval.yaml)
in, an evaluation directory out (predictions, metrics, the report, and VOC devkit or COCO result files),
in the prologue every entry point shares (``wsod.runs.prologue.run_in_directory``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from wsod.build import build_evaluator, load_detector, prepare_data
from wsod.config_checks import EVAL_RULES, ConfigError, check_config
from wsod.config_compat import upgrade_saved_config
from wsod.config_schema import plain
from wsod.data.formats import dataset_format
from wsod.distributed import cleanup_distributed, is_main_process, setup_distributed
from wsod.engine.checkpoint import load_checkpoint
from wsod.engine.evaluate import write_evaluation
from wsod.runs.prologue import run_in_directory

__all__ = ["evaluate_from_config"]

logger = logging.getLogger("wsod")


def evaluate_from_config(cfg: DictConfig) -> dict[str, float]:
    """Evaluate ``cfg.checkpoint`` (configs/eval.yaml) on ``cfg.data``'s test set; writes predictions,
    metrics, the report, and VOC devkit or COCO result files to ``cfg.output_dir``."""
    check_config(cfg, EVAL_RULES)
    setup_distributed()
    try:
        return _evaluate(cfg)
    finally:
        cleanup_distributed()


def _evaluate(cfg: DictConfig) -> dict[str, float]:
    return run_in_directory(cfg, cfg.output_dir, "runs/eval", _evaluate_in)


def _evaluate_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, float]:
    eval_weights = None if cfg.eval_weights is None else str(cfg.eval_weights)
    model, metadata = load_detector(
        cfg.checkpoint, device, trust=cfg.trust_checkpoint, eval_weights=eval_weights
    )
    if eval_weights is not None:
        logger.info("evaluating the %s weights of %s (eval_weights)", eval_weights, cfg.checkpoint)
    _check_seeded_split(cfg, metadata.get("config"))
    prepare_data(cfg.data, progress=cfg.progress and is_main_process())
    evaluator = build_evaluator(cfg.data, device, cfg.progress)
    test_set = evaluator.dataset
    if list(metadata["classes"]) != list(test_set.classes):
        raise ValueError(
            f"{cfg.checkpoint} was trained on classes {metadata['classes']} ({len(metadata['classes'])}),"
            f" the test set has {list(test_set.classes)} ({len(test_set.classes)}): evaluate a checkpoint"
            " trained on this data, or test on data of the checkpoint's classes (a folder dataset takes"
            " its class list from data.classes or <root>/classes.txt)"
        )
    if cfg.predictions:
        saved = load_checkpoint(cfg.predictions, trust=cfg.trust_checkpoint)
        missing = [key for key in ("image_ids", "detections") if key not in saved]
        if missing:
            raise ConfigError(
                f"predictions={cfg.predictions}: not a predictions file ({', '.join(missing)} missing): give"
                " the predictions.pth an evaluation wrote, or drop predictions= to predict again"
            )
        if list(saved["image_ids"]) != list(test_set.image_ids):
            raise ValueError(f"{cfg.predictions} holds predictions for other images than {cfg.data.test.set}")
        logger.info("reusing predictions from %s (not recomputed)", cfg.predictions)
        result = evaluator.score(saved["detections"], model, random_baseline=cfg.random_baseline)
    else:
        with torch.no_grad():
            result = evaluator(model, random_baseline=cfg.random_baseline)
    write_evaluation(result, test_set, out_dir)
    return {**result.metrics, **result.extra}


def _check_seeded_split(cfg: DictConfig, trained: dict[str, Any] | None) -> None:
    """Refuse to evaluate on another run-time split than the one the checkpoint was trained on (a folder
    whose labels.csv has no split column, split by seed): its test images would include training images,
    silently. ``trained``: the checkpoint's saved config, read in today's layout."""
    if not trained:
        return
    trained_data = upgrade_saved_config(trained).get("data") or {}
    data_format = dataset_format(cfg.data.kind)
    if trained_data.get("kind") != cfg.data.kind or data_format.split_conflict is None:
        return
    problem = data_format.split_conflict(trained_data, plain(cfg.data))
    if problem:
        raise ConfigError(f"{cfg.checkpoint} {problem}")
