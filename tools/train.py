"""Train a weakly-supervised detector: ``python tools/train.py <hydra overrides>`` (see configs/train.yaml).

With no argument it generates the toy dataset if absent, trains the CPU-sized model on it, evaluates
on the toy test split and prints the per-class table with a ``copypaste:`` line.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from wsod.cli import run_tool
from wsod.run import train_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIGS, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_tool(train_from_config, cfg)  # an error: one line here, the traceback in log.txt, exit status 1


if __name__ == "__main__":
    main()
