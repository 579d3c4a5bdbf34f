"""What tools/train.py, tools/eval.py and tools/predict.py do, importable: a composed config in, a run
directory out.

Like ``build.py`` this file reads the config; everything it calls takes plain values. The three entry
points share one prologue and epilogue (``run_in_directory``): the config is checked before anything
runs; the device and CPU threads are set; the output directory is chosen (once, for every process) and
claimed; the log goes to its ``log.txt``; a run that ends in an error leaves ``error.txt`` there, and one
that succeeds removes an earlier attempt's.

Sweeps (``python tools/train.py -m method=mist,oicr seed=1,2,3 hydra.sweep.dir=runs/methods``, Hydra's
multirun, one job after the other): each training job's run directory is
``<hydra.sweep.dir>/<hydra.sweep.subdir>``, i.e. ``runs/methods/method=mist,seed=1``
(configs/train.yaml), unless ``output_dir`` names one (``sweep_job_dir``). Hydra writes no file of its
own there: ``DiscardMultirunYaml`` removes the ``multirun.yaml`` it saves in the sweep directory (each
run's ``config.yaml`` and ``log.txt`` hold the settings and the command).

``predict_from_config`` (tools/predict.py, configs/predict.yaml): a checkpoint and some images in
(``input=``: an image file, a folder or a glob pattern, ``wsod.data.images``), detections out. Proposals
come from Selective Search on each image as it is loaded (OpenCV's "fast" strategy by default), or are
looked up by ``file_name`` in a proposal file or store given as ``proposals=`` (``python
tools/make_proposals.py folder --root R`` writes one whose ids are the file names under ``R/images``, so
``input=R/images proposals=R/proposals/selective_search.proposals`` reuses it). The model is the
checkpoint's (``wsod.build.load_detector``) with its test views (the ``data.test`` settings stored in the
checkpoint) unless ``scales=`` says otherwise. Outputs under ``output=``: ``predictions.json``, a list of
COCO results entries ``{"image_id", "file_name", "category_id", "category_name", "bbox": [x, y, w, h] in
image pixels, "score"}`` with the detections scoring at least ``score_threshold``
(``wsod.evaluation.coco.to_named_results``: integer image ids in sorted file-name order from 1, category
id = class index + 1); ``<file_name>.png`` per image (suffix replaced; sub-folders kept) with those
detections drawn and labelled "class score"; ``log.txt``. An output folder that is not empty is refused
(an earlier prediction's PNGs would stand beside the new json); ``overwrite=true`` deletes the earlier
prediction first, and a folder holding files that no prediction writes (the input images, say) is
refused either way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from wsod.build import (
    build_adversary,
    build_balancer,
    build_evaluator,
    build_model,
    build_optimizer,
    build_scheduler,
    build_train_dataset,
    check_partial_labels_read,
    load_detector,
    prepare_data,
    resolve_device,
    resolve_threads,
)
from wsod.cli import error_message, setup_logging, write_failure
from wsod.config_checks import (
    EVAL_RULES,
    PREDICT_RULES,
    TRAIN_RULES,
    ConfigError,
    check_config,
    resume_changes,
)
from wsod.data.dataset import load_image
from wsod.data.folder import SPLIT_SEED, TEST_FRACTION, has_split_column, write_split_csv
from wsod.data.images import ImageFiles, check_readable, find_images
from wsod.data.loader import build_train_loader, infinite_batches
from wsod.data.proposals import load_proposals
from wsod.directory_lock import LOCK_FILE, DirectoryBusyError, DirectoryLock
from wsod.distributed import (
    broadcast_object,
    cleanup_distributed,
    get_world_size,
    is_main_process,
    main_process_first,
    setup_distributed,
)
from wsod.engine.checkpoint import (
    Checkpointer,
    TrainState,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from wsod.engine.evaluate import Evaluation, Evaluator, write_evaluation
from wsod.engine.inference import predict
from wsod.engine.pseudo_label_preview import TAG as PREVIEW_TAG
from wsod.engine.pseudo_label_preview import PseudoLabelPreview
from wsod.engine.run_log import RunLog
from wsod.engine.train import train
from wsod.engine.visualize import draw_detections, save_png
from wsod.evaluation.coco import save_coco_results, to_named_results
from wsod.modeling.faster_rcnn import ARCHITECTURE as FASTER_RCNN_ARCHITECTURE
from wsod.modeling.faster_rcnn import FasterRCNNDetector

__all__ = [
    "train_from_config",
    "evaluate_from_config",
    "predict_from_config",
    "FinalEvaluationError",
    "setup_distributed",
    "setup_logging",
    "choose_output_dir",
    "sweep_job_dir",
    "DiscardMultirunYaml",
    "begin_training_run",
    "train_and_evaluate",
    "run_training",
    "run_in_directory",
    "refuse_another_run",
    "in_multirun",
]

logger = logging.getLogger("wsod")
T = TypeVar("T")


def choose_output_dir(output_dir: str | None, parent: str, sweep: bool = False) -> Path:
    """``output_dir``; when it is null, with ``sweep`` and under a Hydra multirun the job's own
    ``sweep_job_dir()``, else ``<parent>/<date>_<time>``. Chosen once by the main process and shared:
    under torchrun every rank must write to (and resume from) the same directory, and clocks read one by
    one can fall on both sides of a second (a sweep directory's ``${now:...}`` too)."""
    if output_dir is None and is_main_process():
        job_dir = sweep_job_dir() if sweep else None
        output_dir = job_dir or str(Path(parent) / time.strftime("%Y-%m-%d_%H-%M-%S"))
    return Path(broadcast_object(output_dir))


def in_multirun() -> bool:
    """Whether this process runs a job of a Hydra multirun (``-m``); False outside Hydra (tests, Python)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _one_folder_name(text: str) -> str:
    """``text`` as one folder name: ``/`` becomes ``_``, so an override naming a file
    (``data.train.sets.0.partial_labels=data/toy/partial/points.json``) gives one job folder, not a tree."""
    return str(text).replace("/", "_")


# configs/train.yaml's hydra.sweep.subdir; registered on import, before tools/train.py composes its config.
OmegaConf.register_new_resolver("wsod_folder_name", _one_folder_name, replace=True)


def sweep_job_dir() -> str | None:
    """This multirun job's directory, ``<hydra.sweep.dir>/<hydra.sweep.subdir>`` as Hydra resolved them
    (relative paths stay relative, like ``runs/<date>_<time>``); None outside a multirun."""
    if not in_multirun():
        return None
    hydra = HydraConfig.get()
    return str(Path(str(hydra.sweep.dir)) / str(hydra.sweep.subdir))


class DiscardMultirunYaml(Callback):
    """A Hydra callback (``hydra.callbacks`` in configs/train.yaml) that removes the ``multirun.yaml``
    Hydra 1.3's basic sweeper saves in the sweep directory whatever ``hydra.output_subdir`` says, so that
    Hydra leaves no file of its own beside the run directories (each run writes its ``config.yaml``).

    At the start of each job: the sweeper writes the file after ``on_multirun_start``, and
    ``on_multirun_end`` is skipped when a job fails. A sweep refused before its first job (a mistyped key)
    leaves it behind, with the sweep directory Hydra made.
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            (Path(str(config.hydra.sweep.dir)) / "multirun.yaml").unlink(missing_ok=True)


def _loader_workers(cfg: DictConfig) -> int:
    """The data-loader workers of an entry point's main loader: training's, prediction's, else the
    test set's (evaluation, export)."""
    if "solver" in cfg:
        return int(cfg.data.train.num_workers)
    if "num_workers" in cfg:
        return int(cfg.num_workers)
    return int(cfg.data.test.num_workers) if "data" in cfg else 0


def run_in_directory(
    cfg: DictConfig,
    output_dir: str | None,
    parent: str,
    body: Callable[[Path, DictConfig, torch.device], T],
    claim: Callable[[Path, DictConfig], str | None] | None = None,
    sweep: bool = False,
    option: str = "output_dir",
) -> T:
    """``body(directory, cfg, device)`` with what every entry point does around it (the module docstring).

    The directory is locked first (``wsod.directory_lock``, by the main process, for as long as the
    command runs): a second command given the same folder is refused at once. ``claim(directory, cfg)``
    runs next, before anything is written there: it refuses a directory this run must not write to, or
    prepares it, and returns a line to log once logging has started (or None); a refused directory that
    did not exist before is removed again. ``sweep``: under a Hydra multirun, a null ``output_dir`` is the
    job's sweep directory (``choose_output_dir``). ``option``: the config key that names the directory,
    for messages.
    """
    main = is_main_process()
    device = resolve_device(cfg.device)
    threads = resolve_threads(cfg.threads, _loader_workers(cfg))
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    directory = choose_output_dir(output_dir, parent, sweep=sweep)
    lock, note = _lock_and_claim(directory, cfg, claim, option)
    with lock if lock is not None else contextlib.nullcontext():  # released however the body ends
        setup_logging(directory, main)
        if note:
            logger.info(note)
        try:
            result = body(directory, cfg, device)
        except Exception as error:
            if main:
                write_failure(directory, error)
            raise
        if main:
            (directory / "error.txt").unlink(missing_ok=True)  # from an earlier attempt that this one redid
        return result


def _lock_and_claim(
    directory: Path,
    cfg: DictConfig,
    claim: Callable[[Path, DictConfig], str | None] | None,
    option: str,
) -> tuple[DirectoryLock | None, str | None]:
    """Lock ``directory`` and run ``claim`` on the main process, then tell the others: every process
    raises the same refusal, or goes on with the same note. The main process alone looks, before any
    process writes: under torchrun a slower rank would otherwise find the main one's fresh ``log.txt``
    and take its own run for another."""
    lock, outcome = None, None
    if is_main_process():
        lock, outcome = _lock_and_claim_here(directory, cfg, claim, option)
    outcome = broadcast_object(outcome)
    if isinstance(outcome, BaseException):
        raise outcome
    return lock, outcome


def _lock_and_claim_here(
    directory: Path,
    cfg: DictConfig,
    claim: Callable[[Path, DictConfig], str | None] | None,
    option: str,
) -> tuple[DirectoryLock | None, str | Exception | None]:
    """``(lock, claim's note)``, or ``(None, the refusal)``: a refused command leaves no trace."""
    if directory.exists() and not directory.is_dir():
        return None, ConfigError(
            f"{option}={directory} is a file, not a folder: give a folder (new, or a run's)"
        )
    existed = directory.exists()
    lock = DirectoryLock(directory, option)
    try:
        lock.acquire()
    except DirectoryBusyError as busy:
        return None, busy
    except OSError as error:  # a folder that cannot be made or written (no permission, a read-only disk)
        why = f"{error.strerror}: {error.filename}" if error.filename else str(error)
        return None, ConfigError(f"{option}={directory}: cannot write there ({why}); give another folder")
    try:
        return lock, claim(directory, cfg) if claim is not None else None
    except Exception as refusal:
        lock.release()  # removes its file
        if not existed:  # the folder was made for the lock
            with contextlib.suppress(OSError):  # not empty after all: keep what is there
                directory.rmdir()
        return None, refusal


# -- train -------------------------------------------------------------------------------------------


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
    # In this order: the adversary's update runs before GradNorm's in each step.
    extras = (build_adversary(cfg.solver, model, device), build_balancer(cfg.solver, model, device))
    metadata = {
        "model": resolved["model"],
        "method": resolved["method"],
        "classes": list(train_set.classes),
        "config": resolved,  # what a resume compares its own config with
    }
    return train_and_evaluate(
        run_dir, cfg, device, model=model, optimizer=optimizer, scheduler=scheduler, train_set=train_set,
        evaluator=evaluator, metadata=metadata, resume_from=resume_from, resumed_at=resumed_at,
        companions=[companion for companion in extras if companion is not None],
        preview=_pseudo_label_preview(cfg, train_set, device) if main else None,  # main process only
    )  # fmt: skip


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
    resolved = OmegaConf.to_container(cfg, resolve=True)
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
        if cfg.data.kind == "folder":  # a labels.csv without a split column: the split made, to see and keep
            write_split_csv(
                cfg.data.root, run_dir / "split.csv", split_seed=cfg.data.get("split_seed", SPLIT_SEED),
                test_fraction=cfg.data.get("test_fraction", TEST_FRACTION),
            )  # fmt: skip
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    return resolved, resume_from, resumed_at


def _run_kind(second_stage: bool) -> str:
    return (
        "a second-stage run (tools/train_stage2.py)" if second_stage else "a first-stage run (tools/train.py)"
    )


def _check_resumable(path: Path, checkpoint: dict[str, Any], cfg: DictConfig) -> None:
    """Refuse a checkpoint that is not a training run's periodic one (no training state: a final model
    copied in, another program's file), and a first-stage run resumed with the second stage's command or
    the other way round: their settings share few keys, and the difference would read as dozens of
    refused changes."""
    missing = [key for key in ("trainer", "metadata", "model", "optimizer") if key not in checkpoint]
    if missing:
        raise ConfigError(
            f"{path} holds no training state ({', '.join(missing)} missing): resume reads the periodic"
            f" checkpoints (model_<iteration>.pth) a training run writes; move this file out of"
            f" {path.parent}, or give another output_dir"
        )
    saved = (checkpoint.get("metadata") or {}).get("architecture") == FASTER_RCNN_ARCHITECTURE
    command = "detector" in cfg  # configs/stage2.yaml's detector node; configs/train.yaml has model
    if saved != command:
        tool = "tools/train_stage2.py" if saved else "tools/train.py"
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
    companions: Sequence[Any] = (),
    preview: PseudoLabelPreview | None = None,
) -> dict[str, Any]:
    """The rest of a training entry point, once its model and data exist: DDP under torchrun, the
    loader, the checkpointer (``metadata`` in every file), the loop (``wsod.engine.train``), the final
    evaluation written to ``eval/`` and offered as the best. Returns the loop's summary with ``best``
    and ``final`` (the final metrics)."""
    main = is_main_process()
    wrapped = model
    if get_world_size() > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    loader = build_train_loader(
        train_set, cfg.solver.ims_per_batch, num_workers=cfg.data.train.num_workers, seed=cfg.seed,
        pin_memory=device.type == "cuda",
    )  # fmt: skip
    checkpointer = Checkpointer(
        run_dir,
        period=cfg.checkpoint_period,
        keep=cfg.keep_checkpoints,
        metadata=metadata,
        enabled=main,
        trust=cfg.trust_checkpoint,
    )
    # One log for the run: on a resume, what the interrupted run logged after the checkpoint is dropped.
    with RunLog(run_dir, enabled=main, purge_after=resumed_at) as run_log:
        summary = train(
            wrapped, optimizer, scheduler, lambda start: infinite_batches(loader, start),
            max_iter=cfg.solver.max_iter, device=device, checkpointer=checkpointer, run_log=run_log,
            accumulation=cfg.solver.accumulation, amp=cfg.solver.amp, resume_from=resume_from,
            log_period=cfg.log_period, evaluator=evaluator, eval_period=cfg.eval_period,
            companions=companions, max_nonfinite=cfg.max_nonfinite, progress=cfg.progress,
            preview=preview,
        )  # fmt: skip
        final = _final_evaluation(model, evaluator, run_dir, cfg.random_baseline)
        write_evaluation(final, evaluator.dataset, run_dir / "eval")
        run_log.evaluation(summary["iteration"], final)
    metric = evaluator.primary_metric
    checkpointer.offer_best(metric, final.metrics.get(metric), summary["iteration"])  # model_final's weights
    summary["best"] = checkpointer.best
    summary["final"] = {**final.metrics, **final.extra}
    return summary


