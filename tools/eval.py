"""Evaluate a checkpoint: ``python tools/eval.py checkpoint=<path> <hydra overrides>`` (configs/eval.yaml).

The checkpoint is always named explicitly. Predictions are recomputed unless ``predictions=FILE`` names a
file written by an earlier evaluation of the same images.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from wsod.cli import run_tool
from wsod.runs.evaluate import evaluate_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIGS, config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_tool(evaluate_from_config, cfg)  # an error: one line here, the traceback in log.txt, exit status 1


if __name__ == "__main__":
    main()
