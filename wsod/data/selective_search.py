"""Moved to ``wsod.data.proposals.selective_search``; this path keeps working for existing imports.

Patch names (e.g. in a test's monkeypatch) in ``wsod.data.proposals.selective_search``, where the code
looks them up: setting them here changes nothing.
"""

from wsod.data.proposals.selective_search import MODES, GenerationStats, generate_proposals, selective_search
from wsod.data.proposals.selective_search import _read_bgr as _read_bgr  # imported by tests
from wsod.data.proposals.selective_search import _run_shard as _run_shard
from wsod.data.proposals.selective_search import _ShardTask as _ShardTask

__all__ = ["selective_search", "generate_proposals", "GenerationStats", "MODES"]
