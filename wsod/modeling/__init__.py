"""The ResNet C4 weakly-supervised detector and its parts."""

from wsod.modeling.detector import WeaklySupervisedDetector, build_detector

__all__ = ["WeaklySupervisedDetector", "build_detector"]
