"""The quick start's expected result: the mAP range the README's default toy run (``python tools/train.py``)
lands in, and the sentence tools/train.py prints after its ``copypaste:`` line saying whether a run is
inside it, so that a newcomer can tell a bad install from a normal draw.

The range is measured, not promised: MIST's default recipe over seeds 1-5 with 1 and 2 torch threads
(docs/RESULTS.md, "The quick start's range"). A run counts as the quick start when its command changed
nothing but settings that leave the recipe as it is (``RECIPE_NEUTRAL_KEYS``): the seed, the thread count,
where the run goes, a resume (which continues exactly). Any other override (a method, a schedule, data)
is another experiment, and no sentence is printed for it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["QUICK_START_MAP_RANGE", "RECIPE_NEUTRAL_KEYS", "is_quick_start", "quick_start_sentence"]

# mAP (VOC07 AP at IoU 0.5, percent) of the default toy run: min and max over the runs of seeds 1-5 x threads
# 1 and 2 measured on an AMD EPYC 2-core machine, rounded outward to whole points (docs/RESULTS.md, "The
# quick start's range", lists them).
QUICK_START_MAP_RANGE = (92.0, 100.0)

# Keys a quick-start command may set and still be the quick start: they change which draw of the recipe
# runs (seed, threads: float rounding), where it is written, or how it is shown, not the recipe.
RECIPE_NEUTRAL_KEYS = frozenset({"seed", "threads", "output_dir", "resume", "trust_checkpoint", "progress"})


def _key(override: str) -> str:
    """The config key of one Hydra override string: ``seed=3`` -> ``seed``, ``+a.b=1`` -> ``a.b``,
    ``~a`` -> ``a``, ``method@x=y`` -> ``method``."""
    key = override.split("=", 1)[0].lstrip("+~")
    return key.split("@", 1)[0]


def is_quick_start(overrides: Sequence[str]) -> bool:
    """Whether a tools/train.py command with these Hydra overrides (``hydra.overrides.task``: the
    command's, or a sweep job's own) runs the quick start's recipe."""
    return all(_key(o) in RECIPE_NEUTRAL_KEYS for o in overrides)


def quick_start_sentence(map_percent: float) -> str:
    """The sentence after a quick-start run's ``copypaste:`` line: where its mAP (percent) stands."""
    low, high = QUICK_START_MAP_RANGE
    where = (
        "inside that range"
        if low <= map_percent <= high
        else "outside that range: not a result this recipe gave on the measured machines (see the README's"
        " quick start for what to check)"
    )
    return (
        f"quick start: the default toy run lands at mAP {low:.0f} to {high:.0f} (measured over seeds and"
        f" thread counts, docs/RESULTS.md); this run's {map_percent:.2f} is {where}."
    )
