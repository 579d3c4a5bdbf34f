"""wsod: weakly-supervised object detection with memory-efficient sequential backprop."""

from wsod.sequential_backprop import SequentialBackprop

__version__ = "0.1.0"
__all__ = ["SequentialBackprop", "__version__"]
