"""One run per folder: a folder is locked while a command writes it (a second train, stage-2, export, eval
or predict into it is refused at once, naming the holder's pid, and changes nothing there); the lock
goes with its process however it ends; a folder holding a started run is refused without
``resume=true`` from its first moment, not from its first checkpoint; a file given as the folder, or a
first-stage run resumed by the second stage's command, is one clear line."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_run import minimal_pseudo_labels, tiny_overrides

import wsod.runs.train as train_run
from wsod.config_checks import ConfigError
from wsod.directory_lock import LOCK_FILE, DirectoryBusyError, DirectoryLock
from wsod.runs.evaluate import evaluate_from_config
from wsod.runs.export import export_from_config
from wsod.runs.predict import predict_from_config
from wsod.runs.stage2 import train_stage2_from_config
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ROOT / "tests" / "engine" / "legacy" / "model_0000002_v0.pth"  # a first-stage checkpoint
# A process that takes the lock of the folder in argv[1], says so, and holds it until killed.
HOLDER = (
    "import sys, time; from wsod.directory_lock import DirectoryLock; DirectoryLock(sys.argv[1]).acquire();"
    " print('held', flush=True); time.sleep(600)"
)


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (the lock file's pid aside) by content."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


@pytest.fixture
def holder(tmp_path):
    """Start a process holding ``folder``'s lock; yields a function that starts it, kills it at the end."""
    started = []

    def start(folder: Path) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert process.stdout.readline().strip() == "held"
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_a_second_command_into_a_locked_folder_is_refused_and_changes_nothing(
    tiny_toy_root, tmp_path, holder
):
    run_dir = tmp_path / "twin"
    # The first run, started a moment before: its process holds the lock and has written its first files.
    first = holder(run_dir)
    (run_dir / "config.yaml").write_text("seed: 1\n")
    (run_dir / "log.txt").write_text("the first run's log\n")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1}\n')
    before = _snapshot(run_dir)
    data = [o for o in tiny_overrides(tiny_toy_root, Path("unused")) if o.startswith("data.")]
    pseudo = tmp_path / "pseudo_labels.json"
    minimal_pseudo_labels(pseudo)
    commands = {
        "train": (train_from_config, tiny_overrides(tiny_toy_root, run_dir, seed=2)),
        "train resume": (train_from_config, tiny_overrides(tiny_toy_root, run_dir, resume="true")),
        "stage2": (train_stage2_from_config, [*data, f"pseudo_labels={pseudo}", f"output_dir={run_dir}"]),
        "export": (export_from_config, [*data, f"checkpoint={LEGACY}", f"output_dir={run_dir}"]),
        "eval": (evaluate_from_config, [*data, f"checkpoint={LEGACY}", f"output_dir={run_dir}"]),
        "predict": (
            predict_from_config,
            [f"checkpoint={LEGACY}", f"input={tiny_toy_root}", f"output={run_dir}"],
        ),
    }
    threads = torch.get_num_threads()
    try:
        for name, (entry, overrides) in commands.items():
            config = {"train resume": "train", "predict": "predict"}.get(name, name)
            with pytest.raises(DirectoryBusyError) as refused:
                entry(_compose(config, [*overrides, "progress=false"]))
            option = "output" if name == "predict" else "output_dir"
            assert str(refused.value) == (
                f"{run_dir} is in use by another process (pid {first.pid}, see {run_dir / LOCK_FILE}): wait"
                f" for it to end, or give another {option}="
            ), name
            assert _snapshot(run_dir) == before, f"{name} changed the first run's files"
    finally:
        torch.set_num_threads(threads)


def test_the_lock_goes_with_its_process_even_on_kill_9(tmp_path, holder):
    folder = tmp_path / "run"
    process = holder(folder)
    with pytest.raises(DirectoryBusyError, match=f"pid {process.pid}"):
        DirectoryLock(folder).acquire()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10
    lock = DirectoryLock(folder)
    while True:  # the kernel releases it with the process's last descriptor
        try:
            lock.acquire()
            break
        except DirectoryBusyError:
            assert time.monotonic() < deadline, "the lock outlived its process"
            time.sleep(0.05)
    assert (folder / LOCK_FILE).read_text().strip() == str(os.getpid())
    lock.release()


def test_a_started_run_is_refused_from_step_0_and_resume_starts_it_over(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "started"
    run_dir.mkdir()
    # What a run killed before its first checkpoint leaves: its config, log and some metric rows.
    (run_dir / "config.yaml").write_text("seed: 1\n")
    (run_dir / "log.txt").write_text("started\n")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1, "loss_total": 9.0}\n')
    overrides = tiny_overrides(tiny_toy_root, run_dir, **{"solver.max_iter": 2, "solver.milestones": "[1]"})
    with pytest.raises(ConfigError) as refused:
        train_from_config(_compose("train", overrides))
    assert str(refused.value) == (
        f"{run_dir} already holds a run (config.yaml, log.txt, metrics.jsonl; no checkpoint yet):"
        " resume=true continues it (from step 0); another output_dir starts a new one"
    )
    threads = torch.get_num_threads()
    try:
        summary = train_from_config(_compose("train", [*overrides, "resume=true", "random_baseline=false"]))
    finally:
        torch.set_num_threads(threads)
    assert summary["iteration"] == 2
    rows = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert len(rows) == 2 and "9.0" not in rows[0]  # the earlier attempt's row is gone: each step once