def _pseudo_label_preview(cfg: DictConfig, train_set: Any, device: torch.device) -> PseudoLabelPreview | None:
    """The tensorboard previews of each student's pseudo-labels (``cfg.pseudo_label_preview``), or None
    when ``period`` is 0: the first ``images`` training images at the first training scale."""
    settings = cfg.pseudo_label_preview
    if not settings.period:
        return None
    preview = PseudoLabelPreview.from_dataset(
        train_set, train_set.classes, num_images=settings.images, scale=cfg.data.train.scales[0],
        max_size=cfg.data.train.max_size, period=settings.period, device=device,
    )  # fmt: skip
    logger.info(
        "pseudo-label previews every %d steps: %d training image(s) x each student, tensorboard %s/...",
        settings.period, len(preview.images), PREVIEW_TAG,
    )  # fmt: skip
    return preview


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


# -- evaluate ----------------------------------------------------------------------------------------


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
    model, metadata = load_detector(cfg.checkpoint, device, trust=cfg.trust_checkpoint)
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


# -- predict -----------------------------------------------------------------------------------------

# What a prediction writes into its output folder besides one PNG per image.
PREDICTION_FILES = ("predictions.json", "log.txt", "error.txt")


def predict_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Predict ``cfg.input`` with ``cfg.checkpoint`` (configs/predict.yaml; the module docstring says
    what is written); returns a summary. One process: no process group is joined."""
    check_config(cfg, PREDICT_RULES)
    return run_in_directory(
        cfg, cfg.output, "runs/predict", _predict_in, claim=_clear_output, option="output"
    )


def _clear_output(out_dir: Path, cfg: DictConfig) -> str | None:
    """Refuse a non-empty output folder (an earlier prediction's PNGs would stand beside the new
    predictions.json, for images this run may not have); with ``overwrite`` delete what a prediction
    writes there first, and say so. A folder holding anything else (the input images themselves, say)
    is never emptied, overwrite or not: deleting a user's files is not ours."""
    own = [p for p in out_dir.rglob("*") if p.is_file() and p != out_dir / LOCK_FILE]  # the lock is ours
    if not own:
        return None
    inputs = find_images(cfg.input)[0]
    inside = {os.path.realpath(p) for p in inputs} & {os.path.realpath(p) for p in own}
    foreign = [p for p in own if not _is_prediction_output(p)]
    if inside or foreign:
        example = next(iter(inside), None) or foreign[0]
        raise ConfigError(
            f"output={out_dir} holds files that tools/predict.py did not write (e.g. {example}); give an"
            " empty or new folder as output="
        )
    if not cfg.overwrite:
        raise ConfigError(
            f"output={out_dir} already holds a prediction ({len(own)} files): overwrite=true replaces it,"
            " another output= keeps it"
        )
    for path in own:
        path.unlink()
    for folder in sorted((p for p in out_dir.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):  # sub-folders of PNGs, deepest first
            folder.rmdir()
    return f"overwrite=true: deleted the {len(own)} files of the earlier prediction in {out_dir}"


def _is_prediction_output(path: Path) -> bool:
    return path.name in PREDICTION_FILES or path.suffix.lower() == ".png"


def _predict_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    files, names = find_images(cfg.input)
    check_readable(files)
    model, metadata = load_detector(cfg.checkpoint, device, trust=cfg.trust_checkpoint)
    classes = list(metadata["classes"])
    scales, max_size, flip, max_proposals = _views(cfg, metadata)
    proposes_itself = isinstance(model, FasterRCNNDetector)  # a second stage: its RPN makes the boxes
    proposals = None if cfg.proposals is None or proposes_itself else load_proposals(cfg.proposals)
    mode = None if proposes_itself else cfg.selective_search
    source = f"proposals {cfg.proposals}" if cfg.proposals else f"Selective Search ({cfg.selective_search})"
    if proposes_itself:
        source = "its own region proposals (a second-stage detector)"
    logger.info(
        "predicting %d images of %s with %s (%d classes), views %s%s, %s",
        len(files), cfg.input, cfg.checkpoint, len(classes), scales, " + flips" if flip else "", source,
    )  # fmt: skip
    images = ImageFiles(files, names, len(classes), proposals, mode=mode, max_proposals=max_proposals)
    with torch.no_grad():
        detections = predict(
            model, images, scales=scales, max_size=max_size, flip=flip, num_workers=cfg.num_workers,
            device=device, progress=cfg.progress,
        )  # fmt: skip
    kept = []
    for det in detections:
        keep = det["scores"] >= cfg.score_threshold
        kept.append({key: det[key][keep] for key in ("boxes", "scores", "labels")})
    results = to_named_results(kept, names, classes)
    save_coco_results(results, out_dir / "predictions.json")
    for path, name, det in zip(files, _png_names(names), kept, strict=True):
        drawn = draw_detections(load_image(path), det, classes)
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        save_png(drawn, target)
    logger.info(
        "%d detections scoring >= %g in %d images: %s and one PNG per image in %s",
        len(results), cfg.score_threshold, len(files), out_dir / "predictions.json", out_dir,
    )  # fmt: skip
    return {"images": len(files), "detections": len(results), "output": str(out_dir)}


def _views(cfg: DictConfig, metadata: dict[str, Any]) -> tuple[list[int], int | None, bool, int | None]:
    """(scales, max_size, flip, max_proposals): ``cfg``'s where given, else the checkpoint's test settings."""
    test = ((metadata.get("config") or {}).get("data") or {}).get("test") or {}
    if cfg.scales is None and "scales" not in test:
        raise ValueError(f"{cfg.checkpoint} does not record its test views: give them, e.g. scales=[600]")
    scales = list(cfg.scales) if cfg.scales is not None else list(test["scales"])
    max_proposals = cfg.max_proposals if cfg.max_proposals is not None else test.get("max_proposals")
    return scales, test.get("max_size"), bool(test.get("flip", False)), max_proposals


def _png_names(names: Sequence[str]) -> list[str]:
    """``a/b.jpg`` -> ``a/b.png``; where two inputs would share a name (``b.jpg``, ``b.png``), both
    keep their suffix (``b.jpg.png``)."""
    plain = [str(Path(n).with_suffix(".png")) for n in names]
    counts = Counter(plain)
    return [p if counts[p] == 1 else f"{n}.png" for p, n in zip(plain, names, strict=True)]
