"""Export pseudo ground truth: ``python tools/export_pseudo_labels.py checkpoint=<path> <hydra overrides>``
(configs/export.yaml).

A trained checkpoint predicts the training images of the data config at its test views; the boxes the
rule keeps (per image label: its top detection and the confident others, less those inside another box
of their class) are written as a COCO instances json for tools/train_stage2.py, with a summary: boxes
per class and, where the training set has ground-truth boxes, their precision and recall at IoU 0.5.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from wsod.cli import run_tool
from wsod.runs.export import export_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIGS, config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_tool(export_from_config, cfg)  # an error: one line here, the traceback in log.txt, exit status 1


if __name__ == "__main__":
    main()
