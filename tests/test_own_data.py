"""The "Your own data" guide's commands (docs/guides/own_data.md, linked from the README), run word for
word on a folder of generated images: labels.csv -> proposals -> training -> evaluation (classification
mAP) -> predictions and drawn PNGs.

The rule: the commands are parsed from the guide's first ``bash`` block, so the test and the guide
cannot drift apart. Each line runs as written, from a temporary working directory where the
test made ``data/my_images`` (``python`` becomes this interpreter and ``tools/x.py`` this checkout's
file; every other word is the guide's). The only words the test adds come after the guide's own and
are listed in ``APPENDED``: a 4-step schedule for training (the guide's command trains the full default
schedule, minutes on a CPU), with an evaluation at step 2 so that periodic evaluation is covered too.
Hydra applies overrides left to right, so everything the guide says still holds. The predict command
runs once exactly as written (threshold 0.3: a 4-step model rarely scores that high, so its JSON may be
empty) and once more with ``score_threshold=0.0`` so that the entries' fields are checked on real ones.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from folder_data import write_image_folder
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from wsod.build import build_model
from wsod.data.proposals import ProposalSet
from wsod.data.proposals.store import write_proposal_store
from wsod.data.toy import TOY_CLASSES
from wsod.engine.checkpoint import save_checkpoint
from wsod.engine.evaluate import NO_BOXES

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "own_data.md"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("HYDRA_FULL_ERROR", None)
APPENDED = {
    "tools/train.py": [
        "solver.max_iter=4",
        "solver.milestones=[3]",
        "solver.warmup_iters=2",
        "eval_period=2",
    ],
}
FIELDS = {"image_id", "file_name", "category_id", "category_name", "bbox", "score"}


def readme_commands() -> list[str]:
    """The lines of the first ``bash`` block of the "Your own data" guide."""
    block = re.search(r"```bash\n(.*?)```", GUIDE.read_text(), re.S)
    assert block, "the own-data guide has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def _run(line: str, cwd: Path, extra: list[str] = ()) -> str:
    words = shlex.split(line, comments=True)
    assert words[0] == "python" and words[1].startswith("tools/"), line
    command = [sys.executable, str(ROOT / words[1]), *words[2:], *APPENDED.get(words[1], []), *extra]
    result = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def test_the_readme_own_data_commands_run_word_for_word(tmp_path):
    truth = write_image_folder(tmp_path / "data" / "my_images")
    commands = readme_commands()
    tools = [shlex.split(line)[1] for line in commands]
    assert tools == ["tools/make_proposals.py", "tools/train.py", "tools/eval.py", "tools/predict.py"]
    make, train, evaluate, predict = commands

    output = _run(make, tmp_path)
    assert "12 images -> data/my_images/proposals/selective_search.proposals" in output
    _run(train, tmp_path)
    run_dir = tmp_path / "runs" / "my_run"
    assert (run_dir / "model_final.pth").is_file() and (run_dir / "model_best.pth").is_file()
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    images = events.Tags()["images"]
    assert len(images) == 4 and all(tag.startswith("eval/detections/") for tag in images)
    assert [e.step for e in events.Images(images[0])] == [2, 4]  # the periodic and the final evaluation
    scalars = set(events.Tags()["scalars"])
    assert {"eval/cls_mAP", "eval/random_cls_mAP"} <= scalars
    assert any(tag.startswith("eval/cls_AP_") for tag in scalars)

    output = _run(evaluate, tmp_path)
    assert NO_BOXES in output and "copypaste: cls_mAP(area)=" in output
    metrics = json.loads((tmp_path / "runs" / "my_eval" / "metrics.json").read_text())
    assert 0.0 <= metrics["cls_mAP"] <= 1.0 and "random_cls_mAP" in metrics
    assert (tmp_path / "runs" / "my_eval" / "predictions.json").is_file()

    _run(predict, tmp_path)
    out = tmp_path / "runs" / "my_predictions"
    predictions = json.loads((out / "predictions.json").read_text())
    assert isinstance(predictions, list) and all(p["score"] >= 0.3 for p in predictions)
    for name in truth:  # one PNG per image, that opens as an image of the input's size
        with Image.open(out / name.replace(".jpg", ".png")) as png:
            png.load()
            assert png.size == (160, 160) and png.format == "PNG"

    _run(predict, tmp_path, ["score_threshold=0.0", "output=runs/all_predictions"])
    classes = sorted({TOY_CLASSES[c] for _, labels in truth.values() for c in labels.tolist()})
    predictions = json.loads((tmp_path / "runs" / "all_predictions" / "predictions.json").read_text())
    assert predictions and all(set(p) == FIELDS for p in predictions)
    assert {p["file_name"] for p in predictions} == set(truth)
    for p in predictions:
        x, y, w, h = p["bbox"]
        assert isinstance(p["image_id"], int) and 0 <= x <= x + w <= 160 and 0 <= y <= y + h <= 160
        assert p["category_name"] == classes[p["category_id"] - 1] and 0 <= p["score"] <= 1


def test_a_checkpoint_of_a_different_number_of_classes_is_refused_naming_both(tmp_path):
    root = tmp_path / "data" / "pets"
    write_image_folder(root, num_train=2, num_test=2)
    names = [line.split(",")[0] for line in (root / "labels.csv").read_text().splitlines()[1:]]
    lines = [f"{n},{'cat' if i % 2 else 'dog'},{'train' if i < 2 else 'test'}\n" for i, n in enumerate(names)]
    (root / "labels.csv").write_text("image,labels,split\n" + "".join(lines))
    boxes = [np.array([[0, 0, 50, 50]], np.float32)] * len(names)
    write_proposal_store(ProposalSet(names, boxes), root / "proposals" / "selective_search.proposals")
    settings = {"backbone": "resnet18", "width": 0.25, "weights": None, "chunk_size": 8}
    metadata = {"model": settings, "method": {"name": "mist"}, "classes": list(TOY_CLASSES)}
    save_checkpoint(
        {"model": build_model(settings, 5).state_dict(), "metadata": metadata}, tmp_path / "toy.pth"
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "eval.py"), f"checkpoint={tmp_path / 'toy.pth'}", "data=folder",
         f"data.root={root}", f"output_dir={tmp_path / 'eval'}"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "trained on classes ['red_circle', 'green_square', 'blue_triangle', 'yellow_cross', " in output
    assert "(5), the test set has ['cat', 'dog'] (2): evaluate a checkpoint trained on this data" in output
    assert "Traceback" not in output and (tmp_path / "eval" / "error.txt").is_file()


@pytest.mark.parametrize("missing", ["proposals", "root"])
def test_training_on_a_folder_without_proposals_or_root_says_what_to_run(tmp_path, missing):
    root = tmp_path / "data" / "my_images"
    write_image_folder(root, num_train=2, num_test=1)
    args = ["data=folder", f"output_dir={tmp_path / 'run'}"] + (
        [f"data.root={root}"] if missing != "root" else []
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train.py"), *args],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    if missing == "root":
        assert "data.root='???': expected a path, e.g. data.root=data/my_images" in result.stderr
    else:
        assert f"make them with python tools/make_proposals.py folder --root {root}" in result.stdout
    torch.set_num_threads(torch.get_num_threads())  # nothing ran in this process
