"""wsod: weakly-supervised object detection with memory-efficient sequential backprop."""

# Importing the config schemas registers them with Hydra's ConfigStore, before any config is composed.
from wsod import config_schema as config_schema
from wsod.sequential_backprop import SequentialBackprop

__version__ = "0.1.0"
__all__ = ["SequentialBackprop", "__version__"]
