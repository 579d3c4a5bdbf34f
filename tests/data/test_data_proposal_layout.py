"""The proposal sub-package keeps every old import path: ``wsod.data.proposals`` exports what the module of
that name did, the old module paths are shims that give the very same objects, and a store pickled in one
process opens in a fresh interpreter (as a spawned data-loader worker unpickles it)."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import wsod.data.proposals as proposals
from wsod.data.proposals import ProposalSet, load_proposals, save_proposals

REPO = Path(__file__).resolve().parents[2]

# The names of wsod/data/proposals.py before it became this package (its __all__ at 9aba265, ImageId and the
# suffix tuples it defined, and ProposalSizeError, added while it was still a module).
MODULE_NAMES = (
    "MissingProposalsError", "ProposalSizeError", "ProposalSet", "proposal_key", "filter_proposals",
    "whole_image_box", "load_proposals", "save_proposals", "read_proposal_pickle", "write_proposal_pickle",
    "read_proposal_mat", "write_proposal_mat", "convert_proposals", "ImageId", "PICKLE_SUFFIXES",
    "MAT_SUFFIXES",
)  # fmt: skip

# Old module -> (its new home, the names code and tests import from the old path).
SHIMS = {
    "wsod.data.proposal_store": (
        "wsod.data.proposals.store",
        ("STORE_SUFFIX", "STORE_DTYPES", "ProposalStore", "ProposalStoreError", "is_store_path",
         "write_proposal_store", "_reopen"),
    ),
    "wsod.data.selective_search": (
        "wsod.data.proposals.selective_search",
        ("selective_search", "generate_proposals", "GenerationStats", "MODES", "_read_bgr", "_run_shard",
         "_ShardTask"),
    ),
    "wsod.data.proposal_recall": (
        "wsod.data.proposals.recall",
        ("RecallReport", "proposal_recall", "records_recall", "format_recall_table", "plot_recall",
         "DEFAULT_COUNTS"),
    ),
}  # fmt: skip


def test_the_package_exports_every_name_the_module_had_and_lists_them_in_all():
    missing = [name for name in MODULE_NAMES if not hasattr(proposals, name)]
    assert not missing, f"wsod.data.proposals lost {missing}; re-export them in its __init__.py"
    assert set(MODULE_NAMES) <= set(proposals.__all__)
    assert all(hasattr(proposals, name) for name in proposals.__all__)


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_module_path_gives_the_same_objects_as_the_new_one(old):
    new, names = SHIMS[old]
    shim, module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(shim, name) is getattr(module, name), f"{old}.{name} is not {new}.{name}"
    public = [n for n in names if not n.startswith("_")]
    assert sorted(shim.__all__) == sorted(public)
    assert set(module.__all__) <= set(shim.__all__)  # nothing the new module exports is missing here


def _store(tmp_path: Path) -> tuple[ProposalSet, Path]:
    original = ProposalSet(["000005", 7], [np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((1, 4))])
    save_proposals(original, tmp_path / "p.proposals")
    return original, tmp_path / "p.proposals"


def test_a_store_pickles_by_its_path_and_opens_in_a_fresh_interpreter(tmp_path):
    original, path = _store(tmp_path)
    data = pickle.dumps(load_proposals(path))
    assert b"wsod.data.proposals.store" in data and b"_reopen" in data  # a function pickle can import
    (tmp_path / "store.pkl").write_bytes(data)
    script = (
        "import pickle, sys; s = pickle.load(open(sys.argv[1], 'rb'));"
        " print(type(s).__module__, s[5].tolist(), s[7].tolist())"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store.pkl")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split(" ", 1) == [
        "wsod.data.proposals.store",
        f"{original['000005'].tolist()} {original[7].tolist()}\n",
    ]


def test_a_store_pickled_under_the_old_module_path_still_opens(tmp_path):
    original, path = _store(tmp_path)
    # Protocol 0 names the function as text, so the old path can be written in place of the new one.
    data = pickle.dumps(load_proposals(path), protocol=0)
    old = data.replace(b"wsod.data.proposals.store", b"wsod.data.proposal_store")
    assert old != data
    reopened = pickle.loads(old)
    assert reopened[7].tolist() == original[7].tolist() and len(reopened) == 2
