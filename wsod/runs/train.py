"""What tools/train.py does, importable: ``train_from_config``, a composed config (configs/train.yaml) in,
a run directory out; and what every training entry point shares (the second stage's too,
``wsod.runs.stage2``): ``run_training`` (the run directory: a new one, a sweep job's, or the run that
``resume=true`` continues, ``refuse_another_run``), ``begin_training_run`` (the command logged, the
checkpoint to resume from, ``config.yaml``, the seed) and ``train_and_evaluate`` (the loop, then the final
evaluation).

The objects (data, model, optimizer, loader, checkpointer, companions, previews) come from ``wsod.build``;
this module reads only what is its own: the run directory, the resume policy, logging and the loop's
settings.
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from wsod.build import (
    build_checkpointer,
    build_companions,
    build_evaluator,
    build_loader,
    build_model,
    build_optimizer,
    build_pseudo_label_preview,
    build_scheduler,
    build_train_dataset,
    check_partial_labels_read,
    prepare_data,
)
from wsod.cli import error_message
from wsod.config_checks import TRAIN_RULES, ConfigError, check_config, resume_changes
from wsod.config_schema import plain
from wsod.data.formats import dataset_format
from wsod.data.loader import infinite_batches
from wsod.distributed import (
    cleanup_distributed,
    get_world_size,
    is_main_process,
    main_process_first,
    setup_distributed,
)
from wsod.engine.checkpoint import TrainState, latest_valid_checkpoint, list_checkpoints
from wsod.engine.companion import Companion, evaluation_model
from wsod.engine.evaluate import Evaluation, Evaluator, write_evaluation
from wsod.engine.pseudo_label_preview import PseudoLabelPreview
from wsod.engine.run_log import RunLog
from wsod.engine.train import train
from wsod.modeling.faster_rcnn import ARCHITECTURE as FASTER_RCNN_ARCHITECTURE
from wsod.runs.prologue import in_multirun, run_in_directory
from wsod.runs.quick_start import is_quick_start, quick_start_sentence

__all__ = [
    "train_from_config",
    "run_training",
    "refuse_another_run",
    "begin_training_run",
    "train_and_evaluate",
    "FinalEvaluationError",
    "insert_after_copypaste",
    "RUN_FILES",
]

logger = logging.getLogger("wsod")
T = TypeVar("T")


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
    return run_training(cfg, _train_in)


def run_training(cfg: DictConfig, body: Callable[[Path, DictConfig, torch.device], T]) -> T:
    """``body`` in a training run's directory (``run_in_directory``): ``output_dir``, or under a sweep the
    job's own, or a new ``runs/<date>_<time>``; a directory holding a run is refused without
    ``resume=true``, and ``resume=true`` needs the directory named."""
    # A sweep's job knows its directory: rerunning the sweep with resume=true continues each job's run
    # (configs/train.yaml keeps resume out of the directory name).
    if cfg.resume and cfg.output_dir is None and not in_multirun():
        raise ConfigError("resume=true needs the run to continue: output_dir=runs/<the run's directory>")
    return run_in_directory(cfg, cfg.output_dir, "runs", body, claim=refuse_another_run, sweep=True)


# What a training run writes from its first moment (log.txt as its directory is set up, config.yaml
# before its data is read): a folder holding any of them holds a run, checkpoint or not.
RUN_FILES = ("config.yaml", "log.txt", "metrics.jsonl", "model_final.pth")


def refuse_another_run(run_dir: Path, cfg: DictConfig) -> str | None:
    """Refuse a directory that holds a started or finished run (``RUN_FILES`` or a checkpoint) unless
    ``resume=true`` continues it: two runs in one folder mix their logs, metrics and checkpoints. An
    attempt that failed before its first step (``error.txt``, no step logged, no checkpoint: a wrong
    data path, say) holds nothing to lose: a new run starts over in it, and says so."""
    if cfg.resume:
        return None
    checkpoints = list_checkpoints(run_dir)
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not checkpoints and not found:
        return None
    if not checkpoints and _failed_before_its_first_step(run_dir):
        return (
            f"{run_dir} holds an attempt that failed before its first step (error.txt): starting over in it"
        )
    held = (
        f"checkpoints up to {checkpoints[0].name}"
        if checkpoints
        else ", ".join(found) + "; no checkpoint yet"
    )
    start = "from its newest checkpoint" if checkpoints else "from step 0"
    raise ConfigError(
        f"{run_dir} already holds a run ({held}): resume=true continues it ({start}); another"
        " output_dir starts a new one"
    )


def _failed_before_its_first_step(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    logged = metrics.is_file() and any(line.strip() for line in metrics.read_text().splitlines())
    return (run_dir / "error.txt").is_file() and not logged and not (run_dir / "model_final.pth").exists()


def _train_in(run_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    resolved, resume_from, resumed_at = begin_training_run(run_dir, cfg, device)
    main = is_main_process()
    prepare_data(cfg.data, progress=cfg.progress and main)
    train_set = build_train_dataset(cfg.data)
    evaluator = build_evaluator(cfg.data, device, cfg.progress, random_baseline=cfg.random_baseline)
    with main_process_first():  # ImageNet weights: fetched into torch hub's cache once, then read
        model = build_model(cfg.model, train_set.num_classes, cfg.method).to(device)
    check_partial_labels_read(train_set, model.method)  # before step 1, whichever images hold them
    optimizer = build_optimizer(cfg.solver, model)
    scheduler = build_scheduler(cfg.solver, optimizer)
    companions = build_companions(cfg, model, device)  # in wsod.build.COMPANIONS' order
    metadata = {
        "model": resolved["model"],
        "method": resolved["method"],
        "classes": list(train_set.classes),
        "config": resolved,  # what a resume compares its own config with
    }
    return train_and_evaluate(
        run_dir, cfg, device, model=model, optimizer=optimizer, scheduler=scheduler, train_set=train_set,
        evaluator=evaluator, metadata=metadata, resume_from=resume_from, resumed_at=resumed_at,
        companions=companions,
        preview=build_pseudo_label_preview(cfg, train_set, device) if main else None,  # main process only
        after_copypaste=_quick_start_note(), pseudo_label_quality=True,
    )  # fmt: skip


def _quick_start_note() -> Callable[[dict[str, float]], str] | None:
    """The quick start's sentence after the final ``copypaste:`` line (``wsod.runs.quick_start``), for a
    tools/train.py command that runs the default recipe; None for any other command (or outside Hydra)."""
    if not HydraConfig.initialized() or not is_quick_start(HydraConfig.get().overrides.task):
        return None
    return lambda metrics: quick_start_sentence(100 * metrics["mAP"])


def begin_training_run(
    run_dir: Path, cfg: DictConfig, device: torch.device
) -> tuple[dict[str, Any], tuple[Path, dict[str, Any]] | None, int | None]:
    """What every training entry point does first (tools/train.py, tools/train_stage2.py): log the
    command (and a sweep job's overrides), find the checkpoint to resume from, check the settings a
    resume changes, write ``config.yaml`` (or ``config_resume_<iteration>.yaml``, the original staying),
    a folder dataset's ``split.csv``, and seed torch. Returns ``(resolved config, resume_from,
    resumed_at)``: ``resumed_at`` is the iteration the run continues after (0 for ``resume=true`` in a
    run stopped before its first checkpoint: its log rows are dropped), None for a new run."""
    main = is_main_process()
    resolved = plain(cfg)  # choices as strings: a checkpoint holds plain values only
    resume_from = latest_valid_checkpoint(run_dir, trust=cfg.trust_checkpoint) if cfg.resume else None
    if main:
        logger.info("command: %s", " ".join(sys.argv))
        if in_multirun():  # the command is the whole sweep's: say which of its jobs this is
            hydra = HydraConfig.get()
            logger.info("sweep job #%s: %s", hydra.job.num, " ".join(hydra.overrides.task) or "(no override)")
        logger.info("run directory %s, device %s, %d process(es)", run_dir, device, get_world_size())
    resumed_at = None
    if resume_from is None:
        if cfg.resume:
            # A run stopped before its first checkpoint continues from step 0: what it logged goes.
            logger.info("resume requested but no checkpoint in %s: starting from step 0", run_dir)
            resumed_at = 0
        config_file = run_dir / "config.yaml"
    else:
        path, checkpoint = resume_from
        _check_resumable(path, checkpoint, cfg)
        resumed_at = TrainState.from_dict(checkpoint["trainer"]).iteration
        _log_resume_changes(checkpoint["metadata"].get("config"), resolved, path)
        config_file = run_dir / f"config_resume_{resumed_at:07d}.yaml"  # the original config.yaml stays
    if main:
        config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        data_format = dataset_format(cfg.data.kind)
        if data_format.write_split is not None:  # a split made at run time (a folder's): to see and keep
            data_format.write_split(resolved["data"], run_dir / "split.csv")
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    return resolved, resume_from, resumed_at


# The three training commands, by what their config (and a checkpoint's saved config) holds.
_TOOLS = {1: "tools/train.py", 2: "tools/train_stage2.py", 3: "tools/train_stage3.py"}
_STAGE_NAMES = {1: "a first-stage run", 2: "a second-stage run", 3: "a third-stage run"}


def _stage_of(config: Any) -> int:
    """1, 2 or 3: the training command a config belongs to (configs/train.yaml has ``model``,
    configs/stage2.yaml ``detector``, configs/stage3.yaml ``detector`` and ``semi_supervised``)."""
    if not config or "detector" not in config:
        return 1
    return 3 if "semi_supervised" in config else 2


def _run_kind(stage: int) -> str:
    return f"{_STAGE_NAMES[stage]} ({_TOOLS[stage]})"


def _check_resumable(path: Path, checkpoint: dict[str, Any], cfg: DictConfig) -> None:
    """Refuse a checkpoint that is not a training run's periodic one (no training state: a final model
    copied in, another program's file), and a run resumed with another stage's command (a second-stage
    run by tools/train_stage3.py, say): their settings differ in whole groups, and the difference would
    read as dozens of refused changes, or a run would silently become another kind."""
    missing = [key for key in ("trainer", "metadata", "model", "optimizer") if key not in checkpoint]
    if missing:
        raise ConfigError(
            f"{path} holds no training state ({', '.join(missing)} missing): resume reads the periodic"
            f" checkpoints (model_<iteration>.pth) a training run writes; move this file out of"
            f" {path.parent}, or give another output_dir"
        )
    metadata = checkpoint.get("metadata") or {}
    saved = _stage_of(metadata.get("config"))
    if metadata.get("config") is None:  # an older checkpoint: its architecture says which detector
        saved = 2 if metadata.get("architecture") == FASTER_RCNN_ARCHITECTURE else 1
    command = _stage_of(cfg)
    if saved != command:
        tool = _TOOLS[saved]
        raise ConfigError(
            f"{path} belongs to {_run_kind(saved)}, and this command starts {_run_kind(command)}: resume it"
            f" with {tool} output_dir={path.parent} resume=true, or give this command another output_dir"
        )


def train_and_evaluate(
    run_dir: Path,
    cfg: DictConfig,
    device: torch.device,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    train_set: Any,
    evaluator: Evaluator,
    metadata: dict[str, Any],
    resume_from: tuple[Path, dict[str, Any]] | None,
    resumed_at: int | None,
    companions: Sequence[Companion] = (),
    preview: PseudoLabelPreview | None = None,
    make_batches: Callable[[int], Iterator[dict[str, Any]]] | None = None,
    after_copypaste: Callable[[dict[str, float]], str] | None = None,
    pseudo_label_quality: bool = False,
) -> dict[str, Any]:
    """The rest of a training entry point, once its model and data exist: DDP under torchrun, the
    loader, the checkpointer (``metadata`` in every file), the loop (``wsod.engine.train``), the final
    evaluation written to ``eval/`` and offered as the best. Returns the loop's summary with ``best``
    and ``final`` (the final metrics). ``make_batches``: the loop's batch stream (``start`` -> batches
    from the ``start``-th on); None: ``train_set``'s loader (``build_loader``), endless.
    ``after_copypaste``: final metrics -> a sentence the final report holds after its ``copypaste:``
    line (the quick start's range). ``pseudo_label_quality``: log the precision of the pseudo boxes
    against the training images' true boxes (``wsod.engine.train.train``'s; the first stage's detector
    only)."""
    main = is_main_process()
    wrapped = model
    if get_world_size() > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    if make_batches is None:
        loader = build_loader(cfg, train_set, device)
        make_batches = lambda start: infinite_batches(loader, start)  # noqa: E731
    checkpointer = build_checkpointer(cfg, run_dir, metadata, enabled=main)
    # One log for the run: on a resume, what the interrupted run logged after the checkpoint is dropped.
    with RunLog(run_dir, enabled=main, purge_after=resumed_at) as run_log:
        summary = train(
            wrapped, optimizer, scheduler, make_batches,
            max_iter=cfg.solver.max_iter, device=device, checkpointer=checkpointer, run_log=run_log,
            accumulation=cfg.solver.accumulation, amp=cfg.solver.amp, resume_from=resume_from,
            log_period=cfg.log_period, evaluator=evaluator, eval_period=cfg.eval_period,
            companions=companions, max_nonfinite=cfg.max_nonfinite, progress=cfg.progress,
            preview=preview, pseudo_label_quality=pseudo_label_quality,
        )  # fmt: skip
        final = _final_evaluation(
            evaluation_model(model, companions), evaluator, run_dir, cfg.random_baseline
        )
        if after_copypaste is not None and main:
            final = replace(
                final, report=insert_after_copypaste(final.report, after_copypaste(final.metrics))
            )
        write_evaluation(final, evaluator.dataset, run_dir / "eval")
        run_log.evaluation(summary["iteration"], final)
    metric = evaluator.primary_metric
    checkpointer.offer_best(metric, final.metrics.get(metric), summary["iteration"])  # model_final's weights
    summary["best"] = checkpointer.best
    summary["final"] = {**final.metrics, **final.extra}
    return summary


def insert_after_copypaste(report: str, sentence: str) -> str:
    """``report`` with ``sentence`` as the line after its ``copypaste:`` line (at the end if it has none)."""
    lines = report.split("\n")
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("copypaste:")), len(lines))
    return "\n".join([*lines[:at], sentence, *lines[at:]])


class FinalEvaluationError(RuntimeError):
    """Training finished and its weights are saved, but the evaluation after it failed."""


def _final_evaluation(
    model: torch.nn.Module, evaluator: Evaluator, run_dir: Path, random_baseline: bool
) -> Evaluation:
    """The evaluation after training. model_final.pth is on disk by then: a failing evaluation loses no
    work, and its message says how to redo it alone."""
    model.eval()
    try:
        with torch.no_grad():
            return evaluator(model, random_baseline=random_baseline)
    except Exception as error:
        raise FinalEvaluationError(
            f"the final evaluation failed ({error_message(error)}). The trained weights are safe in"
            f" {run_dir / 'model_final.pth'}; evaluate them alone with: {_eval_command(run_dir)}"
        ) from error


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
