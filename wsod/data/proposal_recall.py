"""Moved to ``wsod.data.proposals.recall``; this path keeps working for existing imports."""

from wsod.data.proposals.recall import (
    DEFAULT_COUNTS,
    RecallReport,
    format_recall_table,
    plot_recall,
    proposal_recall,
    records_recall,
)

__all__ = [
    "RecallReport",
    "proposal_recall",
    "records_recall",
    "format_recall_table",
    "plot_recall",
    "DEFAULT_COUNTS",
]
