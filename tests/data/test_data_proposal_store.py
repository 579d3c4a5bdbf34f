"""The memory-mapped proposal store: round trips, errors naming the file, the dataset, pickling, the tools."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from wsod.benchmarks.proposals import (
    format_table,
    in_fresh_process,
    make_synthetic_proposals,
    measure_access,
    run_benchmark,
    write_markdown,
)
from wsod.data.proposals import (
    MissingProposalsError,
    ProposalSet,
    ProposalStore,
    ProposalStoreError,
    convert_proposals,
    load_proposals,
    save_proposals,
    write_proposal_store,
)
from wsod.data.proposals import store as proposal_store
from wsod.data.proposals.selective_search import generate_proposals
from wsod.data.voc import VOCDataset

REPO = Path(__file__).resolve().parents[2]


def _random_set(num_images: int = 30, seed: int = 0, ids=None) -> ProposalSet:
    """Non-integer boxes (bit-exactness is tested on values float16 would round), some images empty."""
    rng = np.random.default_rng(seed)
    ids = list(range(100, 100 + num_images)) if ids is None else ids
    boxes = [(rng.random((int(rng.integers(0, 6)), 4)) * 500).astype(np.float32) for _ in ids]
    return ProposalSet(ids, boxes, source="random")


def _assert_same(store: ProposalSet, expected: ProposalSet) -> None:
    assert store.image_ids == expected.image_ids
    assert [type(i) for i in store.image_ids] == [type(i) for i in expected.image_ids]
    for image_id in expected.image_ids:
        got = store[image_id]
        assert got.dtype == np.float32 and got.shape == expected[image_id].shape
        assert got.tobytes() == expected[image_id].tobytes()  # bit-exact


def test_pickle_to_store_round_trip_is_bit_exact_and_keeps_ids_and_order(tmp_path):
    # VOC string ids (in a non-sorted order), an image without boxes; the reference-format pickle.
    ids = ["2008_000008", "000005", "000007", "img_b", "img_a"]
    original = _random_set(ids=ids)
    save_proposals(original, tmp_path / "p.pkl")
    convert_proposals(tmp_path / "p.pkl", tmp_path / "p.proposals")
    store = load_proposals(tmp_path / "p.proposals")
    assert isinstance(store, ProposalStore) and isinstance(store, ProposalSet)
    assert store.manifest["id_type"] == "str" and store.num_boxes == original.num_boxes
    _assert_same(store, original)
    # proposal_key normalisation as for a pickle: reference pickles store 000005 as 5.
    np.testing.assert_array_equal(store[5], original["000005"])
    assert "000005" in store and "000006" not in store
    with pytest.raises(ValueError, match="read-only"):
        store["000005"][0, 0] = 1
    with pytest.raises(MissingProposalsError, match=r"'000009' is not in the proposal file .*p\.proposals"):
        store["000009"]
    with pytest.raises(MissingProposalsError, match=r"1 of 2 images have no proposals in .*p\.proposals"):
        store.require(["000005", "000009"])
    # And back to a pickle.
    convert_proposals(tmp_path / "p.proposals", tmp_path / "back.pkl")
    _assert_same(load_proposals(tmp_path / "back.pkl"), original)


def test_integer_and_mixed_ids_keep_their_types(tmp_path):
    coco = _random_set(ids=[139, 285, np.int64(632)])
    save_proposals(coco, tmp_path / "coco.proposals")
    store = load_proposals(tmp_path / "coco.proposals")
    assert store.manifest["id_type"] == "int" and store.image_ids == [139, 285, 632]
    assert all(type(i) is int for i in store.image_ids)
    np.testing.assert_array_equal(store["285"], coco[285])
    np.testing.assert_array_equal(store[np.int64(632)], coco[632])

    mixed = _random_set(ids=["a", 7, "2008_000008", 2**70])
    save_proposals(mixed, tmp_path / "mixed.proposals")
    store = load_proposals(tmp_path / "mixed.proposals")
    assert store.manifest["id_type"] == "mixed" and store.image_ids == ["a", 7, "2008_000008", 2**70]
    _assert_same(store, mixed)
    with pytest.raises(TypeError, match=r"image id \(1, 2\) is a tuple"):
        save_proposals(ProposalSet([(1, 2)], [np.ones((1, 4))]), tmp_path / "t.proposals")


def test_scores_are_kept_unless_all_zero(tmp_path):
    boxes = [np.ones((2, 4)), np.ones((1, 4))]
    scored = ProposalSet(["a", "b"], boxes, [np.array([0.5, 0.25]), np.array([1.0])])
    save_proposals(scored, tmp_path / "s.proposals")
    np.testing.assert_array_equal(load_proposals(tmp_path / "s.proposals").scores("a"), [0.5, 0.25])
    save_proposals(ProposalSet(["a", "b"], boxes, [np.zeros(2), np.zeros(1)]), tmp_path / "z.proposals")
    zero = load_proposals(tmp_path / "z.proposals")
    assert zero.scores("a") is None and not (tmp_path / "z.proposals" / "scores.npy").exists()


def test_float16_store_round_trip_within_float16_precision(tmp_path):
    original = _random_set(num_images=40)
    save_proposals(original, tmp_path / "p.pkl")
    convert_proposals(tmp_path / "p.pkl", tmp_path / "h.proposals", dtype="float16")
    half = load_proposals(tmp_path / "h.proposals")
    assert half.manifest["dtype"] == "float16"
    for image_id in original.image_ids:
        got = half[image_id]
        assert got.dtype == np.float32 and not got.flags.writeable
        # float16 keeps 11 significant bits: relative error at most 2**-11.
        np.testing.assert_allclose(got, original[image_id], rtol=2.0**-11, atol=0)
    assert any(not np.array_equal(half[i], original[i]) for i in original.image_ids)  # really float16
    size = (tmp_path / "h.proposals" / "boxes.npy").stat().st_size
    assert size < 0.6 * original.num_boxes * 16
    # Integer coordinates (Selective Search) up to 2048 are exact; beyond float16's range is an error.
    exact = ProposalSet(["a"], [np.array([[0, 1, 2047, 2048]], np.float32)])
    save_proposals(exact, tmp_path / "e.proposals", dtype="float16")
    np.testing.assert_array_equal(load_proposals(tmp_path / "e.proposals")["a"], [[0, 1, 2047, 2048]])
    with pytest.raises(ValueError, match="beyond the range of float16"):
        too_big = ProposalSet(["a"], [np.array([[0, 0, 1e6, 1]])])
        save_proposals(too_big, tmp_path / "big.proposals", dtype="float16")
    assert not (tmp_path / "big.proposals").exists()


def test_mat_to_store(tmp_path):
    original = _random_set(ids=["000005", "000007", "000009"])
    save_proposals(original, tmp_path / "p.mat")
    from_mat = load_proposals(tmp_path / "p.mat")
    convert_proposals(tmp_path / "p.mat", tmp_path / "p.proposals")
    _assert_same(load_proposals(tmp_path / "p.proposals"), from_mat)


def test_truncated_mismatched_and_missing_files_are_errors_naming_the_file(tmp_path):
    save_proposals(_random_set(), tmp_path / "p.proposals")
    store = tmp_path / "p.proposals"
    boxes = store / "boxes.npy"

    data = boxes.read_bytes()
    boxes.write_bytes(data[:-16])
    with pytest.raises(ProposalStoreError, match=rf"{boxes}: truncated: {len(data) - 16} bytes on disk"):
        load_proposals(store)
    boxes.write_bytes(data)
    load_proposals(store)  # intact again

    manifest_path = store / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "num_boxes": manifest["num_boxes"] + 1}))
    with pytest.raises(ProposalStoreError, match=rf"{boxes}: holds a float32 array .*{manifest_path}"):
        load_proposals(store)
    manifest_path.write_text(json.dumps({**manifest, "num_images": manifest["num_images"] - 1}))
    with pytest.raises(ProposalStoreError, match=rf"{store / 'offsets.npy'}: holds"):
        load_proposals(store)
    manifest_path.write_text(json.dumps({**manifest, "dtype": "float16"}))
    with pytest.raises(ProposalStoreError, match=rf"{boxes}: .*{manifest_path} says float16"):
        load_proposals(store)
    manifest_path.write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(ProposalStoreError, match=rf"{manifest_path}: store format version 99"):
        load_proposals(store)
    manifest_path.write_text(json.dumps(manifest))

    (store / "offsets.npy").unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing {store / 'offsets.npy'}"):
        load_proposals(store)
    manifest_path.unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing {manifest_path}"):
        load_proposals(store)
    with pytest.raises(FileNotFoundError, match=r"proposal store not found: .*nope\.proposals"):
        load_proposals(tmp_path / "nope.proposals")


def test_writing_is_atomic_and_replaces_only_stores(tmp_path, monkeypatch):
    first, second = _random_set(seed=1), _random_set(seed=2)
    path = tmp_path / "p.proposals"
    save_proposals(first, path)
    real_write = proposal_store._write_npy

    def killed(file, *args):
        if file.name == "ids.npy":
            raise KeyboardInterrupt  # e.g. Ctrl-C halfway through a conversion
        return real_write(file, *args)

    monkeypatch.setattr(proposal_store, "_write_npy", killed)
    with pytest.raises(KeyboardInterrupt):
        save_proposals(second, path)
    with pytest.raises(KeyboardInterrupt):
        save_proposals(second, tmp_path / "new.proposals")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.proposals"]  # no temporary directory left
    _assert_same(load_proposals(path), first)  # the old store is untouched

    save_proposals(second, path)  # an existing store is replaced
    _assert_same(load_proposals(path), second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.proposals"]
    (tmp_path / "data.proposals").mkdir()
    (tmp_path / "data.proposals" / "mine.txt").write_text("not a store")
    with pytest.raises(FileExistsError, match="is not a proposal store; not replacing it"):
        save_proposals(second, tmp_path / "data.proposals")
    assert (tmp_path / "data.proposals" / "mine.txt").read_text() == "not a store"


def test_pickling_the_store_pickles_its_path(tmp_path):
    original = ProposalSet(
        [f"{i:06d}" for i in range(200)], [np.full((50, 4), i, np.float32) for i in range(200)]
    )
    save_proposals(original, tmp_path / "p.proposals")
    store = load_proposals(tmp_path / "p.proposals")
    data = pickle.dumps(store)
    assert len(data) < 1000 < original.num_boxes * 16  # 160 kB of boxes
    _assert_same(pickle.loads(data), original)
    # A store rewritten after pickling is refused instead of silently giving other boxes.
    save_proposals(original, tmp_path / "p.proposals")
    with pytest.raises(ProposalStoreError, match="rewritten since this process's copy was pickled"):
        pickle.loads(data)


def test_voc_dataset_with_a_store_gives_the_items_of_the_pickle(make_voc, write_pickle, tmp_path):
    images = {
        "000005": (40, 60, [("cat", ("1", "2", "30", "35"), 0)]),
        "2008_000008": (50, 30, [("dog", ("3", "3", "20", "40"), 0)]),
    }
    devkit = make_voc(images, {"trainval": list(images)})
    # A reference pickle with integer ids (as the VOC releases have), one image left with nothing after
    # filtering (the whole-image fallback).
    pkl = write_pickle(
        {5: [[0, 0, 19, 19], [5, 5, 40, 30], [5, 5, 5.5, 9]], 2008000008: [[100, 100, 120, 130]]}
    )
    convert_proposals(pkl, tmp_path / "voc.proposals")
    from_pickle = VOCDataset(devkit, "2007", "trainval", pkl, classes=("cat", "dog"))
    from_store = VOCDataset(devkit, "2007", "trainval", tmp_path / "voc.proposals", classes=("cat", "dog"))
    assert isinstance(from_store.proposals, ProposalStore)
    assert len(from_store) == len(from_pickle) == 2
    for i in range(2):
        a, b = from_pickle[i], from_store[i]
        assert a.keys() == b.keys() and a["image_id"] == b["image_id"]
        for key in a:
            if isinstance(a[key], torch.Tensor):
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert from_store[0]["proposals"].shape == (2, 4)
    assert from_store[1]["proposals"].tolist() == [[0, 0, 29, 49]]  # the whole-image fallback
    # A store without an image of the set is refused at construction, like a pickle.
    save_proposals(ProposalSet(["000005"], [np.ones((1, 4))]), tmp_path / "part.proposals")
    with pytest.raises(MissingProposalsError, match=r"1 of 2 images have no proposals in .*part\.proposals"):
        VOCDataset(devkit, "2007", "trainval", tmp_path / "part.proposals", classes=("cat", "dog"))


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_proposals_tool_converts_a_pickle_to_a_store(tmp_path, capsys):
    original = _random_set()
    save_proposals(original, tmp_path / "p.pkl")
    tool = _tool("make_proposals")
    assert tool.main(["convert", str(tmp_path / "p.pkl"), str(tmp_path / "p.proposals")]) == 0
    assert "p.proposals" in capsys.readouterr().out
    _assert_same(load_proposals(tmp_path / "p.proposals"), original)
    half = ["convert", str(tmp_path / "p.pkl"), str(tmp_path / "h.proposals"), "--dtype", "float16"]
    assert tool.main(half) == 0
    assert load_proposals(tmp_path / "h.proposals").manifest["dtype"] == "float16"


def test_selective_search_writes_a_store(jpeg, tmp_path):
    images = [("000001", tmp_path / "a.jpg"), ("000002", tmp_path / "b.jpg")]
    jpeg(images[0][1], 40, 50, seed=0)
    jpeg(images[1][1], 30, 40, seed=1)
    in_memory, _ = generate_proposals(images, tmp_path / "ss.proposals", workers=1, progress=False)
    store = load_proposals(tmp_path / "ss.proposals")
    assert isinstance(store, ProposalStore) and store.num_boxes > 0
    _assert_same(store, in_memory)
    assert not (tmp_path / "ss.proposals.parts").exists()


def test_write_refuses_other_names_and_dtypes(tmp_path):
    with pytest.raises(ValueError, match=r"must end with \.proposals"):
        write_proposal_store(_random_set(), tmp_path / "p.store")
    with pytest.raises(ValueError, match="store dtype must be one of"):
        write_proposal_store(_random_set(), tmp_path / "p.proposals", dtype="float64")


def test_benchmark_runs_at_a_tiny_size(tmp_path):
    result = run_benchmark(
        50,
        20,
        reads=30,
        lookups=200,
        workers=2,
        contexts=("fork",),
        loader_sources=("none", "store"),
        directory=tmp_path,
        fresh_processes=False,
        index_ids=100,
        log=lambda _: None,
    )
    assert list(tmp_path.iterdir()) == []  # the synthetic files are deleted
    assert set(result.access) == {"pickle", "store"} and result.store_bytes > 50 * 20 * 16
    assert all(a.reads == 30 and a.reads_per_second > 0 for a in result.access.values())
    store_run = next(r for r in result.loader if r.source == "store")
    assert store_run.items == 30 and len(store_run.worker_memory) == 2 and store_run.total("rss") > 0
    assert set(result.index_mb) == {"int", "str"} and all(0 < mb < 1 for mb in result.index_mb.values())
    table = format_table(result)
    assert "lookups per second" in table and "store" in table
    write_markdown(result, tmp_path / "r.md", command="python x", machine="test machine", date="today")
    text = (tmp_path / "r.md").read_text()
    assert "test machine, today" in text and "PSS" in text and "| fork | store |" in text


def test_benchmark_tool_writes_its_report(tmp_path, capsys):
    report = tmp_path / "out" / "r.md"
    argv = ["--images", "20", "--boxes", "5", "--reads", "10", "--lookups", "50", "--workers", "0"]
    argv += ["--contexts", "fork", "--loader-sources", "store", "--in-process", "--report", str(report)]
    argv += ["--dir", str(tmp_path), "--index-ids", "0"]
    assert _tool("benchmark_proposals").main(argv) == 0
    assert "reads per second" in capsys.readouterr().out
    assert "python tools/benchmark_proposals.py --images 20" in report.read_text()


@pytest.mark.slow  # a spawned interpreter imports torch: about 10 s
def test_benchmark_measures_in_a_fresh_process(tmp_path):
    pickle_path, store_path = make_synthetic_proposals(tmp_path, 20, 5)
    result = in_fresh_process(measure_access, "store", str(store_path), 10, 50)
    assert result.reads == 10 and result.baseline.rss > 0
    with pytest.raises(RuntimeError, match="benchmark process failed"):
        in_fresh_process(measure_access, "store", str(tmp_path / "nope.proposals"), 10, 50)


def test_image_sizes_round_trip_through_a_store_and_stores_without_them_still_open(tmp_path):
    ids = ["000005", "000007", 139]
    sizes = [(375, 500), None, (480, 640)]
    boxes = [np.array([[0, 0, 9, 9]], np.float32)] * 3
    save_proposals(ProposalSet(ids, boxes, image_sizes=sizes), tmp_path / "p.pkl")
    convert_proposals(tmp_path / "p.pkl", tmp_path / "p.proposals")
    store = load_proposals(tmp_path / "p.proposals")
    assert store.manifest["has_sizes"] is True and (tmp_path / "p.proposals" / "sizes.npy").is_file()
    assert [store.image_size(i) for i in ids] == sizes
    assert [pickle.loads(pickle.dumps(store)).image_size(i) for i in ids] == sizes
    convert_proposals(tmp_path / "p.proposals", tmp_path / "back.pkl")  # and back to a pickle
    assert [load_proposals(tmp_path / "back.pkl").image_size(i) for i in ids] == sizes

    # Without sizes: no sizes.npy; a version-1 store written before sizes existed (no "has_sizes" in
    # its manifest) opens as before.
    write_proposal_store(ProposalSet(ids, boxes), tmp_path / "old.proposals")
    assert not (tmp_path / "old.proposals" / "sizes.npy").exists()
    manifest_path = tmp_path / "old.proposals" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["has_sizes"] is False
    del manifest["has_sizes"]
    manifest_path.write_text(json.dumps(manifest))
    old = load_proposals(tmp_path / "old.proposals")
    assert old.image_size(139) is None and old[139].tolist() == [[0, 0, 9, 9]]

    # A store that says it has sizes checks them like its other files.
    sizes_path = tmp_path / "p.proposals" / "sizes.npy"
    sizes_path.write_bytes(sizes_path.read_bytes()[:-4])
    with pytest.raises(ProposalStoreError, match=rf"{sizes_path}: truncated"):
        load_proposals(tmp_path / "p.proposals")
    sizes_path.unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing {sizes_path}"):
        load_proposals(tmp_path / "p.proposals")
    np.save(sizes_path, np.array([[375, 500], [-3, 0], [480, 640]], np.int32))
    with pytest.raises(ValueError, match=rf"{sizes_path}: .*negative"):
        load_proposals(tmp_path / "p.proposals")
