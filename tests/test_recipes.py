"""docs/RECIPES.md and docs/RECIPES_RETRAINING.md describe every experiment config exactly. RECIPES.md's
defaults table is the composed recipe of ``experiment=mist_vgg16_voc07``, RECIPES_RETRAINING.md's
second-stage defaults table that of ``stage2_experiment=faster_rcnn_r50-fpn_voc07``; each
``### <experiment>`` section (a third-stage one included) names the recipe it differs from and lists the
differences, which applied onto that recipe give the experiment's composed config, key for key."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from composed import composed
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
RECIPES = ROOT / "docs" / "RECIPES.md"
RETRAINING = ROOT / "docs" / "RECIPES_RETRAINING.md"

DEFAULTS = "the defaults"  # ``## The defaults``: experiment=mist_vgg16_voc07
STAGE2_DEFAULTS = "the second-stage defaults"  # ``## The second-stage defaults``: faster_rcnn_r50-fpn_voc07
BASE_RECIPES = {
    DEFAULTS: ("train", "experiment=mist_vgg16_voc07"),
    STAGE2_DEFAULTS: ("stage2", "stage2_experiment=faster_rcnn_r50-fpn_voc07"),
}
ABSENT = "(absent)"  # the value of a row for a key of the base that the experiment does not have
MAX_BYTES = 40_000  # 40 KB, also under 40 KiB


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def _leaves(node: dict, prefix: str, skip: tuple[str, ...] = ()) -> dict:
    out = {}
    for key, value in node.items():
        if key not in skip:
            out |= (
                _leaves(value, f"{prefix}.{key}") if isinstance(value, dict) else {f"{prefix}.{key}": value}
            )
    return out


def _recipe(config_name: str, override: str) -> dict:
    """The recipe of ``override`` (``experiment=<name>`` or ``stage2_experiment=<name>``) composed, as plain
    values (the schemas' enums as their names)."""
    cfg = composed(config_name, (override,))  # stage 2's ??? pseudo_labels is not part of a recipe
    return _recipe_of(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False, enum_to_str=True))


def _recipe_of(cfg: dict) -> dict:
    """The recipe keys of a config and their values: the whole model (stage 2: detector), method and solver,
    the seed, and the data's training and test settings (not file locations, worker counts or the
    evaluation batch size)."""
    recipe = {"seed": cfg["seed"], "data.kind": cfg["data"]["kind"]}
    recipe |= _leaves(cfg["data"]["train"], "data.train", skip=("sets", "num_workers"))
    recipe |= _leaves(cfg["data"]["test"], "data.test", skip=("set", "num_workers", "batch_size"))
    for group in ("model", "detector", "method", "solver", "semi_supervised"):
        recipe |= _leaves(cfg.get(group, {}), group)
    return recipe


@dataclass
class Section:
    """A defaults table or an experiment's section: the recipe it names as its base (none for a defaults
    table), how often it names one, and its rows, key -> (value as written, source)."""

    name: str
    prose: list[str] = field(default_factory=list)
    rows: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def bases(self) -> list[str]:
        text = " ".join(self.prose)
        return [
            b or d
            for d, b in re.findall(
                r"Differences from (the defaults|the second-stage defaults|`([^`]+)`)", text
            )
        ]

    @property
    def base(self) -> str | None:
        return self.bases[0] if self.bases else None


def _sections() -> list[Section]:
    """``## The defaults``, ``## The second-stage defaults`` and every ``### <experiment>``, in order
    (RECIPES.md's, then RECIPES_RETRAINING.md's)."""
    sections: list[Section] = []
    current = None
    lines = RECIPES.read_text().splitlines() + RETRAINING.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if heading := re.fullmatch(r"(##|###) (.+)", line):
            name = heading.group(2).lower() if heading.group(1) == "##" else heading.group(2)
            current = Section(name) if heading.group(1) == "###" or name in BASE_RECIPES else None
            sections += [current] if current else []
        elif current is not None and (row := re.fullmatch(r"\| ([a-z0-9_.]+) \| (.+?) \| (.*) \|", line)):
            key, value, source = row.groups()
            if key == "key":  # the header row
                continue
            assert key not in current.rows, f"RECIPES.md line {number}: {current.name}: {key} listed twice"
            assert source.strip(), f"RECIPES.md line {number}: {current.name}: {key} has no source"
            current.rows[key] = (value, source)
        elif current is not None and not line.startswith("|"):
            current.prose.append(line)
    return sections


def _value(text: str):
    if text == ABSENT:
        return ABSENT
    if re.fullmatch(r"\d+/\d+", text):
        return float(Fraction(text))
    return yaml.safe_load(text)


def _same(expected, actual) -> bool:
    """Equal values of the same type (a float to 12 digits; lists element by element)."""
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(map(_same, expected, actual))
    if type(expected) is not type(actual):
        return False
    if isinstance(expected, float):
        return actual == pytest.approx(expected, rel=1e-12)
    return expected == actual


@dataclass(frozen=True)
class Entry:
    """A key's value in a resolved recipe, its source and the section whose row gave it."""

    value: object
    source: str
    section: str


