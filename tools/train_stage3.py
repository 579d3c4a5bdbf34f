"""Train the third stage (configs/stage3.yaml):

    python tools/train_stage3.py initial_weights=<stage2_model_final.pth> pseudo_labels=<json> split=<json>

SoS-WSOD's semi-supervised retraining on torchvision's Faster R-CNN: a student and its EMA teacher start
from the second stage's weights; the images the split (tools/split_pseudo_labels.py) calls labelled train
on their pseudo boxes, the others on the teacher's boxes (docs/METHOD.md §14). The run directory, resume
(``resume=true``), sweeps and evaluation are the other stages'; ``model_final.pth`` holds the student and
the teacher, which tools/eval.py and tools/predict.py read.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from wsod.cli import SweepJobs, run_tool
from wsod.runs.prologue import sweep_job_dir  # registers the sweep folder resolver of configs/stage3.yaml
from wsod.runs.stage3 import train_stage3_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


SWEEP = SweepJobs()  # a multirun's jobs (-m seed=1,2,3), as tools/train.py's


@hydra.main(config_path=CONFIGS, config_name="stage3", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        run_tool(train_stage3_from_config, cfg)  # an error: one line, the traceback in log.txt, status 1
        return
    SWEEP.run(train_stage3_from_config, cfg, f"#{hydra_cfg.job.num} {cfg.output_dir or sweep_job_dir()}")


if __name__ == "__main__":
    main()
    SWEEP.finish()
