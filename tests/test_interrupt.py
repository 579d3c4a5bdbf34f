"""Ctrl-C and SIGTERM stop a training run cleanly: the step in progress ends, a checkpoint of the step
reached is saved whatever ``checkpoint_period`` says, one line goes to the terminal and to log.txt, the
tool exits with 130, and ``resume=true`` continues to the same weights as an unbroken run. A second
signal stops at once, still in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_run import tiny_overrides

import wsod.engine.train as train_module
from wsod.cli import EXIT_INTERRUPTED, close_run_log, run_tool
from wsod.engine.interrupt import StopRequests, TrainingInterrupted
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]


def _config(root: Path, run_dir: Path, **extra):
    settings = {"checkpoint_period": 1000, "random_baseline": "false", "threads": 1, **extra}
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=tiny_overrides(root, run_dir, **settings))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def test_ctrl_c_saves_the_step_reached_and_resume_equals_an_unbroken_run(
    tiny_toy_root, tmp_path, monkeypatch
):
    threads = torch.get_num_threads()
    try:
        train_from_config(_config(tiny_toy_root, tmp_path / "straight"))

        logged = train_module._log_step

        def log_then_press_ctrl_c(run_log, bar, iteration, *rest):
            logged(run_log, bar, iteration, *rest)
            if iteration == 3:  # Ctrl-C in the middle of the run, off the checkpoint period
                os.kill(os.getpid(), signal.SIGINT)

        monkeypatch.setattr(train_module, "_log_step", log_then_press_ctrl_c)
        before = signal.getsignal(signal.SIGINT)
        cut = tmp_path / "cut"
        with pytest.raises(TrainingInterrupted) as stopped:
            train_from_config(_config(tiny_toy_root, cut))
        assert str(stopped.value) == (
            f"interrupted by SIGINT after iteration 3/4: saved {cut / 'model_0000003.pth'}; resume=true"
            " continues the run from it"
        )
        assert [p.name for p in sorted(cut.glob("model_*.pth"))] == ["model_0000003.pth"]
        assert signal.getsignal(signal.SIGINT) is before  # the loop's handler is gone with it
        monkeypatch.undo()

        train_from_config(_config(tiny_toy_root, cut, resume="true"))
    finally:
        torch.set_num_threads(threads)
    straight, resumed = _weights(tmp_path / "straight" / "model_final.pth"), _weights(cut / "model_final.pth")
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
    rows = [line for line in (cut / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in line]
    assert len(rows) == 4  # each iteration once


def test_sigterm_through_the_tool_is_one_line_a_checkpoint_and_exit_130(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        tiny_toy_root, run_dir, **{"solver.max_iter": 1000, "checkpoint_period": 1000, "threads": 1}
    )
    process = subprocess.Popen(
        [sys.executable, "tools/train.py", *overrides], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "iter 2/1000" in line:
                process.send_signal(signal.SIGTERM)
                break
        rest, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    output = "".join(lines) + rest
    assert process.returncode == EXIT_INTERRUPTED, output[-3000:]
    assert "Traceback" not in output
    stops = [line for line in output.splitlines() if "interrupted by SIGTERM" in line]
    assert len(stops) == 1, output[-3000:]
    saved = sorted(run_dir.glob("model_*.pth"))
    assert len(saved) == 1 and f"saved {saved[0]}; resume=true continues the run from it" in stops[0]
    assert stops[0].split(" WARNING wsod: ")[1] in (run_dir / "log.txt").read_text()
    assert not (run_dir / "error.txt").exists()  # a stop on request is no failure


def test_a_second_signal_stops_at_once():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode boundary
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_interrupt_anywhere_in_a_tool_is_one_line_and_exit_130(capsys):
    def interrupted(cfg):
        raise KeyboardInterrupt  # Ctrl-C outside the loop (data preparation, the final evaluation)

    close_run_log()  # no run directory: the line goes to the terminal alone

    with pytest.raises(SystemExit) as stopped:
        run_tool(interrupted, None)
    assert stopped.value.code == EXIT_INTERRUPTED
    printed = capsys.readouterr().err.strip().splitlines()
    assert printed == [
        "interrupted: stopped at once; anything since the newest checkpoint is not saved (resume=true"
        " continues a training run from it)"
    ]
