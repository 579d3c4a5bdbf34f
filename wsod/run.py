"""What tools/train.py and tools/eval.py do, importable: a composed config in, a run directory out.

Like ``build.py`` this file reads the config; everything it calls takes plain values.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from wsod.build import (
    build_evaluator,
    build_model,
    build_optimizer,
    build_scheduler,
    build_train_dataset,
    load_detector,
    prepare_data,
    resolve_device,
)
from wsod.data.loader import build_train_loader, infinite_batches
from wsod.distributed import (
    broadcast_object,
    cleanup_distributed,
    get_world_size,
    is_main_process,
    main_process_first,
    setup_distributed,
)
from wsod.engine.checkpoint import load_checkpoint, save_checkpoint
from wsod.engine.evaluate import write_evaluation
from wsod.engine.run_log import RunLog
from wsod.engine.train import train

__all__ = [
    "train_from_config",
    "evaluate_from_config",
    "setup_distributed",
    "setup_logging",
    "choose_output_dir",
]

logger = logging.getLogger("wsod")


def choose_output_dir(output_dir: str | None, parent: str) -> Path:
    """``output_dir``, or ``<parent>/<date>_<time>`` when it is null, chosen once by the main process
    and shared: under torchrun every rank must write to (and resume from) the same directory, and
    clocks read one by one can fall on both sides of a second."""
    if output_dir is None and is_main_process():
        output_dir = str(Path(parent) / time.strftime("%Y-%m-%d_%H-%M-%S"))
    return Path(broadcast_object(output_dir))


def setup_logging(run_dir: Path, main: bool) -> None:
    """INFO to the console and to ``run_dir/log.txt`` on the main process; warnings only elsewhere."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if main else logging.WARNING)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if main:
        handlers.append(logging.FileHandler(run_dir / "log.txt"))
    for handler in root.handlers[:]:
        if getattr(handler, "_wsod", False):
            root.removeHandler(handler)
    for handler in handlers:
        handler.setFormatter(formatter)
        handler._wsod = True  # ours to replace when called again (tests run several trainings)
        root.addHandler(handler)


def train_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` (configs/train.yaml) says; returns the engine's summary plus the final metrics."""
    setup_distributed()
    try:
        return _train(cfg)
    finally:
        cleanup_distributed()


def _train(cfg: DictConfig) -> dict[str, Any]:
    main = is_main_process()
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.resume and cfg.output_dir is None:
        raise ValueError("resume=true needs the run to continue: output_dir=runs/<the run's directory>")
    run_dir = choose_output_dir(cfg.output_dir, "runs")
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, main)
    if main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        logger.info("command: %s", " ".join(sys.argv))
        logger.info("run directory %s, device %s, %d process(es)", run_dir, device, get_world_size())
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank

    prepare_data(cfg.data)
    train_set = build_train_dataset(cfg.data)
    evaluator = build_evaluator(cfg.data, device, cfg.progress)
    with main_process_first():  # ImageNet weights: fetched into torch hub's cache once, then read
        model = build_model(cfg.model, train_set.num_classes, cfg.method).to(device)
    optimizer = build_optimizer(cfg.solver, model)
    scheduler = build_scheduler(cfg.solver, optimizer)
    wrapped = model
    if get_world_size() > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    loader = build_train_loader(
        train_set, cfg.solver.ims_per_batch, num_workers=cfg.data.train.num_workers, seed=cfg.seed,
        pin_memory=device.type == "cuda",
    )  # fmt: skip
    metadata = {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "method": OmegaConf.to_container(cfg.method, resolve=True),
        "classes": list(train_set.classes),
    }
    summary = train(
        wrapped, optimizer, scheduler, lambda start: infinite_batches(loader, start),
        max_iter=cfg.solver.max_iter, run_dir=run_dir, device=device, accumulation=cfg.solver.accumulation,
        amp=cfg.solver.amp, resume=cfg.resume, checkpoint_period=cfg.checkpoint_period,
        keep_checkpoints=cfg.keep_checkpoints, log_period=cfg.log_period, eval_period=cfg.eval_period,
        evaluator=evaluator, max_nonfinite=cfg.max_nonfinite, progress=cfg.progress, metadata=metadata,
    )  # fmt: skip

    # The final evaluation runs once model_final.pth is on disk, so a failing evaluation loses no work.
    model.eval()
    with torch.no_grad():
        final = evaluator(model, random_baseline=cfg.random_baseline)
    write_evaluation(final, evaluator.dataset, run_dir / "eval")
    with RunLog(run_dir, enabled=main) as run_log:
        run_log.record("eval", summary["iteration"], {**final.metrics, **final.extra})
    _keep_if_best(run_dir, summary, final.metrics.get(evaluator.primary_metric), evaluator.primary_metric)
    summary["final"] = {**final.metrics, **final.extra}
    return summary


def _keep_if_best(run_dir: Path, summary: dict[str, Any], value: float | None, metric: str) -> None:
    """Make the final model ``model_best.pth`` when its evaluation beats every periodic one."""
    best = summary.get("best")
    if value is None or (best is not None and value <= best["value"]):
        return
    summary["best"] = {"value": value, "iteration": summary["iteration"]}
    if is_main_process():
        final = load_checkpoint(run_dir / "model_final.pth")
        save_checkpoint({**final, "best": {**summary["best"], "metric": metric}}, run_dir / "model_best.pth")


def evaluate_from_config(cfg: DictConfig) -> dict[str, float]:
    """Evaluate ``cfg.checkpoint`` (configs/eval.yaml) on ``cfg.data``'s test set; writes predictions,
    metrics, the report, and VOC devkit or COCO result files to ``cfg.output_dir``."""
    setup_distributed()
    try:
        return _evaluate(cfg)
    finally:
        cleanup_distributed()


def _evaluate(cfg: DictConfig) -> dict[str, float]:
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = choose_output_dir(cfg.output_dir, "runs/eval")
    out_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(out_dir, is_main_process())
    model, metadata = load_detector(cfg.checkpoint, device)
    prepare_data(cfg.data)
    evaluator = build_evaluator(cfg.data, device, cfg.progress)
    test_set = evaluator.dataset
    if list(metadata["classes"]) != list(test_set.classes):
        raise ValueError(
            f"{cfg.checkpoint} was trained on classes {metadata['classes']}, the test set has"
            f" {list(test_set.classes)}"
        )
    if cfg.predictions:
        saved = load_checkpoint(cfg.predictions)
        if list(saved["image_ids"]) != list(test_set.image_ids):
            raise ValueError(f"{cfg.predictions} holds predictions for other images than {cfg.data.test.set}")
        logger.info("reusing predictions from %s (not recomputed)", cfg.predictions)
        result = evaluator.score(saved["detections"], model, random_baseline=cfg.random_baseline)
    else:
        with torch.no_grad():
            result = evaluator(model, random_baseline=cfg.random_baseline)
    write_evaluation(result, test_set, out_dir)
    return {**result.metrics, **result.extra}
