"""wsod/config_schema.py: each option file of a group keeps only what differs from its schema's
defaults; a key declared once in a schema reaches every option of its group and the command line;
choices are Enums that read as their strings and leave plain strings in files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from wsod.build import build_optimizer
from wsod.config_checks import TRAIN_RULES, check_config
from wsod.config_schema import SCHEMAS, Amp, Optimizer, Solver, plain, register_schemas

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _options(group: str) -> list[Path]:
    return sorted((CONFIGS / group).glob("*.yaml"))


def _base_defaults(group: str, option: Path) -> tuple[str, dict[str, Any]]:
    """The base an option file extends (the first entry of its defaults list) and that schema's defaults;
    or, for an option that extends another option of its group (data=toy_parts extends toy), that
    option's resolved values."""
    text = yaml.safe_load(option.read_text())
    base = text["defaults"][0]
    if (CONFIGS / group / f"{base}.yaml").is_file():
        return base, OmegaConf.to_container(_compose("train", [f"{group}={base}"])[group], enum_to_str=True)
    (schema,) = [s for g, n, s in SCHEMAS if g == group and n == base]
    return base, OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)


def _restated(values: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys of ``values`` whose value is its base's default."""
    found = []
    for key, value in values.items():
        default = defaults.get(key, "<none>")
        if isinstance(value, dict) and isinstance(default, dict):
            found += _restated(value, default, f"{prefix}{key}.")
        elif value == default and type(value) is type(default):
            found.append(f"{prefix}{key}")
    return found


@pytest.mark.parametrize(
    ("group", "option"),
    [(g, p) for g in ("data", "model", "solver", "detector") for p in _options(g)],
    ids=lambda x: x.stem if isinstance(x, Path) else x,
)
def test_each_option_file_extends_its_schema_and_keeps_only_its_differences(group, option):
    base, defaults = _base_defaults(group, option)
    values = {k: v for k, v in yaml.safe_load(option.read_text()).items() if k != "defaults"}
    restated = _restated(values, defaults)
    assert not restated, f"configs/{group}/{option.name} restates {base}'s defaults: {', '.join(restated)}"


@dataclass
class _SolverWithANewKey(Solver):
    """A new solver key, declared once: here, with its type and default."""

    clip_grad_norm: float = 10.0


@pytest.fixture
def solver_with_a_new_key():
    ConfigStore.instance().store(group="solver", name="base", node=_SolverWithANewKey)
    yield
    register_schemas()  # the real schema again


@pytest.mark.usefixtures("solver_with_a_new_key")
@pytest.mark.parametrize("solver", [p.stem for p in _options("solver")])
def test_a_new_solver_key_declared_once_reaches_every_solver_option_and_the_command_line(solver):
    cfg = _compose("train", [f"solver={solver}"])
    assert cfg.solver.clip_grad_norm == 10.0  # its default, in every option, no YAML touched
    cfg = _compose("train", [f"solver={solver}", "solver.clip_grad_norm=2"])
    check_config(cfg, TRAIN_RULES)
    settings = plain(cfg.solver)  # what the builders read
    assert settings["clip_grad_norm"] == 2.0 and isinstance(settings["clip_grad_norm"], float)
    with pytest.raises(ConfigCompositionException):
        _compose("train", [f"solver={solver}", "solver.clip_grad_norm=much"])


def test_without_the_declaration_the_key_is_refused():
    with pytest.raises(ConfigCompositionException):
        _compose("train", ["solver.clip_grad_norm=2"])


def test_choices_are_enums_that_read_as_their_strings_and_leave_plain_strings_in_files():
    cfg = _compose("train", ["solver=voc"])
    assert cfg.solver.optimizer is Optimizer.sgd and cfg.solver.optimizer == "sgd"
    assert cfg.solver.amp is Amp.bf16 and f"{cfg.solver.amp}" == "bf16" and str(cfg.solver.amp) == "bf16"
    settings = plain(cfg)
    assert type(settings["solver"]["optimizer"]) is str and type(settings["model"]["norm"]) is str
    json.dumps(settings)  # what a checkpoint's metadata and the run files hold
    assert "optimizer: sgd" in OmegaConf.to_yaml(cfg)
    optimizer = build_optimizer(cfg.solver, torch.nn.Linear(2, 2))
    assert isinstance(optimizer, torch.optim.SGD)
