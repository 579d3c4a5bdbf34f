"""Every resolved config stays what it was when the configs moved onto structured schemas
(wsod/config/schema.py): each experiment, each option of each config group, and the eval, predict,
export, split and second- and third-stage configs, compared with tests/golden/resolved_configs.json
(written once, from the plain YAML configs, before the move; the later configs added as they came). A
schema or option file that changes a default or a value fails here, naming the config and the key.

The golden file is regenerated only on purpose, when a config is meant to change:
``python tests/test_resolved_configs.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from composed import composed
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
GOLDEN = Path(__file__).resolve().parent / "golden" / "resolved_configs.json"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def _cases() -> list[tuple[str, str, list[str]]]:
    """(case name, top config, overrides): every option of every group, once each."""
    cases = [("train", "train", [])]
    for group in ("data", "model", "method", "solver", "experiment"):
        cases += [(f"train {group}={o}", "train", [f"{group}={o}"]) for o in _options(group)]
    for top in ("eval", "export"):
        cases += [(top, top, [])] + [(f"{top} data={o}", top, [f"data={o}"]) for o in _options("data")]
    cases.append(("predict", "predict", []))
    cases.append(("stage2", "stage2", []))
    for group in ("data", "detector", "stage2_experiment"):
        cases += [(f"stage2 {group}={o}", "stage2", [f"{group}={o}"]) for o in _options(group)]
    cases += [("split", "split", []), ("stage3", "stage3", []), ("rpn_proposals", "rpn_proposals", [])]
    cases += [
        (f"stage3 stage3_experiment={o}", "stage3", [f"stage3_experiment={o}"])
        for o in _options("stage3_experiment")
    ]
    return cases


def _resolved(top: str, overrides: list[str]) -> dict[str, Any]:
    cfg = composed(top, tuple(overrides))
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False, enum_to_str=True)


def _differences(golden: Any, now: Any, key: str = "") -> list[str]:
    if isinstance(golden, dict) and isinstance(now, dict):
        found = []
        for k in sorted(set(golden) | set(now)):
            if k not in now:
                found.append(f"{key}{k}: gone (was {golden[k]!r})")
            elif k not in golden:
                found.append(f"{key}{k}: new ({now[k]!r})")
            else:
                found += _differences(golden[k], now[k], f"{key}{k}.")
        return found
    # type(...) too: 1 and 1.0 are different settings once written to a config.yaml
    same = golden == now and type(golden) is type(now)
    return [] if same else [f"{key.rstrip('.')}: {golden!r} -> {now!r}"]


CASES = _cases()


@pytest.mark.parametrize(("case", "top", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_resolved_config_is_unchanged(case, top, overrides):
    golden = json.loads(GOLDEN.read_text())
    assert case in golden, f"{case}: not in {GOLDEN.name} (a new config option: regenerate on purpose)"
    problems = _differences(golden[case], _resolved(top, overrides))
    assert not problems, f"{case}:\n  " + "\n  ".join(problems)


def test_every_golden_case_still_exists():
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == {case for case, _, _ in CASES}


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.write_text(json.dumps({c: _resolved(t, o) for c, t, o in CASES}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({len(CASES)} configs)")