def _resolve(name: str, sections: dict[str, Section], seen: tuple[str, ...] = ()) -> dict[str, Entry]:
    """A section's recipe: its base's with its own rows applied. A row must change its base's value, add a
    key, or give the base's value another source; ``(absent)`` removes a key of the base."""
    assert name in sections, f"{seen[-1] + ': its base ' if seen else ''}{name} has no section in RECIPES.md"
    assert name not in seen, f"the bases of {seen[0]} run in a circle: {' -> '.join((*seen, name))}"
    section = sections[name]
    if name in BASE_RECIPES:
        return {key: Entry(_value(value), source, name) for key, (value, source) in section.rows.items()}
    assert section.base is not None, (
        f"{name}: names no base ('Differences from the defaults' or from `<name>`)"
    )
    recipe = dict(_resolve(section.base, sections, (*seen, name)))
    for key, (text, source) in section.rows.items():
        value = _value(text)
        if value == ABSENT:
            assert key in recipe, f"{name}: {key} is (absent), but its base {section.base} has no such key"
            del recipe[key]
            continue
        base = recipe.get(key)
        assert base is None or not (_same(value, base.value) and source == base.source), (
            f"{name}: the row {key} repeats its base {section.base} (value and source): drop it"
        )
        recipe[key] = Entry(value, source, name)
    return recipe


def _assert_recipe(name: str, recipe: dict[str, Entry], composed: dict) -> None:
    """Every key of the composed recipe has a row (own or inherited) with its value, and no other row."""
    problems = [f"{key}: no row (the config has {composed[key]!r})" for key in composed if key not in recipe]
    problems += [
        f"{key}: a row of {e.section}, not in the composed config"
        for key, e in recipe.items()
        if key not in composed
    ]
    problems += [
        f"{key}: RECIPES.md gives {e.value!r} (a row of {e.section}), the config has {composed[key]!r}"
        for key, e in recipe.items()
        if key in composed and not _same(e.value, composed[key])
    ]
    assert not problems, f"{name}: RECIPES.md and the composed config differ:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", [RECIPES, RETRAINING], ids=lambda p: p.name)
def test_each_recipes_page_is_at_most_40_kb(page):
    assert len(page.read_bytes()) <= MAX_BYTES, f"docs/{page.name}: list differences, not whole recipes"


def test_every_experiment_has_exactly_one_section():
    names = [s.name for s in _sections() if s.name not in BASE_RECIPES]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    assert not duplicated, f"more than one section: {duplicated}"
    assert sorted(names) == sorted(
        _names("experiment") + _names("stage2_experiment") + _names("stage3_experiment")
    )
    for section in _sections():
        expected = 0 if section.name in BASE_RECIPES else 1
        assert len(section.bases) == expected, (
            f"{section.name}: names {section.bases or 'no recipe'} as its base"
        )


@pytest.mark.parametrize("defaults", sorted(BASE_RECIPES))
def test_the_defaults_tables_are_their_base_recipes(defaults):
    sections = {s.name: s for s in _sections()}
    assert defaults in sections and sections[defaults].rows, f"RECIPES.md has no table under '## {defaults}'"
    _assert_recipe(defaults, _resolve(defaults, sections), _recipe(*BASE_RECIPES[defaults]))


@pytest.mark.parametrize("name", _names("experiment"))
def test_composed_experiment_matches_its_recipe_section(name):
    sections = {s.name: s for s in _sections()}
    _assert_recipe(name, _resolve(name, sections), _recipe("train", f"experiment={name}"))


@pytest.mark.parametrize("name", _names("stage2_experiment"))
def test_composed_second_stage_experiment_matches_its_recipe_section(name):
    sections = {s.name: s for s in _sections()}
    composed = _recipe("stage2", f"stage2_experiment={name}")
    _assert_recipe(name, _resolve(name, sections), composed)
    processes = 1 if name.endswith("_1gpu") else 8
    assert (
        processes * composed["solver.ims_per_batch"] * composed["solver.accumulation"] == 16
    )  # SoS-WSOD's 16


@pytest.mark.parametrize("name", _names("stage3_experiment"))
def test_composed_third_stage_experiment_matches_its_recipe_section(name):
    sections = {s.name: s for s in _sections()}
    composed = _recipe("stage3", f"stage3_experiment={name}")
    _assert_recipe(name, _resolve(name, sections), composed)
    processes = 1 if name.endswith("_1gpu") else 8
    per_step = processes * composed["solver.accumulation"]
    labelled = per_step * composed["solver.ims_per_batch"]
    unlabelled = per_step * composed["semi_supervised.unlabelled_per_batch"]
    assert labelled == unlabelled == (16 if "coco" in name else 8)  # SoS-WSOD's 8 + 8 (VOC), 16 + 16 (COCO)


def test_the_documented_cfg_job_commands_print_the_composed_config_without_training():
    # RECIPES.md's bash block, run word for word: Hydra prints the job's config and exits.
    blocks = re.findall(r"```bash\n(.*?)```", RECIPES.read_text(), re.S)
    commands = [
        shlex.split(line) for block in blocks for line in block.splitlines() if line.endswith(" --cfg job")
    ]
    tools = {
        "tools/train.py": ("train", "backbone: vgg16"),
        "tools/train_stage2.py": ("stage2", "name: faster_rcnn"),
    }
    assert [words[:2] for words in commands] == [["python", tool] for tool in tools]
    # Both at once (each is mostly interpreter start-up).
    running = [
        subprocess.Popen(
            [sys.executable, *words[1:]], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for words in commands
    ]
    for words, process in zip(commands, running, strict=True):
        stdout, stderr = process.communicate(timeout=300)
        done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        assert done.returncode == 0, f"{shlex.join(words)}:\n{done.stderr[-3000:]}"
        config_name, line = tools[words[1]]
        assert f"\n  {line}\n" in done.stdout, f"{shlex.join(words)} does not print {line!r}"
        printed, composed = _recipe_of(yaml.safe_load(done.stdout)), _recipe(config_name, words[2])
        wrong = sorted(printed.keys() ^ composed.keys())
        wrong += sorted(k for k in printed.keys() & composed.keys() if not _same(composed[k], printed[k]))
        assert not wrong, f"{shlex.join(words)} prints other values than the composed config for {wrong}"
