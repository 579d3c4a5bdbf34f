"""Files of the wrong kind given to a run's options are one line naming the file, the option and the fix,
never a bare ``KeyError``: a model file given as ``predictions=``, a final model copied among a run's
periodic checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_run import tiny_overrides

from wsod.config_checks import ConfigError
from wsod.engine.checkpoint import save_checkpoint
from wsod.runs.evaluate import evaluate_from_config
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ROOT / "tests" / "engine" / "legacy" / "model_0000002_v0.pth"  # a first-stage checkpoint


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_a_model_given_as_predictions_names_the_option(tiny_toy_root, tmp_path):
    data = [o for o in tiny_overrides(tiny_toy_root, Path("unused")) if o.startswith("data.")]
    cfg = _compose(
        "eval",
        [*data, f"checkpoint={LEGACY}", f"predictions={LEGACY}", f"output_dir={tmp_path}", "progress=false"],
    )
    threads = torch.get_num_threads()
    try:
        with pytest.raises(ConfigError) as refused:
            evaluate_from_config(cfg)
    finally:
        torch.set_num_threads(threads)
    assert str(refused.value) == (
        f"predictions={LEGACY}: not a predictions file (image_ids, detections missing): give the"
        " predictions.pth an evaluation wrote, or drop predictions= to predict again"
    )


def test_a_final_model_among_the_periodic_checkpoints_is_named_on_resume(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(LEGACY, run_dir / "model_0000002.pth")
    final = {key: value for key, value in torch.load(LEGACY, weights_only=True).items() if key != "trainer"}
    save_checkpoint(final, run_dir / "model_0000004.pth")  # model_final.pth's layout, renamed
    with pytest.raises(ConfigError) as refused:
        train_from_config(_compose("train", tiny_overrides(tiny_toy_root, run_dir, resume="true")))
    assert str(refused.value) == (
        f"{run_dir / 'model_0000004.pth'} holds no training state (trainer missing): resume reads the"
        f" periodic checkpoints (model_<iteration>.pth) a training run writes; move this file out of"
        f" {run_dir}, or give another output_dir"
    )
