"""Which precision a device really runs."""

from __future__ import annotations

import logging

import pytest
import torch

from wsod.engine.amp import resolve_amp


def test_bf16_becomes_fp16_on_gpus_without_native_bfloat16(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with caplog.at_level(logging.WARNING):
        assert resolve_amp("bf16", "cuda") == "fp16"
    assert "no native bfloat16" in caplog.text
    assert resolve_amp("fp16", "cuda") == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_amp("bf16", "cuda") == "bf16"
    assert resolve_amp("bf16", "cpu") is None and resolve_amp(None, "cuda") is None
    with pytest.raises(ValueError, match="unknown amp 'fp8'"):
        resolve_amp("fp8", "cuda")
