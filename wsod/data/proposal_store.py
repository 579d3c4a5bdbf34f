"""Moved to ``wsod.data.proposals.store``; this path keeps working for existing imports.

Patch names (e.g. in a test's monkeypatch) in ``wsod.data.proposals.store``, where the code looks them up:
setting them here changes nothing.
"""

from wsod.data.proposals.store import (
    STORE_DTYPES,
    STORE_SUFFIX,
    ProposalStore,
    ProposalStoreError,
    is_store_path,
    write_proposal_store,
)
from wsod.data.proposals.store import _reopen as _reopen  # stores pickled under this path still open

__all__ = [
    "STORE_SUFFIX",
    "STORE_DTYPES",
    "ProposalStore",
    "ProposalStoreError",
    "is_store_path",
    "write_proposal_store",
]
