"""Every command the README (and docs/RESULTS.md, the guides in docs/guides/, docs/BENCHMARKS.md,
data/README.md), the comments of the configs and the usage lines of the tools show works as written;
the README stays a short front door whose links, and those of the results and the guides, all resolve.

Commands are collected from fenced ``bash`` blocks (backslash continuations joined, comments dropped),
from inline code that starts with ``python tools/`` or ``torchrun``, from config comment lines that hold
such a command (``#   python tools/train.py ...``), and from the tools' module docstrings. For each:

* ``tools/train.py``, ``tools/eval.py``, ``tools/predict.py``: the Hydra config is composed from the
  command's own overrides and passes ``check_config``, so every key exists and every value is valid.
  Placeholders (``...``, ``<run>``) are left out: they stand for the reader's own values.
* the argparse tools (benchmarks, ``make_proposals.py``): their parser accepts the command's arguments.

Running them is the job of other tests: the own-data block (docs/guides/own_data.md) runs word for
word in ``tests/test_own_data.py``, the second and third stages' toy pipeline (docs/guides/
second_stage.md) in ``tests/test_stage2.py`` and ``tests/test_stage3.py``, each training feature runs in
``tests/test_run.py``, and the default toy run (``python tools/train.py``, about 20 minutes on 2 cores)
runs word for word in the slow test below.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # the sweep expansion -m runs
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from wsod.config_checks import (
    EVAL_RULES,
    EXPORT_RULES,
    PREDICT_RULES,
    RPN_PROPOSALS_RULES,
    SPLIT_RULES,
    STAGE2_RULES,
    STAGE3_RULES,
    TRAIN_RULES,
    check_config,
)

ROOT = Path(__file__).resolve().parents[1]
GUIDES = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md")))
DOCUMENTS = ("README.md", "docs/RESULTS.md", *GUIDES, "docs/BENCHMARKS.md", "data/README.md")
README_LIMIT = 10 * 1024  # bytes: the README is a front door; the details live in docs/
LINKED_DOCUMENTS = ("README.md", "docs/RESULTS.md", "docs/ARCHITECTURE.md", *GUIDES)
HYDRA_TOOLS = {
    "train.py": ("train", TRAIN_RULES),
    "eval.py": ("eval", EVAL_RULES),
    "predict.py": ("predict", PREDICT_RULES),
    "export_pseudo_labels.py": ("export", EXPORT_RULES),
    "train_stage2.py": ("stage2", STAGE2_RULES),
    "split_pseudo_labels.py": ("split", SPLIT_RULES),
    "train_stage3.py": ("stage3", STAGE3_RULES),
    "rpn_proposals.py": ("rpn_proposals", RPN_PROPOSALS_RULES),
}


def _commands(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                found.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    inline = (" ".join(m.split()) for m in re.findall(r"`([^`]+)`", prose))  # may wrap across lines
    found += [m for m in inline if m.startswith(("python tools/", "torchrun "))]
    return [c for c in found if "tools/" in c]


def _command_lines(text: str) -> list[str]:
    """The commands of plain text lines (backslash continuations joined; a trailing comment dropped)."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        start = re.search(r"(python tools/|torchrun )", line)
        if not start:
            continue
        command = line[start.start() :]
        if line[: start.start()].endswith("`"):  # inline code: up to its closing backtick
            command = command.split("`", 1)[0]
        found.append(re.sub(r"\s+#.*$", "", command).strip())
    return found


def _config_commands(path: Path) -> list[str]:
    """Commands in a config's comments (``# ... python tools/train.py x=1   # why``)."""
    comments = [line.lstrip()[1:] for line in path.read_text().splitlines() if line.lstrip().startswith("#")]
    return _command_lines("\n".join(comments))


def _tool_usage_commands(path: Path) -> list[str]:
    """Commands in a tool's module docstring (its usage examples, shown by ``--help`` too)."""
    return _command_lines(ast.get_docstring(ast.parse(path.read_text())) or "")


COMMANDS = sorted(
    {(doc, c) for doc in DOCUMENTS for c in _commands(ROOT / doc)}
    | {(str(p.relative_to(ROOT)), c) for p in ROOT.glob("configs/**/*.yaml") for c in _config_commands(p)}
    | {(str(p.relative_to(ROOT)), c) for p in ROOT.glob("tools/*.py") for c in _tool_usage_commands(p)}
)


def _tool_and_arguments(command: str) -> tuple[str, list[str]]:
    """The tool's file name (``train.py``, ``gpu_check.sh``) and the words after it."""
    words = shlex.split(command)
    index = next(i for i, w in enumerate(words) if w.startswith("tools/"))
    return Path(words[index]).name, words[index + 1 :]


