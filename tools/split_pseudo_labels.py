"""Split pseudo-labelled images for the third stage (configs/split.yaml):

    python tools/split_pseudo_labels.py checkpoint=<stage2_checkpoint.pth> pseudo_labels=<json> k=2000

Each image of the pseudo-label json is scored by the second-stage detector's four training losses against
its own pseudo boxes; the k of lowest loss keep their boxes in the third stage (tools/train_stage3.py),
the others only their image labels. Writes ``split.json`` beside the json, with each image's loss, and
logs the labelled share of each class (docs/METHOD.md §14).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from wsod.cli import run_tool
from wsod.runs.split import split_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIGS, config_name="split", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_tool(split_from_config, cfg)  # an error: one line here, the traceback in log.txt, exit status 1


if __name__ == "__main__":
    main()
