"""What every entry point of ``wsod.runs`` shares: one prologue and epilogue (``run_in_directory``), and
the run directory of a sweep's job.

The config is checked before anything runs (by each entry point); then ``run_in_directory`` sets the
device and CPU threads, chooses the output directory (once, for every process), locks and claims it,
sends the log to its ``log.txt``; a run that ends in an error leaves ``error.txt`` there, and one that
succeeds removes an earlier attempt's.

Sweeps (``python tools/train.py -m method=mist,oicr seed=1,2,3 hydra.sweep.dir=runs/methods``, Hydra's
multirun, one job after the other): each training job's run directory is
``<hydra.sweep.dir>/<hydra.sweep.subdir>``, i.e. ``runs/methods/method=mist,seed=1``
(configs/train.yaml), unless ``output_dir`` names one (``sweep_job_dir``). Hydra writes no file of its
own there: ``DiscardMultirunYaml`` removes the ``multirun.yaml`` it saves in the sweep directory (each
run's ``config.yaml`` and ``log.txt`` hold the settings and the command). Importing this module registers
the ``wsod_folder_name`` resolver that ``hydra.sweep.subdir`` uses: tools/train.py and
tools/train_stage2.py import it before Hydra composes their config.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from wsod.build import resolve_device, resolve_threads
from wsod.cli import setup_logging, write_failure
from wsod.config_checks import ConfigError
from wsod.directory_lock import DirectoryBusyError, DirectoryLock
from wsod.distributed import broadcast_object, is_main_process

__all__ = [
    "choose_output_dir",
    "in_multirun",
    "sweep_job_dir",
    "DiscardMultirunYaml",
    "run_in_directory",
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


def refuse_to_overwrite(existing: list[Path], overwrite: bool) -> str | None:
    """The claim of a tool that writes named files into a folder (the export, the split, the region
    proposals): None when none of its files is there yet (``existing``: those that are); else refused,
    naming them, unless ``overwrite``, which returns the line to log."""
    if not existing:
        return None
    if len(existing) == 1:
        held, them = f"{existing[0]} exists", "it"
    else:
        held, them = f"{existing[0].parent} holds {', '.join(p.name for p in existing)}", "them"
    if not overwrite:
        raise ConfigError(f"{held}: overwrite=true replaces {them}, another output_dir keeps {them}")
    return f"overwrite=true: {', '.join(map(str, existing))} replaced"


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
