"""A checkpoint is loaded with torch's weights-only unpickler by every command that reads one: a ``.pth``
whose pickle would run a command is refused, naming the file and the way out (``trust_checkpoint=true``),
and the command never runs. Everything wsod itself writes loads that way."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_run import minimal_pseudo_labels, tiny_overrides

from wsod.engine.checkpoint import UntrustedCheckpointError, latest_valid_checkpoint, load_checkpoint
from wsod.runs.evaluate import evaluate_from_config
from wsod.runs.export import export_from_config
from wsod.runs.predict import predict_from_config
from wsod.runs.rpn_proposals import rpn_proposals_from_config
from wsod.runs.split import split_from_config
from wsod.runs.stage2 import train_stage2_from_config
from wsod.runs.stage3 import train_stage3_from_config
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ROOT / "tests" / "engine" / "legacy" / "model_0000002_v0.pth"  # a real checkpoint of the toy set


class _RunsACommand:
    """Unpickled, it calls ``os.system(command)``: what a hostile checkpoint does."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _hostile_checkpoint(path: Path, target: Path) -> Path:
    """A file shaped like a wsod checkpoint whose metadata creates ``target`` when unpickled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": {"w": torch.ones(1)}, "trainer": {"iteration": 2}, "metadata": {}}
    payload["metadata"]["classes"] = _RunsACommand(f"touch {shlex.quote(str(target))}")
    torch.save(payload, path)
    return path


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _data(root: Path) -> list[str]:
    return [o for o in tiny_overrides(root, Path("unused")) if o.startswith("data.")]


def _commands(root: Path, tmp: Path, hostile: Path):
    """(name, entry point, config) of every command that reads a checkpoint, reading ``hostile``."""
    data = [*_data(root), "progress=false", "device=cpu"]
    run_dir = tmp / "run"  # a run directory whose newest checkpoint is the hostile file
    run_dir.mkdir()
    os.link(hostile, run_dir / "model_0000002.pth")
    pseudo = tmp / "pseudo_labels.json"
    minimal_pseudo_labels(pseudo)
    images = root / "VOCdevkit" / "VOC2007" / "JPEGImages"
    stage3 = [*data, f"pseudo_labels={pseudo}", f"split={tmp / 'split.json'}"]
    return [
        ("tools/eval.py", evaluate_from_config, "eval", [f"checkpoint={hostile}", *data]),
        (
            "tools/eval.py predictions=",  # a good checkpoint, hostile predictions
            evaluate_from_config,
            "eval",
            [f"checkpoint={LEGACY}", f"predictions={hostile}", f"output_dir={tmp / 'eval'}", *data],
        ),
        (
            "tools/predict.py",
            predict_from_config,
            "predict",
            [f"checkpoint={hostile}", f"input={images}", f"output={tmp / 'predicted'}", "progress=false"],
        ),
        (
            "tools/export_pseudo_labels.py",
            export_from_config,
            "export",
            [f"checkpoint={hostile}", f"output_dir={tmp / 'export'}", *data],
        ),
        (
            "tools/train.py resume=true",
            train_from_config,
            "train",
            [*tiny_overrides(root, run_dir), "resume=true"],
        ),
        (
            "tools/train_stage2.py resume=true",
            train_stage2_from_config,
            "stage2",
            [*data, f"pseudo_labels={pseudo}", f"output_dir={run_dir}", "resume=true"],
        ),
        (
            "tools/split_pseudo_labels.py",
            split_from_config,
            "split",
            [f"checkpoint={hostile}", f"pseudo_labels={pseudo}", "k=1", f"output_dir={tmp / 'split'}", *data],
        ),
        (
            "tools/rpn_proposals.py",
            rpn_proposals_from_config,
            "rpn_proposals",
            [f"checkpoint={hostile}", f"output_dir={tmp / 'rpn'}", *data],
        ),
        (
            "tools/train_stage3.py initial_weights=",
            train_stage3_from_config,
            "stage3",
            [*stage3, f"initial_weights={hostile}", f"output_dir={tmp / 'stage3'}"],
        ),
        (
            "tools/train_stage3.py resume=true",
            train_stage3_from_config,
            "stage3",
            [*stage3, f"initial_weights={LEGACY}", f"output_dir={run_dir}", "resume=true"],
        ),
    ]


def test_every_command_that_reads_a_checkpoint_refuses_one_that_would_run_code(tiny_toy_root, tmp_path):
    target = tmp_path / "created_by_the_checkpoint"
    hostile = _hostile_checkpoint(tmp_path / "downloaded" / "model_final.pth", target)
    run_dir = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        for name, entry, config, overrides in _commands(tiny_toy_root, tmp_path, hostile):
            with pytest.raises(UntrustedCheckpointError) as refused:
                entry(_compose(config, overrides))
            message = str(refused.value)
            assert "\n" not in message, name
            assert (
                f"checkpoint {hostile if 'resume' not in name else run_dir / 'model_0000002.pth'} holds"
                in message
            )
            assert "posix.system" in message, (name, message)
            assert "trust_checkpoint=true" in message, name
            assert not target.exists(), f"{name} ran the checkpoint's command"
    finally:
        torch.set_num_threads(threads)


def test_the_tool_prints_one_line_and_runs_nothing(tiny_toy_root, tmp_path):
    """The same refusal through the command line, as a user meets it."""
    target = tmp_path / "created_by_the_checkpoint"
    hostile = _hostile_checkpoint(tmp_path / "model_final.pth", target)
    result = subprocess.run(
        [sys.executable, "tools/eval.py", f"checkpoint={hostile}", f"output_dir={tmp_path / 'eval'}",
         *_data(tiny_toy_root), "progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    errors = [line for line in (result.stdout + result.stderr).splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "refuses (loading it could run code)" in errors[0], result.stdout
    assert not target.exists()


def test_a_refused_checkpoint_is_not_skipped_for_an_older_one(tmp_path):
    """Resume skips a truncated file for the previous checkpoint, but never a refused one: the user
    must decide about it."""
    torch.save({"trainer": {"iteration": 2}}, tmp_path / "model_0000002.pth")
    _hostile_checkpoint(tmp_path / "model_0000004.pth", tmp_path / "created")
    with pytest.raises(UntrustedCheckpointError):
        latest_valid_checkpoint(tmp_path)
    assert not (tmp_path / "created").exists()


def test_trust_checkpoint_reads_an_older_file_and_says_so(tmp_path, caplog):
    """A checkpoint holding an object the weights-only loader does not build (a numpy scalar, as some
    older tools wrote) loads with ``trust``, with a warning."""
    path = tmp_path / "old.pth"
    torch.save({"model": {}, "metadata": {"value": np.float64(0.5)}}, path)
    with pytest.raises(UntrustedCheckpointError, match="numpy"):
        load_checkpoint(path)
    assert load_checkpoint(path, trust=True)["metadata"]["value"] == 0.5
    assert "trust_checkpoint=true: reading" in caplog.text


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"model": {}}', "not a file torch.save wrote: its pickle stops at byte code 123"),
        (b"", "empty, or cut short"),
        (b"PK\x03\x04" + b"\x00" * 40, "RuntimeError: PytorchStreamReader failed reading zip archive"),
    ],
    ids=["json", "empty", "truncated"],
)
def test_a_file_that_is_no_checkpoint_is_one_line_and_not_called_untrusted(tmp_path, content, why):
    path = tmp_path / "model_final.pth"
    path.write_bytes(content)
    with pytest.raises(RuntimeError) as unreadable:
        load_checkpoint(path)
    message = str(unreadable.value)
    assert message.startswith(f"checkpoint {path} cannot be read ({why}") and "\n" not in message


def test_a_folder_given_as_a_checkpoint_names_the_file_to_give(tmp_path):
    with pytest.raises(IsADirectoryError) as refused:
        load_checkpoint(tmp_path)
    assert str(refused.value) == (
        f"checkpoint {tmp_path} is a folder: give a .pth file in it, e.g. {tmp_path / 'model_final.pth'}"
    )
