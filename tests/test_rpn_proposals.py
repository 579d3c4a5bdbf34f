"""Proposals learned by the second stage (tools/rpn_proposals.py) on the tiny toy set, from the guide
pipeline's second-stage checkpoint: inside their images, best first, the same for the same checkpoint,
and read by a first-stage training run in place of Selective Search's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from guide_pipeline import ROOT, compose_config, guide_block, run_commands, short_overrides
from tiny_run import TINY_TOY, tiny_overrides

from wsod.config_checks import ConfigError
from wsod.data.proposals import load_proposals
from wsod.data.toy import ensure_toy_dataset
from wsod.runs.rpn_proposals import rpn_proposals_from_config
from wsod.runs.train import train_from_config


@pytest.fixture(scope="module")
def rpn_run(guide_pipeline, tiny_toy_root, tmp_path_factory):
    workdir, _ = guide_pipeline
    out = tmp_path_factory.mktemp("rpn")
    checkpoint = workdir / "runs" / "toy_stage2" / "model_final.pth"
    overrides = [f"checkpoint={checkpoint}", *short_overrides(tiny_toy_root, "rpn"), "post_nms_top_n=40"]
    summary = rpn_proposals_from_config(
        compose_config("rpn_proposals", [*overrides, f"output_dir={out / 'a'}"])
    )
    return out, overrides, summary


def test_region_proposals_lie_inside_their_images_best_first_with_their_scores(rpn_run, tiny_toy_root):
    out, _, summary = rpn_run
    assert set(summary["sets"]) == {"train_0", "test"}
    toy = ensure_toy_dataset(tiny_toy_root, **TINY_TOY)
    for name, image_set in (("train_0", "trainval"), ("test", "test")):
        proposals = load_proposals(out / "a" / f"{name}.proposals")
        records = toy.dataset(image_set).records
        assert sorted(map(str, proposals.image_ids)) == sorted(str(r.image_id) for r in records)
        for record in records:
            boxes, scores = proposals[record.image_id], proposals.scores(record.image_id)
            assert 0 < len(boxes) <= 40 and len(scores) == len(boxes)
            assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= record.width - 1).all()
            assert (boxes[:, 3] <= record.height - 1).all() and (boxes[:, 2:] >= boxes[:, :2]).all()
            assert (np.diff(scores) <= 0).all() and ((scores >= 0) & (scores <= 1)).all()  # probabilities
            assert proposals.image_size(record.image_id) == (record.height, record.width)
        assert 0 <= summary["sets"][name]["recall"]["0.5"] <= 1
    written = json.loads((out / "a" / "summary.json").read_text())
    assert written["sets"]["test"]["images"] == len(toy.dataset("test").records)


def test_region_proposals_are_a_function_of_the_checkpoint(rpn_run):
    out, overrides, _ = rpn_run
    rpn_proposals_from_config(compose_config("rpn_proposals", [*overrides, f"output_dir={out / 'b'}"]))
    for name in ("train_0", "test"):
        first, again = (
            load_proposals(out / "a" / f"{name}.proposals"),
            load_proposals(out / "b" / f"{name}.proposals"),
        )
        for image_id in first.image_ids:
            np.testing.assert_array_equal(first[image_id], again[image_id])
            np.testing.assert_array_equal(first.scores(image_id), again.scores(image_id))
    with pytest.raises(
        ConfigError, match=r"holds test.proposals, train_0.proposals: overwrite=true replaces them"
    ):
        rpn_proposals_from_config(compose_config("rpn_proposals", [*overrides, f"output_dir={out / 'b'}"]))


def test_a_first_stage_run_trains_and_evaluates_on_the_region_proposals(rpn_run, tiny_toy_root, tmp_path):
    out, _, _ = rpn_run
    stores = [
        f"data.train.sets.0.proposals={out / 'a' / 'train_0.proposals'}",
        f"data.test.set.proposals={out / 'a' / 'test.proposals'}",
        "data.train.max_proposals=30",
    ]
    threads = torch.get_num_threads()
    try:
        summary = train_from_config(
            compose_config("train", [*tiny_overrides(tiny_toy_root, tmp_path / "run"), *stores])
        )
    finally:
        torch.set_num_threads(threads)
    assert summary["iteration"] == 4 and "mAP" in summary["final"]
    assert "test.proposals" in (tmp_path / "run" / "log.txt").read_text()


def test_a_first_stage_checkpoint_has_no_region_proposals_to_give(guide_pipeline, tiny_toy_root, tmp_path):
    workdir, _ = guide_pipeline
    overrides = [
        f"checkpoint={workdir / 'runs' / 'toy_stage1' / 'model_final.pth'}",
        f"output_dir={tmp_path}",
    ]
    with pytest.raises(ConfigError, match="a first-stage checkpoint has no region proposal network"):
        rpn_proposals_from_config(
            compose_config("rpn_proposals", [*overrides, *short_overrides(tiny_toy_root, "rpn")])
        )


def test_the_readmes_iterated_pipeline_runs_word_for_word_with_a_short_schedule(
    guide_pipeline, tiny_toy_root
):
    """The README's block: its first three steps are the guide's (run by the guide pipeline), then the
    region proposals and the first stage again on them."""
    readme = ROOT / "README.md"
    block = next(
        guide_block(i, readme)
        for i in range(3)
        if any("rpn_proposals.py" in c for c in guide_block(i, readme))
    )
    assert block[:3] == guide_block(0)[:3]
    workdir, _ = guide_pipeline
    proposals, retrained = run_commands(block[3:], tiny_toy_root, workdir)
    stores = workdir / "runs" / "toy_stage2" / "rpn_proposals"
    assert {p.name for p in stores.glob("*.proposals")} == {"train_0.proposals", "test.proposals"}
    assert all(0 < s["boxes_per_image"] <= 100 for s in proposals["sets"].values())
    assert retrained["iteration"] == 4 and "mAP" in retrained["final"]
    log = (workdir / "runs" / "toy_stage1_rpn" / "log.txt").read_text()
    assert "rpn_proposals/train_0.proposals" in log and "rpn_proposals/test.proposals" in log
