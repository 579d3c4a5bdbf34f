"""The training loop's own rules (the end-to-end runs are in tests/test_run.py)."""

from __future__ import annotations

import torch
from torch import nn

from wsod.engine.solver import build_scheduler


def test_resume_loads_the_checkpoint_to_host_memory(monkeypatch, tmp_path):
    # On CUDA a map_location of the device would move the RNG byte tensors to the GPU, which
    # torch.set_rng_state refuses; load_state_dict moves weights to their parameters' devices anyway.
    import wsod.engine.train as engine

    seen = []

    def spy(directory, map_location="cpu"):
        seen.append(map_location)

    monkeypatch.setattr(engine, "latest_valid_checkpoint", spy)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = build_scheduler(optimizer, milestones=[])
    engine.train(
        model, optimizer, scheduler, lambda start: iter(()), max_iter=0, run_dir=tmp_path,
        device=torch.device("cpu"), resume=True, progress=False,
    )  # fmt: skip
    assert seen == ["cpu"]
