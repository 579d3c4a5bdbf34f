"""The pipeline of docs/guides/second_stage.md on the tiny toy set: each bash block of the guide, word for
word, with a short schedule appended to each command (``short_overrides``). ``conftest.guide_pipeline``
runs the first block once per session; the second- and third-stage tests read its run folders."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from tiny_run import tiny_overrides

from wsod.runs.evaluate import evaluate_from_config
from wsod.runs.export import export_from_config
from wsod.runs.rpn_proposals import rpn_proposals_from_config
from wsod.runs.split import split_from_config
from wsod.runs.stage2 import train_stage2_from_config
from wsod.runs.stage3 import train_stage3_from_config
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "second_stage.md"
ENTRY_POINTS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "tools/train.py": ("train", train_from_config),
    "tools/export_pseudo_labels.py": ("export", export_from_config),
    "tools/train_stage2.py": ("stage2", train_stage2_from_config),
    "tools/eval.py": ("eval", evaluate_from_config),
    "tools/split_pseudo_labels.py": ("split", split_from_config),
    "tools/train_stage3.py": ("stage3", train_stage3_from_config),
    "tools/rpn_proposals.py": ("rpn_proposals", rpn_proposals_from_config),
}
# The smallest second-stage detector: the pipeline's steps and files, not its accuracy, are tested here.
TINY_DETECTOR = [
    "detector.fpn_channels=16", "detector.representation_size=32", "detector.box_batch_size_per_image=32",
    "detector.rpn_post_nms_top_n_train=100", "detector.rpn_post_nms_top_n_test=50",
]  # fmt: skip
_RUN_KEYS = (
    "solver.max_iter",
    "solver.warmup_iters",
    "solver.milestones",
    "log_period",
    "checkpoint_period",
    "progress",
)


def compose_config(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def guide_block(index: int, document: Path = GUIDE) -> list[str]:
    """The commands of a document's ``index``-th toy bash block (comments dropped; the guide's default)."""
    blocks = re.findall(r"```bash\n(.*?)```", document.read_text(), flags=re.S)
    toy = [b for b in blocks if "torchrun" not in b and "voc07" not in b and "tools/" in b]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in toy[index].splitlines() if line.strip()]


def short_overrides(root: Path, name: str) -> list[str]:
    """The short schedule on the tiny toy set for each entry point (appended to a guide's command)."""
    data = [o for o in tiny_overrides(root, Path("unused")) if o.startswith("data.")]
    if name == "train":
        return [o for o in tiny_overrides(root, Path("unused")) if not o.startswith("output_dir=")]
    if name in ("stage2", "stage3"):
        run = [o for o in tiny_overrides(root, Path("unused")) if o.split("=")[0] in _RUN_KEYS]
        return [*data, *run, *TINY_DETECTOR]
    return [*data, "progress=false"]


def run_commands(commands: list[str], root: Path, workdir: Path) -> list[Any]:
    """Each command's entry point on its words plus the short schedule, in ``workdir`` (the guide's
    relative run folders land there); their results."""
    results = []
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        for command in commands:
            words = shlex.split(command)
            name, entry = ENTRY_POINTS[words[1]]
            results.append(entry(compose_config(name, words[2:] + short_overrides(root, name))))
    finally:
        os.chdir(cwd)
    return results


def run_under_torchrun(tool: str, overrides: list[str], run_dir: Path, steps: int = 4) -> None:
    """``tool`` under torchrun with two gloo processes: it must exit 0, log each of ``steps`` steps once
    with a finite loss, evaluate once and write ``model_final.pth`` into ``run_dir``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*launcher, tool, *overrides]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["kind"] == "train"] == list(range(1, steps + 1))
    assert [r["kind"] for r in rows].count("eval") == 1
    assert all(math.isfinite(r["loss_total"]) for r in rows if r["kind"] == "train")
    assert (run_dir / "model_final.pth").is_file()
