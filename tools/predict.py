"""Detect objects in new images with a trained checkpoint and draw them (configs/predict.yaml):

    python tools/predict.py checkpoint=runs/my_run/model_final.pth input=data/my_images/images \\
        output=runs/my_predictions score_threshold=0.3

``input`` is an image file, a folder or a glob pattern; the result is ``<output>/predictions.json`` (COCO
results entries with ``file_name`` and ``category_name``) and one PNG per image with its boxes, class
names and scores drawn. Proposals are computed on the fly unless ``proposals=`` names a file.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from wsod.cli import run_tool
from wsod.runs.predict import predict_from_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIGS, config_name="predict", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_tool(predict_from_config, cfg)  # an error: one line here, the traceback in log.txt, exit status 1


if __name__ == "__main__":
    main()
