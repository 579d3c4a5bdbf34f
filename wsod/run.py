"""What tools/train.py and tools/eval.py do, importable: a composed config in, a run directory out.

Like ``build.py`` this file reads the config; everything it calls takes plain values.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from wsod.build import (
    build_model,
    build_optimizer,
    build_scheduler,
    build_test_dataset,
    build_train_dataset,
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
from wsod.engine.evaluate import evaluate_detections
from wsod.engine.inference import predict, random_detections
from wsod.engine.train import train
from wsod.evaluation.coco import save_coco_results, to_coco_results
from wsod.evaluation.voc import write_voc_results

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


def _predict_and_score(model, test_set, data_cfg: DictConfig, device: torch.device, amp: str | None,
                       progress: bool) -> tuple[list[dict] | None, dict[str, float], str]:  # fmt: skip
    """Detections on the test set (with the configured test-time augmentation), metrics, report.

    Under torchrun the detections are gathered on the main process and scored there once; every process
    receives the metrics and the report (the training loop keeps the best checkpoint on all of them).
    """
    test = data_cfg.test
    detections = predict(
        model, test_set, scales=list(test.scales), max_size=test.max_size, flip=test.flip,
        batch_size=test.batch_size, num_workers=test.num_workers, device=device, amp=amp, progress=progress,
    )  # fmt: skip
    scored = evaluate_detections(detections, test_set) if is_main_process() else None
    metrics, report = broadcast_object(scored)
    return detections, metrics, report


def _finish_report(detections, test_set, model, metrics, report, out_dir: Path, random_baseline: bool):
    """On the main process: add the random-score baseline, write everything under ``out_dir``, log the
    report. Returns the metrics on every process."""
    metrics = dict(metrics)
    if is_main_process():
        if random_baseline:
            chance, _ = evaluate_detections(random_detections(test_set, model), test_set)
            metrics.update({f"random_{k}": v for k, v in chance.items()})
            report += "\nrandom scores over the same proposals: " + ", ".join(
                f"{k} {100 * v:.2f}" for k, v in chance.items()
            )
        _write_results(detections, test_set, metrics, report, out_dir)
        logger.info("results on %d test images (written to %s):\n%s", len(test_set), out_dir, report)
    return broadcast_object(metrics)


def _write_results(detections, test_set, metrics, report, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint({"detections": detections, "image_ids": test_set.image_ids}, out_dir / "predictions.pth")
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out_dir / "report.txt").write_text(report + "\n")
    if hasattr(test_set, "category_ids"):
        results = to_coco_results(detections, test_set.image_ids, test_set.category_ids)
        save_coco_results(results, out_dir / "coco_results.json")
    else:
        write_voc_results(
            detections, [str(i) for i in test_set.image_ids], test_set.classes, out_dir / "voc_results"
        )


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
    test_set = build_test_dataset(cfg.data)
    with main_process_first():  # ImageNet weights: fetched into torch hub's cache once, then read
        model = build_model(cfg.model, train_set.num_classes).to(device)
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
    metadata = {"model": OmegaConf.to_container(cfg.model, resolve=True), "classes": list(train_set.classes)}

    last: dict[str, Any] = {}

    def evaluate(trained) -> dict[str, float]:
        detections, metrics, report = _predict_and_score(
            trained, test_set, cfg.data, device, cfg.solver.amp, cfg.progress
        )
        last.update(detections=detections, metrics=metrics, report=report)
        return metrics

    # The engine evaluates at the end of training (and every eval_period steps); the last of those is
    # the final result, completed with the random baseline and written under run_dir/eval.
    summary = train(
        wrapped, optimizer, scheduler, lambda start: infinite_batches(loader, start),
        max_iter=cfg.solver.max_iter, run_dir=run_dir, device=device, accumulation=cfg.solver.accumulation,
        amp=cfg.solver.amp, resume=cfg.resume, checkpoint_period=cfg.checkpoint_period,
        keep_checkpoints=cfg.keep_checkpoints, log_period=cfg.log_period, eval_period=cfg.eval_period,
        evaluate=evaluate, best_metric="AP" if cfg.data.kind == "coco" else "mAP",
        max_nonfinite=cfg.max_nonfinite, progress=cfg.progress, metadata=metadata,
    )  # fmt: skip
    summary["final"] = _finish_report(
        last["detections"], test_set, model, last["metrics"], last["report"], run_dir / "eval",
        cfg.random_baseline,
    )  # fmt: skip
    return summary


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
    checkpoint = load_checkpoint(cfg.checkpoint)
    metadata = checkpoint.get("metadata") or {}
    if "model" not in metadata:
        raise ValueError(f"{cfg.checkpoint} holds no model settings (metadata.model): not a wsod checkpoint?")
    prepare_data(cfg.data)
    test_set = build_test_dataset(cfg.data)
    if metadata.get("classes") and list(metadata["classes"]) != list(test_set.classes):
        raise ValueError(
            f"{cfg.checkpoint} was trained on classes {metadata['classes']}, the test set has"
            f" {list(test_set.classes)}"
        )
    # The checkpoint holds every weight: do not fetch ImageNet weights only to overwrite them.
    model = build_model({**metadata["model"], "weights": None}, test_set.num_classes)
    model.load_state_dict(checkpoint["model"])
    model.to(device).eval()
    if cfg.predictions:
        saved = load_checkpoint(cfg.predictions)
        if list(saved["image_ids"]) != list(test_set.image_ids):
            raise ValueError(f"{cfg.predictions} holds predictions for other images than {cfg.data.test.set}")
        logger.info("reusing predictions from %s (not recomputed)", cfg.predictions)
        detections = saved["detections"]
        metrics, report = broadcast_object(
            evaluate_detections(detections, test_set) if is_main_process() else None
        )
    else:
        detections, metrics, report = _predict_and_score(
            model, test_set, cfg.data, device, None, cfg.progress
        )
    return _finish_report(detections, test_set, model, metrics, report, out_dir, cfg.random_baseline)
