"""wsod/config_checks.py: model.chunk_size=auto and model.memory_budget_gb (the other rules are exercised
through tools/train.py in test_reliability.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from wsod.config_checks import ConfigError, check_config, resume_changes

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.chunk_size=auto", "model.memory_budget_gb=4", "device=cpu"],
        ["model.chunk_size=auto", "model.memory_budget_gb=0.5"],
        ["model.chunk_size=auto", "device=cuda"],  # CUDA finds its own budget
        ["model.chunk_size=null"],
        ["model.chunk_size=64"],
    ],
)
def test_auto_and_the_budget_are_accepted(overrides):
    check_config(_config(overrides))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.chunk_size=big"], "model.chunk_size='big': expected null, auto or an integer >= 1"),
        (["model.chunk_size=auto", "model.memory_budget_gb=-1"], "model.memory_budget_gb=-1: expected null"),
        (["model.chunk_size=auto", "model.memory_budget_gb=lots"], "model.memory_budget_gb='lots'"),
        (["model.memory_budget_gb=4"], "model.memory_budget_gb=4: used only with model.chunk_size=auto"),
        (["model.chunk_size=auto", "device=cpu"], "model.chunk_size=auto on device='cpu' (no CUDA) needs"),
    ],
)
def test_impossible_auto_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match="invalid configuration") as error:
        check_config(_config(overrides))
    assert message in str(error.value)


def test_auto_without_a_budget_on_device_auto_depends_on_cuda(monkeypatch):
    cfg = _config(["model.chunk_size=auto"])  # device: auto
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.memory_budget_gb"):
        check_config(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_config(cfg)


def test_a_resume_may_change_the_chunking_and_the_budget():
    before = _config(["model.chunk_size=64"])
    after = _config(["model.chunk_size=auto", "model.memory_budget_gb=2"])
    assert resume_changes(before, after) == [
        "model.chunk_size: 64 -> 'auto'",
        "model.memory_budget_gb: null -> 2",
    ]
