"""What tools/train.py and tools/eval.py do, importable: a composed config in, a run directory out.

Like ``build.py`` this file reads the config; everything it calls takes plain values.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from wsod.build import (
    build_adversary,
    build_balancer,
    build_evaluator,
    build_model,
    build_optimizer,
    build_scheduler,
    build_train_dataset,
    load_detector,
    prepare_data,
    resolve_device,
)
from wsod.cli import error_message, setup_logging, write_failure
from wsod.config_checks import EVAL_RULES, TRAIN_RULES, ConfigError, check_config, resume_changes
from wsod.data.folder import SPLIT_SEED, TEST_FRACTION, has_split_column, write_split_csv
from wsod.data.loader import build_train_loader, infinite_batches
from wsod.distributed import (
    broadcast_object,
    cleanup_distributed,
    get_world_size,
    is_main_process,
    main_process_first,
    setup_distributed,
)
from wsod.engine.checkpoint import latest_valid_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from wsod.engine.evaluate import write_evaluation
from wsod.engine.run_log import RunLog
from wsod.engine.train import train

__all__ = [
    "train_from_config",
    "evaluate_from_config",
    "FinalEvaluationError",
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


def train_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` (configs/train.yaml) says; returns the engine's summary plus the final metrics.

    Nothing runs before the config is checked (``check_config``). A run directory that ends in an error
    holds ``error.txt``; a finished one holds ``model_final.pth`` whatever the final evaluation does.
    """
    check_config(cfg, TRAIN_RULES)
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
        raise ConfigError("resume=true needs the run to continue: output_dir=runs/<the run's directory>")
    run_dir = choose_output_dir(cfg.output_dir, "runs")
    if not cfg.resume and (list_checkpoints(run_dir) or (run_dir / "model_final.pth").exists()):
        raise ConfigError(
            f"{run_dir} already holds a run (checkpoints): resume=true continues it; another output_dir"
            " starts a new one"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, main)
    try:
        summary = _train_in(run_dir, cfg, device)
    except Exception as error:
        if main:
            write_failure(run_dir, error)
        raise
    if main:
        (run_dir / "error.txt").unlink(missing_ok=True)  # from an earlier attempt that this one resumed
    return summary


def _train_in(run_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    main = is_main_process()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resume_from = latest_valid_checkpoint(run_dir) if cfg.resume else None
    if main:
        logger.info("command: %s", " ".join(sys.argv))
        logger.info("run directory %s, device %s, %d process(es)", run_dir, device, get_world_size())
    if resume_from is None:
        if cfg.resume:
            logger.info("resume requested but no checkpoint in %s: starting from scratch", run_dir)
        config_file = run_dir / "config.yaml"
    else:
        path, checkpoint = resume_from
        iteration = checkpoint["trainer"]["iteration"]
        _log_resume_changes(checkpoint["metadata"].get("config"), resolved, path)
        config_file = run_dir / f"config_resume_{iteration:07d}.yaml"  # the original config.yaml stays
    if main:
        config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if cfg.data.kind == "folder":  # a labels.csv without a split column: the split made, to see and keep
            write_split_csv(
                cfg.data.root, run_dir / "split.csv", split_seed=cfg.data.get("split_seed", SPLIT_SEED),
                test_fraction=cfg.data.get("test_fraction", TEST_FRACTION),
            )  # fmt: skip
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank

    prepare_data(cfg.data, progress=cfg.progress and main)
    train_set = build_train_dataset(cfg.data)
    evaluator = build_evaluator(cfg.data, device, cfg.progress, random_baseline=cfg.random_baseline)
    with main_process_first():  # ImageNet weights: fetched into torch hub's cache once, then read
        model = build_model(cfg.model, train_set.num_classes, cfg.method).to(device)
    optimizer = build_optimizer(cfg.solver, model)
    scheduler = build_scheduler(cfg.solver, optimizer)
    adversary = build_adversary(cfg.solver, model, device)
    balancer = build_balancer(cfg.solver, model, device)
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
        "model": resolved["model"],
        "method": resolved["method"],
        "classes": list(train_set.classes),
        "config": resolved,  # what a resume compares its own config with
    }
    summary = train(
        wrapped, optimizer, scheduler, lambda start: infinite_batches(loader, start),
        max_iter=cfg.solver.max_iter, run_dir=run_dir, device=device, accumulation=cfg.solver.accumulation,
        amp=cfg.solver.amp, resume_from=resume_from, checkpoint_period=cfg.checkpoint_period,
        keep_checkpoints=cfg.keep_checkpoints, log_period=cfg.log_period, eval_period=cfg.eval_period,
        evaluator=evaluator, adversary=adversary, balancer=balancer, max_nonfinite=cfg.max_nonfinite,
        progress=cfg.progress, metadata=metadata,
    )  # fmt: skip

    # model_final.pth is on disk: a failing evaluation loses no work, and says how to redo it alone.
    model.eval()
    try:
        with torch.no_grad():
            final = evaluator(model, random_baseline=cfg.random_baseline)
    except Exception as error:
        raise FinalEvaluationError(
            f"the final evaluation failed ({error_message(error)}). The trained weights are safe in"
            f" {run_dir / 'model_final.pth'}; evaluate them alone with: {_eval_command(run_dir)}"
        ) from error
    write_evaluation(final, evaluator.dataset, run_dir / "eval")
    with RunLog(run_dir, enabled=main) as run_log:
        run_log.evaluation(summary["iteration"], final)
    _keep_if_best(run_dir, summary, final.metrics.get(evaluator.primary_metric), evaluator.primary_metric)
    summary["final"] = {**final.metrics, **final.extra}
    return summary


