"""Each repository config composed once per test session, for the tests that only read it: the golden
comparison, the schema coverage and the group-option checks compose the same configs (about 80 ms each).
The shared config is read-only, so no test can change what another one reads."""

from __future__ import annotations

import functools
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import wsod.config_schema  # noqa: F401  (registers the configs' schemas)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@functools.cache
def composed(name: str, overrides: tuple[str, ...] = ()) -> DictConfig:
    """configs/<name>.yaml with ``overrides``, composed by Hydra (no ``hydra`` node), read-only."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg
