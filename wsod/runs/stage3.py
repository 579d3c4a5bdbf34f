"""What tools/train_stage3.py does, importable: the third stage (docs/METHOD.md §14, docs/guides/
second_stage.md; SoS-WSOD's semi-supervised retraining).

``train_stage3_from_config`` (configs/stage3.yaml): the second stage's final weights (``initial_weights``)
start a student ``SemiSupervisedFasterRCNN`` and its EMA teacher (``solver.ema``, a ``Companion``); the
split (``split``, tools/split_pseudo_labels.py) divides the pseudo-labelled images (``pseudo_labels``)
into labelled ones (their boxes) and unlabelled ones (their image labels). Each step's batch joins
``solver.ims_per_batch`` labelled and ``semi_supervised.unlabelled_per_batch`` unlabelled images from two
loaders, each image a weak and a strong view; the teacher labels the unlabelled images' weak views and
the student learns from both (``wsod.modeling.semi_supervised_rcnn``). The loop, run directory, exact
resume, non-finite guard, DDP, sweeps and final evaluation are the other stages' (``wsod.runs.train``);
the teacher is evaluated (``semi_supervised.eval_weights``), and ``model_final.pth`` holds both, with
the teacher read by tools/eval.py and tools/predict.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from wsod.build import (
    build_ema_teacher,
    build_evaluator,
    build_loader,
    build_optimizer,
    build_scheduler,
    build_stage3_model,
    build_stage3_train_datasets,
    prepare_data,
)
from wsod.config_checks import STAGE3_RULES, ConfigError, check_config
from wsod.config_schema import plain
from wsod.data.loader import build_train_loader, concat_batches, infinite_batches
from wsod.data.pseudo_boxes import check_pseudo_boxes_file
from wsod.distributed import cleanup_distributed, is_main_process, setup_distributed
from wsod.engine.checkpoint import load_checkpoint
from wsod.modeling.faster_rcnn import ARCHITECTURE
from wsod.runs.train import begin_training_run, run_training, train_and_evaluate

__all__ = ["train_stage3_from_config", "joined_batches", "UNLABELLED_SEED_OFFSET"]

# The detector settings that shape its weights: the second stage's must be the third's (the others, such
# as the samplers' sizes and fractions, are training settings a recipe may change).
ARCHITECTURE_KEYS = (
    "backbone",
    "width",
    "norm",
    "fpn_channels",
    "anchor_sizes",
    "aspect_ratios",
    "representation_size",
)

# The unlabelled loader's shuffling and augmentation seed is the run's seed plus this, so that its order
# differs from the labelled loader's (the two hold different images; equal seeds would tie their orders).
UNLABELLED_SEED_OFFSET = 1


def train_stage3_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Train the third stage as ``cfg`` (configs/stage3.yaml) says; returns the loop's summary plus the
    final metrics (like ``wsod.runs.stage2.train_stage2_from_config``)."""
    check_config(cfg, STAGE3_RULES)
    check_pseudo_boxes_file(cfg.pseudo_labels)  # a wrong file is refused before the run folder exists
    setup_distributed()
    try:
        return run_training(cfg, _train_stage3_in)
    finally:
        cleanup_distributed()


def joined_batches(
    labelled: Iterator[dict[str, Any]], unlabelled: Iterator[dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """One batch of each stream per step, joined (``concat_batches``: the labelled rows first)."""
    for pair in zip(labelled, unlabelled, strict=False):
        yield concat_batches(pair)


def _read_initial_weights(cfg: DictConfig) -> dict[str, Any]:
    """The second stage's checkpoint (``initial_weights``, weights-only loading unless
    ``trust_checkpoint``), refused in one line when it is not a second-stage detector's; read before any
    data, so that a wrong file fails fast."""
    checkpoint = load_checkpoint(cfg.initial_weights, trust=cfg.trust_checkpoint)
    metadata = checkpoint.get("metadata") or {}
    if metadata.get("architecture") != ARCHITECTURE or "model" not in checkpoint:
        raise ConfigError(
            f"initial_weights={cfg.initial_weights}: not a second-stage checkpoint (give"
            " tools/train_stage2.py's model_final.pth)"
        )
    return checkpoint


def _load_initial_weights(
    model: torch.nn.Module, checkpoint: dict[str, Any], cfg: DictConfig, classes: list[str]
) -> None:
    """The second stage's final weights into the student, after checking that they are a detector of
    the same architecture and classes (one line naming the file and what differs)."""
    metadata = checkpoint["metadata"]
    where = f"initial_weights={cfg.initial_weights}"
    if list(metadata.get("classes", [])) != classes:
        raise ConfigError(f"{where}: trained on classes {metadata.get('classes')}, the data holds {classes}")
    saved, wanted = metadata["model"], plain(cfg.detector)
    differ = [k for k in ARCHITECTURE_KEYS if saved.get(k) != wanted.get(k)]
    if differ:
        shown = ", ".join(f"detector.{k}={saved.get(k)!r}" for k in differ)
        raise ConfigError(f"{where}: a detector of other settings; give the second stage's: {shown}")
    model.load_state_dict(checkpoint["model"])


def _train_stage3_in(run_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    resolved, resume_from, resumed_at = begin_training_run(run_dir, cfg, device)
    initial = _read_initial_weights(cfg)  # a resume's checkpoint replaces its weights
    prepare_data(cfg.data, progress=cfg.progress and is_main_process())
    labelled, unlabelled = build_stage3_train_datasets(cfg.data, cfg.pseudo_labels, cfg.split)
    evaluator = build_evaluator(cfg.data, device, cfg.progress, random_baseline=cfg.random_baseline)
    classes = list(labelled.classes)
    model = build_stage3_model(cfg.detector, len(classes), cfg.semi_supervised)
    _load_initial_weights(model, initial, cfg, classes)
    model = model.to(device)
    optimizer = build_optimizer(cfg.solver, model)
    scheduler = build_scheduler(cfg.solver, optimizer)
    teacher = build_ema_teacher(cfg.solver, model, device, str(cfg.semi_supervised.eval_weights))
    labelled_loader = build_loader(cfg, labelled, device)
    unlabelled_loader = build_train_loader(
        unlabelled, cfg.semi_supervised.unlabelled_per_batch, num_workers=cfg.data.train.num_workers,
        seed=cfg.seed + UNLABELLED_SEED_OFFSET, pin_memory=device.type == "cuda",
    )  # fmt: skip
    metadata = {
        "architecture": ARCHITECTURE,  # load_detector rebuilds a FasterRCNNDetector from these
        "model": {**resolved["detector"], "eval_weights": str(cfg.semi_supervised.eval_weights)},
        "classes": classes,
        "pseudo_labels": str(cfg.pseudo_labels),
        "split": str(cfg.split),
        "config": resolved,
    }
    # Both streams are functions of the step: batch n of each is the same in a resumed run.
    make_batches = lambda start: joined_batches(  # noqa: E731
        infinite_batches(labelled_loader, start), infinite_batches(unlabelled_loader, start)
    )
    return train_and_evaluate(
        run_dir, cfg, device, model=model, optimizer=optimizer, scheduler=scheduler, train_set=labelled,
        evaluator=evaluator, metadata=metadata, resume_from=resume_from, resumed_at=resumed_at,
        companions=[teacher], make_batches=make_batches,
    )  # fmt: skip
