"""Moved to ``wsod.engine.gradnorm``, beside its training-loop half ``wsod.engine.balancing``; this name
stays importable (``from wsod.gradnorm import GradNorm``)."""

from wsod.engine.gradnorm import GradNorm

__all__ = ["GradNorm"]