def _is_placeholder(word: str) -> bool:
    return "..." in word or "<" in word or ">" in word


def _jobs(arguments: list[str]) -> list[list[str]]:
    """The overrides of each job a command runs: itself, or with ``-m`` (Hydra's multirun) every
    combination of its comma-separated values, expanded by Hydra's own basic sweeper."""
    if "-m" not in arguments and "--multirun" not in arguments:
        return [arguments]
    overrides = [a for a in arguments if a not in ("-m", "--multirun")]
    (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    return jobs


class _Parsed(Exception):
    """Raised instead of running a tool once its parser has accepted the arguments."""


def test_the_documents_show_commands_of_every_kind():
    tools = {_tool_and_arguments(c)[0] for _, c in COMMANDS}
    assert {"train.py", "eval.py", "predict.py", "make_proposals.py", "benchmark_rois.py"} <= tools
    # The config comments and the tools' usage lines are read too (a refused example once hid there).
    assert ("configs/train.yaml", "python tools/train.py solver.max_iter=200 solver.milestones=[150]"
            " model.chunk_size=32") in COMMANDS  # fmt: skip
    assert any(d == "tools/make_proposals.py" and "convert" in c for d, c in COMMANDS)


@pytest.mark.parametrize(("document", "command"), COMMANDS, ids=[f"{d}: {c[:70]}" for d, c in COMMANDS])
def test_each_documented_command_is_valid(document, command, monkeypatch):
    tool, arguments = _tool_and_arguments(command)
    if tool in HYDRA_TOOLS:
        config_name, rules = HYDRA_TOOLS[tool]
        for job in _jobs([a for a in arguments if not _is_placeholder(a)]):
            with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=job, return_hydra_config=True)
            cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
            for word in arguments:  # a required value shown as a placeholder (checkpoint=...) is the reader's
                key = word.split("=", 1)[0]
                if (
                    _is_placeholder(word)
                    and "=" in word
                    and (
                        OmegaConf.is_missing(cfg, key) or OmegaConf.select(cfg, key) is None  # or optional
                    )
                ):
                    OmegaConf.update(cfg, key, "placeholder")
            check_config(cfg, rules)
        return
    if tool.endswith(".sh"):  # a shell script: it exists and bash parses it (its dry run is tested elsewhere)
        subprocess.run(["bash", "-n", str(ROOT / "tools" / tool)], check=True)
        return
    spec = importlib.util.spec_from_file_location(f"tool_{Path(tool).stem}", ROOT / "tools" / tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        original(parser, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed):
        module.main(arguments)


def _links(path: Path) -> list[str]:
    """The targets of a Markdown document's links and images (``[text](target)``), code left out."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown document's headings (lower case, punctuation dropped, spaces
    as hyphens, a repeated heading numbered)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        numbered, n = slug, 0
        while numbered in anchors:
            n += 1
            numbered = f"{slug}-{n}"
        anchors.add(numbered)
    return anchors


def test_the_readme_is_a_short_front_door_to_every_guide():
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move the details to docs/"
    assert len(GUIDES) >= 7, GUIDES
    linked = {str((ROOT / link.partition("#")[0]).resolve().relative_to(ROOT)) for link in _links(readme)}
    assert {*GUIDES, "docs/RESULTS.md"} <= linked, "every guide and the results are linked from the README"


@pytest.mark.parametrize("document", LINKED_DOCUMENTS)
def test_every_relative_link_of_the_readme_results_and_guides_resolves(document):
    source = ROOT / document
    broken = []
    for link in _links(source):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ... are not files of the repository
            continue
        target, _, anchor = link.partition("#")
        path = (source.parent / target).resolve() if target else source
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{document}: {broken}"


@pytest.mark.slow
def test_the_quick_start_trains_and_evaluates_word_for_word(tmp_path):
    """``python tools/train.py`` as the quick start shows it, from a scratch working directory (the toy
    data is generated there, as on a first use)."""
    command = next(c for d, c in COMMANDS if d == "README.md" and c == "python tools/train.py")
    words = shlex.split(command)
    words[1] = str(ROOT / words[1])
    result = subprocess.run(
        [sys.executable, *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=3600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "copypaste: mAP(voc07,iou=0.5)=" in result.stdout
    assert "\r" not in result.stdout + result.stderr  # a piped run's log: lines, no progress-bar frames
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("copypaste:"))
    assert lines[at + 1].startswith("quick start: the default toy run lands at mAP")  # in or out: it says
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "model_final.pth").is_file() and (run_dir / "eval" / "metrics.json").is_file()
