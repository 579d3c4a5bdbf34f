"""ImageNet weights for the backbones: by torchvision name, or from a local file when offline."""

from __future__ import annotations

import os
import urllib.error

import torch
import torchvision

__all__ = ["is_weights_file", "load_state_dict"]


def is_weights_file(weights: str) -> bool:
    """Whether ``weights`` names a local file (a path, or a .pth / .pt name) rather than torchvision's."""
    return os.path.sep in weights or weights.endswith((".pth", ".pt")) or os.path.exists(weights)


def load_state_dict(weights: str, arch: str) -> dict[str, torch.Tensor]:
    """The state dict of torchvision's ``arch`` ("resnet50", "vgg16"...) named by ``weights``.

    ``weights`` is a torchvision weights name ("DEFAULT", "IMAGENET1K_V1", "VGG16_Weights.IMAGENET1K_V1")
    or the path of a local state-dict file (possibly under a "state_dict" or "model" key). Keys are
    torchvision's; the caller maps and checks them. A failed download raises a ``RuntimeError`` that names
    the URL and torch hub's cache folder, so the file can be fetched on a connected machine.
    """
    if is_weights_file(weights):
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"backbone weights file not found: {weights}")
        state = torch.load(weights, map_location="cpu", weights_only=True)
        for key in ("state_dict", "model"):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
        return state
    enum = torchvision.models.get_model_weights(arch)
    name = weights.split(".")[-1]
    try:
        entry = enum[name] if name != "DEFAULT" else enum.DEFAULT
    except KeyError:
        raise ValueError(
            f"unknown weights '{weights}' for {arch}: expected a file path or one of"
            f" {[w.name for w in enum]} or DEFAULT"
        ) from None
    try:
        return entry.get_state_dict(progress=True)
    except (urllib.error.URLError, OSError) as error:
        cache = os.path.join(torch.hub.get_dir(), "checkpoints")
        raise RuntimeError(
            f"could not load {enum.__name__}.{entry.name} ({error}). Offline? Download {entry.url} on a"
            f" connected machine and put it in {cache}, or pass the file's path as the weights."
        ) from error
