"""Train a weakly-supervised detector: ``python tools/train.py <hydra overrides>`` (see configs/train.yaml).

With no argument it generates the toy dataset if absent, trains the CPU-sized model on it, evaluates
on the toy test split and prints the per-class table with a ``copypaste:`` line.

With ``-m`` and comma-separated values (Hydra's multirun) it trains one run per combination, one after
the other, each in its own directory under ``hydra.sweep.dir`` (configs/train.yaml). A job that fails
prints its one line and the sweep goes on with the next; the command then exits with status 1 naming
the failed jobs.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from wsod.cli import SweepJobs, run_tool
from wsod.runs.prologue import sweep_job_dir  # registers the sweep folder resolver of configs/train.yaml
from wsod.runs.train import train_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")

# A multirun's jobs, and those that failed, for its last word.
SWEEP = SweepJobs()


@hydra.main(config_path=CONFIGS, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        run_tool(train_from_config, cfg)  # an error: one line here, the traceback in log.txt, exit status 1
        return
    SWEEP.run(train_from_config, cfg, f"#{hydra_cfg.job.num} {cfg.output_dir or sweep_job_dir()}")


if __name__ == "__main__":
    main()
    SWEEP.finish()
