"""A probe for what stays alive through a backward: ``AliveProbe.apply(x)`` is the identity, and its
backward records whether the Python tensor its forward returned is still referenced by anyone (the
training loop, a companion, a benchmark step). Autograd keeps no reference to that tensor when nothing
after it saves it (a ``sum`` saves nothing), so a True means a caller held it."""

from __future__ import annotations

import weakref

import torch


class AliveProbe(torch.autograd.Function):
    ref: weakref.ref | None = None
    alive: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        AliveProbe.alive.append(AliveProbe.ref() is not None)
        return grad

    @classmethod
    def track(cls, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the probe, its output watched from now on."""
        out = cls.apply(x)
        cls.ref, cls.alive = weakref.ref(out), []
        return out
