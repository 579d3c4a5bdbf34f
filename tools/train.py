"""Train a weakly-supervised detector: ``python tools/train.py <hydra overrides>`` (see configs/train.yaml).

With no argument it generates the toy dataset if absent, trains the CPU-sized model on it, evaluates
on the toy test split and prints the per-class table with a ``copypaste:`` line.

With ``-m`` and comma-separated values (Hydra's multirun) it trains one run per combination, one after
the other, each in its own directory under ``hydra.sweep.dir`` (configs/train.yaml). A job that fails
prints its one line and the sweep goes on with the next; the command then exits with status 1 naming
the failed jobs.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from wsod.cli import run_tool
from wsod.run import sweep_job_dir, train_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")

# A multirun's jobs ("#<number> <run directory>"), and those that failed, for its last word.
JOBS: list[str] = []
FAILED_JOBS: list[str] = []


@hydra.main(config_path=CONFIGS, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        run_tool(train_from_config, cfg)  # an error: one line here, the traceback in log.txt, exit status 1
        return
    JOBS.append(f"#{hydra_cfg.job.num} {cfg.output_dir or sweep_job_dir()}")
    try:
        run_tool(train_from_config, cfg)
    except SystemExit as stop:
        # run_tool has printed the error and logged its traceback; exiting here would drop the sweep's
        # remaining jobs, which do not depend on this one.
        if stop.code not in (None, 0):
            FAILED_JOBS.append(JOBS[-1])
    finally:
        _close_run_log()


def _close_run_log() -> None:
    """Detach and close the finished job's ``log.txt`` handler (``wsod.cli.setup_logging`` marks its
    handlers ``_wsod``): the next job's messages before its own run directory is chosen (a refused
    config, say) would land in this job's log otherwise."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if getattr(handler, "_wsod", False) and isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


if __name__ == "__main__":
    main()
    if FAILED_JOBS:
        failed = ", ".join(FAILED_JOBS)
        print(f"error: {len(FAILED_JOBS)} of {len(JOBS)} sweep jobs failed (their errors above): {failed}",
              file=sys.stderr)  # fmt: skip
        sys.exit(1)
