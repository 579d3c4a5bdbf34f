"""Simulated partial labels from a dataset with boxes (and masks): what ``tools/make_partial_labels.py``
writes, the way researchers simulate annotators (UFO2 on COCO: points and scribbles from the masks).

- kinds: a chosen fraction of the units (images, or single objects with ``per="object"``) get points, of
  the rest a fraction scribbles, then boxes; the others keep image labels only. Counts are exact
  (``round(fraction * units)``, the units drawn by a seeded permutation), not a coin per unit.
- point: a pixel drawn uniformly from the object's mask (integer pixel coordinates), or from its box
  when there is no mask.
- scribble: ``SCRIBBLE_WAYPOINTS`` waypoints drawn as points are, from the mask shrunk by
  ``SCRIBBLE_MARGIN`` pixels when that leaves any pixel (else from the mask), or from the central half of
  the box (an annotator draws inside the object, whose shape a box does not tell); the path runs in
  straight segments through them in drawing order, one point per pixel of length, and with a mask the
  points off the mask are left out (a segment may cross a concave shape's gap).
- box: the object's ground-truth box.

Every draw comes from ``numpy.random.default_rng([seed, unit index])`` and the kinds from one
permutation of ``seed``: the same command writes the same file.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import cv2
import numpy as np

__all__ = [
    "SCRIBBLE_WAYPOINTS",
    "SCRIBBLE_MARGIN",
    "SimulatedObject",
    "FRACTION_FORMS",
    "parse_fraction",
    "choose_kinds",
    "simulate_point",
    "simulate_scribble",
    "simulate_partial_label",
]

SCRIBBLE_WAYPOINTS = 4
SCRIBBLE_MARGIN = 2  # pixels kept between the waypoints and the mask's edge when the mask allows it


@dataclass(frozen=True)
class SimulatedObject:
    """One object to label: ``box`` (4,) x1 y1 x2 y2 0-based inclusive, ``mask`` (H, W) bool or None."""

    box: np.ndarray
    mask: np.ndarray | None = None


# What parse_fraction accepts, said in its errors.
FRACTION_FORMS = "a number in [0, 1], as a decimal (0.1) or a ratio (1/3)"


def parse_fraction(text: str) -> float:
    """``"0.1"``, ``"1/3"`` or ``"1"`` -> a float in [0, 1]; ValueError (the value and what is accepted)
    otherwise."""
    try:
        value = float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{text!r} is not a fraction; give {FRACTION_FORMS}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{text!r} is outside [0, 1]; give {FRACTION_FORMS}")
    return value


def choose_kinds(num_units: int, fractions: dict[str, float], seed: int) -> list[str | None]:
    """Each unit's kind (``None``: image labels only): exactly ``round(f * num_units)`` units per kind in
    the order of ``fractions``, the units drawn by a permutation of ``seed``."""
    total = sum(fractions.values())
    if total > 1.0 + 1e-9:
        raise ValueError(f"the fractions add up to {total:g} > 1: {fractions}")
    order = np.random.default_rng(seed).permutation(num_units)
    kinds: list[str | None] = [None] * num_units
    start = 0
    for kind, fraction in fractions.items():
        count = min(int(round(fraction * num_units)), num_units - start)
        for unit in order[start : start + count]:
            kinds[int(unit)] = kind
        start += count
    return kinds


def _pixels(obj: SimulatedObject, margin: int = 0, central: bool = False) -> np.ndarray:
    """(N, 2) x y integer pixels to draw from: the mask (shrunk by ``margin`` when it leaves any pixel),
    else the box (its central half when ``central``)."""
    if obj.mask is not None and obj.mask.any():
        mask = obj.mask
        if margin:
            shrunk = cv2.erode(mask.astype(np.uint8), np.ones((2 * margin + 1, 2 * margin + 1), np.uint8))
            if shrunk.any():
                mask = shrunk.astype(bool)
        ys, xs = np.nonzero(mask)
        return np.stack([xs, ys], axis=1).astype(np.float32)
    x1, y1, x2, y2 = (float(v) for v in obj.box)
    if central:
        dx, dy = (x2 - x1) / 4, (y2 - y1) / 4
        x1, x2, y1, y2 = x1 + dx, x2 - dx, y1 + dy, y2 - dy
    xs = np.arange(np.ceil(x1), np.floor(x2) + 1)
    ys = np.arange(np.ceil(y1), np.floor(y2) + 1)
    if not len(xs) or not len(ys):  # a box thinner than a pixel: its centre
        return np.array([[(x1 + x2) / 2, (y1 + y2) / 2]], dtype=np.float32)
    grid_x, grid_y = np.meshgrid(xs, ys)
    return np.stack([grid_x.ravel(), grid_y.ravel()], axis=1).astype(np.float32)


def simulate_point(obj: SimulatedObject, rng: np.random.Generator) -> list[float]:
    """A click ``[x, y]``: a pixel uniform over the mask, else over the box."""
    pixels = _pixels(obj)
    x, y = pixels[rng.integers(len(pixels))]
    return [float(x), float(y)]


def simulate_scribble(obj: SimulatedObject, rng: np.random.Generator) -> list[list[float]]:
    """A path ``[[x, ...], [y, ...]]`` inside the object (module docstring)."""
    pixels = _pixels(obj, margin=SCRIBBLE_MARGIN, central=True)
    waypoints = pixels[rng.integers(len(pixels), size=SCRIBBLE_WAYPOINTS)]
    path = [waypoints[:1]]
    for start, end in zip(waypoints[:-1], waypoints[1:], strict=True):
        steps = max(1, int(np.ceil(np.abs(end - start).max())))
        t = np.arange(1, steps + 1, dtype=np.float32)[:, None] / steps
        path.append(np.round(start + t * (end - start)))
    points = np.concatenate(path)
    if obj.mask is not None and obj.mask.any():
        height, width = obj.mask.shape
        cols = np.clip(points[:, 0].astype(int), 0, width - 1)
        rows = np.clip(points[:, 1].astype(int), 0, height - 1)
        on_mask = obj.mask[rows, cols]
        if on_mask.any():
            points = points[on_mask]
    # Consecutive repeats (a segment of length 0) carry nothing.
    keep = np.ones(len(points), dtype=bool)
    keep[1:] = np.any(points[1:] != points[:-1], axis=1)
    points = points[keep]
    return [points[:, 0].astype(float).tolist(), points[:, 1].astype(float).tolist()]


def simulate_partial_label(
    kind: str, obj: SimulatedObject, rng: np.random.Generator
) -> list[float] | list[list[float]]:
    """The geometry of one object's partial label of ``kind`` (point, scribble or box)."""
    if kind == "point":
        return simulate_point(obj, rng)
    if kind == "scribble":
        return simulate_scribble(obj, rng)
    if kind == "box":
        return [float(v) for v in obj.box]
    raise ValueError(f"unknown kind {kind!r}: expected point, scribble or box")
