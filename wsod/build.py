"""The one place that turns a Hydra config into objects. Modules never see the config; only this file
and the thin scripts in tools/ read it. See configs/ for the fields and their meaning."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from wsod.data.coco import CocoDataset
from wsod.data.dataset import ConcatWeakDataset, WeakDetectionDataset
from wsod.data.toy import ensure_toy_dataset
from wsod.data.transforms import train_transform
from wsod.data.voc import VOCDataset
from wsod.distributed import main_process_first
from wsod.engine.solver import build_optimizer as _build_optimizer
from wsod.engine.solver import build_scheduler as _build_scheduler
from wsod.modeling.detector import WeaklySupervisedDetector, build_detector

__all__ = [
    "resolve_device",
    "build_model",
    "prepare_data",
    "build_train_dataset",
    "build_test_dataset",
    "build_optimizer",
    "build_scheduler",
]


def resolve_device(name: str) -> torch.device:
    """ "auto" -> this process's CUDA device when CUDA is available (LOCAL_RANK under torchrun), else CPU."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(model_cfg: DictConfig | dict, num_classes: int) -> WeaklySupervisedDetector:
    """The detector from a ``configs/model`` node (every key is a ``build_detector`` argument)."""
    options: dict[str, Any] = (
        OmegaConf.to_container(model_cfg, resolve=True)
        if isinstance(model_cfg, DictConfig)
        else dict(model_cfg)
    )
    return build_detector(num_classes=num_classes, **options)


def prepare_data(data_cfg: DictConfig) -> None:
    """Generate what a dataset needs on first use (the toy set): the main process first, the others
    waiting and then finding it in place, so that ranks never generate it concurrently."""
    with main_process_first():
        if data_cfg.kind == "toy":
            _toy(data_cfg)


def _toy(data_cfg: DictConfig):
    return ensure_toy_dataset(data_cfg.root, num_train=data_cfg.num_train, num_test=data_cfg.num_test)


def _open(
    data_cfg: DictConfig, source: DictConfig, *, transform, max_proposals: int | None, drop_unlabelled: bool
) -> WeakDetectionDataset:
    options = dict(transform=transform, max_proposals=max_proposals, drop_unlabelled=drop_unlabelled)
    if data_cfg.kind == "toy":
        return _toy(data_cfg).dataset(source.image_set, **options)
    if data_cfg.kind == "voc":
        return VOCDataset(data_cfg.devkit, str(source.year), source.image_set, source.proposals, **options)
    if data_cfg.kind == "coco":
        return CocoDataset(source.annotations, source.images, source.proposals, **options)
    raise ValueError(f"data.kind must be toy, voc or coco, got '{data_cfg.kind}'")


def build_train_dataset(data_cfg: DictConfig) -> Dataset:
    """The training images of ``data.train`` (several sets are concatenated) with random transforms."""
    train = data_cfg.train
    transform = train_transform(list(train.scales), train.max_size, flip_prob=0.5 if train.flip else 0.0)
    # SPEC section 9: COCO images without any label are dropped from training.
    sets = [
        _open(
            data_cfg,
            source,
            transform=transform,
            max_proposals=train.max_proposals,
            drop_unlabelled=data_cfg.kind == "coco",
        )  # fmt: skip
        for source in train.sets
    ]
    return sets[0] if len(sets) == 1 else ConcatWeakDataset(sets)


def build_test_dataset(data_cfg: DictConfig) -> WeakDetectionDataset:
    """The images of ``data.test.set`` without a transform (``wsod.engine.inference.predict`` applies
    the test scales and flips)."""
    test = data_cfg.test
    return _open(data_cfg, test.set, transform=None, max_proposals=test.max_proposals, drop_unlabelled=False)


def build_optimizer(solver_cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    return _build_optimizer(
        model,
        name=solver_cfg.optimizer,
        lr=solver_cfg.lr,
        momentum=solver_cfg.momentum,
        weight_decay=solver_cfg.weight_decay,
        bias_lr_factor=solver_cfg.bias_lr_factor,
        bias_weight_decay=solver_cfg.bias_weight_decay,
    )


def build_scheduler(
    solver_cfg: DictConfig, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LambdaLR:
    return _build_scheduler(
        optimizer,
        milestones=list(solver_cfg.milestones),
        gamma=solver_cfg.gamma,
        warmup_iters=solver_cfg.warmup_iters,
        warmup_factor=solver_cfg.warmup_factor,
    )
