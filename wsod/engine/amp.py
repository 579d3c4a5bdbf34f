"""Mixed precision for training and prediction: which dtype a device really runs fast, and its autocast.

``amp`` settings are ``None`` (full precision), ``"bf16"`` or ``"fp16"``. Autocast is used on CUDA only:
on CPUs the reduced-precision kernels are often slower than float32 ones.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["AMP_DTYPES", "resolve_amp", "autocast"]

logger = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# bfloat16 runs natively from compute capability 8.0 (Ampere) on; older GPUs emulate it at a fraction
# of float16's speed, while float16 (with a gradient scaler) has tensor cores there.
_NATIVE_BF16_CAPABILITY = (8, 0)


def resolve_amp(amp: str | None, device: torch.device | str) -> str | None:
    """The precision a run will really use on ``device``: ``None`` off CUDA; ``"fp16"`` instead of
    ``"bf16"`` on a GPU without native bfloat16 (logged); otherwise ``amp`` itself."""
    if amp not in (None, *AMP_DTYPES):
        raise ValueError(f"unknown amp '{amp}': expected null, bf16 or fp16")
    device = torch.device(device)
    if amp is None or device.type != "cuda":
        return None
    if amp == "bf16" and torch.cuda.get_device_capability(device) < _NATIVE_BF16_CAPABILITY:
        logger.warning(
            "amp=bf16 asked for, but %s (compute capability %s) has no native bfloat16: using fp16 with"
            " a gradient scaler instead",
            torch.cuda.get_device_name(device),
            ".".join(map(str, torch.cuda.get_device_capability(device))),
        )
        return "fp16"
    return amp


def autocast(device: torch.device | str, amp: str | None) -> AbstractContextManager:
    """Autocast to ``amp``'s dtype on CUDA; a no-op for ``amp=None`` and on other devices. Pass an
    ``amp`` already resolved by ``resolve_amp``."""
    device = torch.device(device)
    if not amp or device.type != "cuda":
        return nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[amp])