def test_an_output_dir_that_is_a_file_is_one_line(tiny_toy_root, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("not a folder")
    with pytest.raises(ConfigError) as refused:
        train_from_config(_compose("train", tiny_overrides(tiny_toy_root, target)))
    assert (
        str(refused.value) == f"output_dir={target} is a file, not a folder: give a folder (new, or a run's)"
    )
    assert target.read_text() == "not a folder"


def test_a_first_stage_run_resumed_by_the_second_stage_command_says_which_run_it_is(tiny_toy_root, tmp_path):
    run_dir = tmp_path / "stage1"
    run_dir.mkdir()
    (run_dir / "model_0000002.pth").write_bytes(LEGACY.read_bytes())
    pseudo = tmp_path / "pseudo_labels.json"
    minimal_pseudo_labels(pseudo)
    data = [o for o in tiny_overrides(tiny_toy_root, Path("unused")) if o.startswith("data.")]
    cfg = _compose("stage2", [*data, f"pseudo_labels={pseudo}", f"output_dir={run_dir}", "resume=true"])
    with pytest.raises(ConfigError) as refused:
        train_stage2_from_config(cfg)
    assert str(refused.value) == (
        f"{run_dir / 'model_0000002.pth'} belongs to a first-stage run (tools/train.py), and this command"
        f" starts a second-stage run (tools/train_stage2.py): resume it with tools/train.py"
        f" output_dir={run_dir} resume=true, or give this command another output_dir"
    )


def test_an_attempt_that_failed_before_its_first_step_is_started_over(tiny_toy_root, tmp_path, monkeypatch):
    """A wrong data path fails after the folder is set up (config.yaml, log.txt, error.txt, no step):
    nothing there to lose, so the corrected command runs in it without resume=true, and says so."""
    run_dir = tmp_path / "failed"
    overrides = tiny_overrides(tiny_toy_root, run_dir, **{"solver.max_iter": 1, "solver.milestones": "[1]"})

    def missing_data(*args, **kwargs):
        raise FileNotFoundError("data/my_images: no such folder")

    monkeypatch.setattr(train_run, "prepare_data", missing_data)
    with pytest.raises(FileNotFoundError):
        train_from_config(_compose("train", overrides))
    assert (run_dir / "error.txt").is_file() and (run_dir / "config.yaml").is_file()
    monkeypatch.undo()
    threads = torch.get_num_threads()
    try:
        summary = train_from_config(_compose("train", [*overrides, "random_baseline=false"]))
    finally:
        torch.set_num_threads(threads)
    assert summary["iteration"] == 1 and not (run_dir / "error.txt").exists()
    log = (run_dir / "log.txt").read_text()
    assert "holds an attempt that failed before its first step (error.txt): starting over" in log


def test_a_wrong_pseudo_label_file_is_refused_before_the_run_folder_exists(tiny_toy_root, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('{"images": [], "annotations": [], "categories": []}')
    data = [o for o in tiny_overrides(tiny_toy_root, Path("unused")) if o.startswith("data.")]
    run_dir = tmp_path / "stage2"
    with pytest.raises(ValueError, match=f"pseudo boxes file {empty}: 'images' is empty"):
        train_stage2_from_config(
            _compose("stage2", [*data, f"pseudo_labels={empty}", f"output_dir={run_dir}"])
        )
    assert not run_dir.exists()


def test_a_finished_holder_removes_its_lock_file_and_a_racing_opener_retries(tmp_path):
    folder = tmp_path / "run"
    lock = DirectoryLock(folder)
    lock.acquire()
    opened_before_the_removal = os.open(lock.path, os.O_RDWR)  # another process, between open and flock
    lock.release()
    assert not (folder / LOCK_FILE).exists()  # a finished folder holds only its results
    try:
        # That process would now lock the removed file: acquire sees the inode is gone and starts over.
        assert not lock._still_there(opened_before_the_removal)
    finally:
        os.close(opened_before_the_removal)
    with DirectoryLock(folder) as again:
        assert again.held and again._still_there(again._fd)


def test_an_output_dir_that_cannot_be_made_is_one_line(tiny_toy_root, tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("a file where a parent folder should be")
    run_dir = blocked / "run"
    with pytest.raises(ConfigError) as refused:
        train_from_config(_compose("train", tiny_overrides(tiny_toy_root, run_dir)))
    assert str(refused.value).startswith(f"output_dir={run_dir}: cannot write there (")
    assert str(refused.value).endswith("); give another folder") and "\n" not in str(refused.value)
