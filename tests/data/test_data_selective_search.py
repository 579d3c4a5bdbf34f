"""Selective Search generation (parallel, resumable), the recall report and tools/make_proposals.py."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from wsod.data.proposals import load_proposals
from wsod.data.proposals.recall import format_recall_table, plot_recall, proposal_recall
from wsod.data.proposals.selective_search import generate_proposals, selective_search

REPO = Path(__file__).resolve().parents[2]


def _test_images(toy):
    images = toy.devkit / "VOC2007" / "JPEGImages"
    ids = (toy.devkit / "VOC2007" / "ImageSets" / "Main" / "test.txt").read_text().split()
    return [(i, str(images / f"{i}.jpg")) for i in ids]


def _same(a, b):
    assert a.image_ids == b.image_ids
    for image_id in a.image_ids:
        np.testing.assert_array_equal(a[image_id], b[image_id])


def test_worker_processes_give_the_same_file_as_one_process(tiny_toy, tmp_path):
    images = _test_images(tiny_toy)
    serial, stats = generate_proposals(
        images, tmp_path / "serial.pkl", workers=1, shard_size=2, progress=False
    )
    parallel, _ = generate_proposals(
        images, tmp_path / "parallel.pkl", workers=2, shard_size=2, progress=False
    )
    _same(serial, parallel)
    _same(serial, load_proposals(tmp_path / "parallel.pkl"))
    assert stats.images == 6 and stats.seconds_per_image > 0
    assert not (tmp_path / "serial.pkl.parts").exists()
    # Ranked like OpenCV returns them, filtered like the loader filters them, 0-based inclusive.
    image = cv2.imread(images[0][1])
    assert len(serial[images[0][0]]) <= len(selective_search(image))
    assert serial[images[0][0]][:, 2:].max() <= 159


def test_an_interrupted_run_resumes_from_its_shards(tiny_toy, tmp_path):
    images = _test_images(tiny_toy)
    output = tmp_path / "p.pkl"
    full, _ = generate_proposals(images, output, workers=1, shard_size=2, progress=False, keep_parts=True)
    parts = tmp_path / "p.pkl.parts"
    assert sorted(p.name for p in parts.glob("shard_*.pkl")) == [
        "shard_00000.pkl",
        "shard_00001.pkl",
        "shard_00002.pkl",
    ]
    # Interrupted: the output never written, one shard unfinished (and a stray temporary file).
    output.unlink()
    (parts / "shard_00001.pkl").unlink()
    (parts / ".shard_00001.pkl.abc.tmp").write_bytes(b"half")
    resumed, stats = generate_proposals(images, output, workers=1, shard_size=2, progress=False)
    assert stats.images == 2  # only the missing shard was computed
    _same(full, resumed)
    assert not parts.exists()


def test_parts_of_another_run_are_refused(tiny_toy, tmp_path):
    images = _test_images(tiny_toy)
    generate_proposals(
        images[:4], tmp_path / "p.pkl", workers=1, shard_size=2, progress=False, keep_parts=True
    )
    with pytest.raises(ValueError, match="partial results of a different run"):
        generate_proposals(images, tmp_path / "p.pkl", workers=1, shard_size=2, progress=False)


def test_unreadable_image_is_an_error_naming_it(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(RuntimeError, match=r"cannot decode image .*bad\.jpg"):
        generate_proposals(
            [("bad", str(tmp_path / "bad.jpg"))], tmp_path / "p.pkl", workers=1, progress=False
        )
    with pytest.raises(FileNotFoundError, match=r"gone\.jpg"):
        generate_proposals(
            [("gone", str(tmp_path / "gone.jpg"))], tmp_path / "q.pkl", workers=1, progress=False
        )


def test_recall_counts_the_first_n_proposals_and_skips_difficult():
    gt = [np.array([[0, 0, 9, 9], [20, 20, 29, 29], [50, 50, 59, 59]], np.float32), np.zeros((0, 4))]
    difficult = [np.array([False, False, True]), np.zeros(0, bool)]
    proposals = [
        np.array(
            [
                [0, 0, 9, 9],  # exact match of the first box
                [20, 20, 29, 33],  # IoU 100 / 140 = 0.714 with the second (inclusive widths)
                [20, 20, 29, 29],  # exact match of the second
                [50, 50, 59, 59],  # matches the difficult box only
            ],
            np.float32,
        ),
        np.array([[0, 0, 5, 5]], np.float32),
    ]
    report = proposal_recall(proposals, gt, difficult, counts=(1, 2, 3))
    assert report.counts == (1, 2, 3, 4) and report.num_gt == 2
    np.testing.assert_allclose(report.recall, [[0.5, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    strict = proposal_recall(proposals, gt, difficult, thresholds=(0.72,), counts=(1, 2, 3))
    np.testing.assert_allclose(strict.recall, [[0.5, 0.5, 1.0, 1.0]])
    assert report.at(0.7, 1) == 0.5 and report.at(0.5) == 1.0
    table = format_recall_table(report)
    assert "recall@0.5" in table and "all 4" in table


def test_recall_plot_is_a_png(tmp_path):
    report = proposal_recall([torch.tensor([[0.0, 0, 9, 9]])], [np.array([[0, 0, 9, 9]])])
    plot_recall(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _make_proposals_tool():
    spec = importlib.util.spec_from_file_location("make_proposals", REPO / "tools" / "make_proposals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_proposals_tool_generates_reports_and_converts(tiny_toy, tmp_path, capsys):
    tool = _make_proposals_tool()
    voc = ["voc", "--devkit", str(tiny_toy.devkit), "--year", "2007", "--image-set", "test"]
    voc += ["--classes", ",".join(tiny_toy.classes), "--no-progress"]
    assert tool.main([*voc, "--output", str(tmp_path / "ss.pkl"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "boxes per image" in out and "s per image per worker" in out and "recall@0.5" in out
    assert (tmp_path / "ss.recall.png").is_file()
    recall_row = next(line for line in out.splitlines() if line.strip().startswith("all"))
    assert float(recall_row.split()[2]) >= 0.9

    assert (
        tool.main([*voc, "--proposals", str(tmp_path / "ss.pkl"), "--recall-plot", str(tmp_path / "x.png")])
        == 0
    )
    assert (tmp_path / "x.png").is_file()
    assert tool.main(["convert", str(tmp_path / "ss.pkl"), str(tmp_path / "ss.mat")]) == 0
    _same(load_proposals(tmp_path / "ss.pkl"), load_proposals(tmp_path / "ss.mat"))
    with open(tmp_path / "ss.pkl", "rb") as f:
        # The reference keys, and the sizes of the images the proposals were made on (readers of the
        # reference format ignore the extra key).
        assert set(pickle.load(f)) == {"boxes", "scores", "indexes", "image_sizes"}


def test_generation_records_the_size_of_each_decoded_image(jpeg, tmp_path):
    images = [("a", tmp_path / "a.jpg"), ("b", tmp_path / "b.jpg")]
    jpeg(images[0][1], 40, 50, seed=0)
    jpeg(images[1][1], 30, 20, seed=1)
    for output in (tmp_path / "ss.pkl", tmp_path / "ss.proposals"):
        made, _ = generate_proposals(images, output, workers=1, progress=False)
        assert [made.image_size(i) for i, _ in images] == [(40, 50), (30, 20)]
        assert [load_proposals(output).image_size(i) for i, _ in images] == [(40, 50), (30, 20)]


def test_shards_of_an_older_version_without_sizes_still_merge(jpeg, tmp_path, caplog):
    images = [(f"i{n}", tmp_path / f"{n}.jpg") for n in range(3)]
    for n, (_, path) in enumerate(images):
        jpeg(path, 24 + n, 32, seed=n)
    output = tmp_path / "ss.pkl"
    full, _ = generate_proposals(images, output, workers=1, shard_size=2, progress=False, keep_parts=True)
    # The first shard as an older wsod wrote it (ids and boxes only), the output not yet merged.
    shard = tmp_path / "ss.pkl.parts" / "shard_00000.pkl"
    old = pickle.loads(shard.read_bytes())
    shard.write_bytes(pickle.dumps({"ids": old["ids"], "boxes": old["boxes"]}))
    output.unlink()
    with caplog.at_level("WARNING"):
        merged, stats = generate_proposals(images, output, workers=1, shard_size=2, progress=False)
    assert stats.images == 0  # nothing recomputed
    _same(full, merged)
    # Sizes are unknown for the older shard's images only; the others keep theirs.
    assert [merged.image_size(i) for i, _ in images] == [None, None, (26, 32)]
    assert "2 of 3 images" in caplog.text and "no recorded size" in caplog.text
