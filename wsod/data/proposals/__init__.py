"""Object proposals (docs/METHOD.md §9): sets of boxes by image id, their files, stores, generation and
recall. Boxes are float32 ``(R, 4)`` ``x1 y1 x2 y2``, 0-based inclusive pixels of the image on disk.

One concept per module, each importing only the ones above it in this list (so there is no cycle):

- ``safe_pickle``: the restricted unpickler every proposal pickle is read with (numpy arrays, dicts,
  lists and plain values; anything else is refused with ``UnsafePickleError`` before it runs);
- ``sets``: ``ProposalSet`` (lookup by image id, recorded image sizes), ``proposal_key``, the loading
  rules (``filter_proposals``) and the errors of a lookup;
- ``store``: ``ProposalStore``, a ``ProposalSet`` memory-mapped from a ``<name>.proposals`` directory;
- ``box_lists``: boxes from any tool (a COCO-style json of boxes, a folder of per-image arrays);
- ``io``: reading, writing and converting files by suffix (reference pickles, detectron2's proposal
  pickles, MATLAB releases, the ``box_lists`` inputs, stores);
- ``selective_search``: generating proposals over a dataset (OpenCV; imported on its own, not here);
- ``recall``: the fraction of ground-truth boxes the proposals cover (imported on its own, not here);
- ``parts``: the proposals per object, by class, that are parts of it (imported on its own, not here).

This package re-exports every name ``wsod.data.proposals`` had when it was one module, and the store's.
"""

from wsod.data.proposals.box_lists import read_box_folder, read_box_json
from wsod.data.proposals.io import (
    JSON_SUFFIXES,
    MAT_SUFFIXES,
    PICKLE_SUFFIXES,
    convert_proposals,
    load_proposals,
    read_proposal_mat,
    read_proposal_pickle,
    save_proposals,
    write_proposal_mat,
    write_proposal_pickle,
)
from wsod.data.proposals.safe_pickle import UnsafePickleError
from wsod.data.proposals.sets import (
    ImageId,
    MissingProposalsError,
    ProposalSet,
    ProposalSizeError,
    filter_proposals,
    proposal_key,
    union_proposals,
    whole_image_box,
)
from wsod.data.proposals.store import (
    STORE_DTYPES,
    STORE_SUFFIX,
    ProposalStore,
    ProposalStoreError,
    is_store_path,
    write_proposal_store,
)

__all__ = [
    "MissingProposalsError",
    "ProposalSizeError",
    "UnsafePickleError",
    "ProposalSet",
    "proposal_key",
    "filter_proposals",
    "union_proposals",
    "whole_image_box",
    "load_proposals",
    "save_proposals",
    "read_proposal_pickle",
    "write_proposal_pickle",
    "read_proposal_mat",
    "write_proposal_mat",
    "convert_proposals",
    "ImageId",
    "PICKLE_SUFFIXES",
    "MAT_SUFFIXES",
    "JSON_SUFFIXES",
    "read_box_json",
    "read_box_folder",
    "ProposalStore",
    "ProposalStoreError",
    "STORE_SUFFIX",
    "STORE_DTYPES",
    "is_store_path",
    "write_proposal_store",
]
