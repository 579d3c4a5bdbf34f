"""The proposal sub-package: ``wsod.data.proposals`` exports what the module of that name did, the old
module paths of its parts (re-exporting shims until issue 35) are gone, and a store pickled in one
process opens in a fresh interpreter (as a spawned data-loader worker unpickles it)."""

from __future__ import annotations

import importlib.util
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

# Old module -> its home.
MOVED = {
    "wsod.data.proposal_store": "wsod.data.proposals.store",
    "wsod.data.selective_search": "wsod.data.proposals.selective_search",
    "wsod.data.proposal_recall": "wsod.data.proposals.recall",
}


def test_the_package_exports_every_name_the_module_had_and_lists_them_in_all():
    missing = [name for name in MODULE_NAMES if not hasattr(proposals, name)]
    assert not missing, f"wsod.data.proposals lost {missing}; re-export them in its __init__.py"
    assert set(MODULE_NAMES) <= set(proposals.__all__)
    assert all(hasattr(proposals, name) for name in proposals.__all__)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_gone(old):
    assert importlib.util.find_spec(MOVED[old]) is not None
    assert importlib.util.find_spec(old) is None, f"{old} is back: import {MOVED[old]} instead"


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
