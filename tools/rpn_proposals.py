"""Proposals learned by the second stage (configs/rpn_proposals.yaml):

    python tools/rpn_proposals.py checkpoint=runs/toy_stage2/model_final.pth

A second-stage (or third-stage) Faster R-CNN's region proposal network proposes class-agnostic boxes, with
their objectness scores, for every image of the data config's training and test sets, written as one
memory-mapped store per set beside the checkpoint (``rpn_proposals/``); ``log.txt`` there names the
``data.*.proposals`` override of each, to train the first stage again on them. No test label is used.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from wsod.cli import run_tool
from wsod.runs.rpn_proposals import rpn_proposals_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIGS, config_name="rpn_proposals", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_tool(
        rpn_proposals_from_config, cfg
    )  # an error: one line here, the traceback in log.txt, exit status 1


if __name__ == "__main__":
    main()
