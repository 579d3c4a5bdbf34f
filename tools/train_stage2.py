"""Train the second stage: ``python tools/train_stage2.py pseudo_labels=<json> <hydra overrides>``
(configs/stage2.yaml).

torchvision's Faster R-CNN trained on the pseudo boxes of tools/export_pseudo_labels.py, in a run
directory like tools/train.py's (config, log, metrics, tensorboard, checkpoints; ``resume=true``
continues), evaluated at the end on the data config's test set with the same metrics. Its
``model_final.pth`` goes to tools/eval.py and tools/predict.py like a first-stage checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from wsod.cli import SweepJobs, run_tool
from wsod.runs.prologue import sweep_job_dir  # registers the sweep folder resolver of configs/stage2.yaml
from wsod.runs.stage2 import train_stage2_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


SWEEP = SweepJobs()  # a multirun's jobs (-m seed=1,2,3), as tools/train.py's


@hydra.main(config_path=CONFIGS, config_name="stage2", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        run_tool(train_stage2_from_config, cfg)  # an error: one line, the traceback in log.txt, status 1
        return
    SWEEP.run(train_stage2_from_config, cfg, f"#{hydra_cfg.job.num} {cfg.output_dir or sweep_job_dir()}")


if __name__ == "__main__":
    main()
    SWEEP.finish()