class FinalEvaluationError(RuntimeError):
    """Training finished and its weights are saved, but the evaluation after it failed."""


def _log_resume_changes(saved: dict[str, Any] | None, new: dict[str, Any], path: Path) -> None:
    """Refuse the changes a resume cannot honour (``resume_changes``), log the others."""
    if saved is None:
        logger.warning("%s holds no config (an older checkpoint): changed settings cannot be checked", path)
        return
    changes = resume_changes(saved, new)
    if changes:
        logger.info("settings changed since %s, applied from now on:\n  %s", path.name, "\n  ".join(changes))


def _eval_command(run_dir: Path) -> str:
    """The tools/eval.py command that evaluates this run's final weights on the same test data."""
    words = ["python", "tools/eval.py", f"checkpoint={run_dir / 'model_final.pth'}"]
    try:  # the data group and data.* overrides of this command line, when Hydra composed it
        hydra = HydraConfig.get()
        words.append(f"data={hydra.runtime.choices['data']}")
        words += [o for o in hydra.overrides.task if o.startswith("data.")]
    except (ValueError, KeyError):
        pass
    return shlex.join(words)  # pasteable: an override holding spaces (a path, a list) stays one word


def _check_seeded_split(cfg: DictConfig, trained: dict[str, Any] | None) -> None:
    """Refuse to evaluate on a seeded split (a folder whose labels.csv has no split column) other than the
    one the checkpoint was trained with: its test images would include training images, silently."""
    if not trained or trained.get("kind") != "folder" or cfg.data.kind != "folder":
        return
    if Path(trained["root"]).resolve() != Path(cfg.data.root).resolve() or has_split_column(cfg.data.root):
        return
    keys = ("split_seed", "test_fraction")
    defaults = {"split_seed": SPLIT_SEED, "test_fraction": TEST_FRACTION}
    saved = {k: trained.get(k, defaults[k]) for k in keys}
    given = {k: cfg.data.get(k, defaults[k]) for k in keys}
    if saved != given:
        labels = Path(cfg.data.root) / "labels.csv"
        raise ConfigError(
            f"{cfg.checkpoint} was trained on the seeded split of {labels} (no split column) made with"
            f" {_words(saved)}; this evaluation's {_words(given)} makes another, whose test images include"
            f" training images: evaluate with {_words(saved)}"
        )


def _words(values: dict[str, Any]) -> str:
    return " ".join(f"data.{k}={v}" for k, v in values.items())


def _keep_if_best(run_dir: Path, summary: dict[str, Any], value: float | None, metric: str) -> None:
    """Make the final model ``model_best.pth`` when its evaluation beats every earlier one."""
    best = summary.get("best")
    if value is None or (best is not None and value <= best["value"]):
        return
    summary["best"] = {"value": value, "iteration": summary["iteration"], "metric": metric}
    if is_main_process():
        final = load_checkpoint(run_dir / "model_final.pth")
        save_checkpoint({**final, "best": summary["best"]}, run_dir / "model_best.pth")


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
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = choose_output_dir(cfg.output_dir, "runs/eval")
    out_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(out_dir, is_main_process())
    try:
        return _evaluate_in(out_dir, cfg, device)
    except Exception as error:
        if is_main_process():
            write_failure(out_dir, error)
        raise


def _evaluate_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, float]:
    model, metadata = load_detector(cfg.checkpoint, device)
    _check_seeded_split(cfg, (metadata.get("config") or {}).get("data"))
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
