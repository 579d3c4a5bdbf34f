"""The weakly-supervised detector and its parts: backbones (ResNet C4, VGG16), the MIL teacher, the
refinement students and the refinement methods that teach them (MIST, OICR, or your own)."""

from wsod.modeling.detector import BACKBONES, METHODS, WeaklySupervisedDetector, build_detector
from wsod.modeling.method import PseudoLabels, RefinementMethod

__all__ = [
    "WeaklySupervisedDetector",
    "build_detector",
    "BACKBONES",
    "METHODS",
    "PseudoLabels",
    "RefinementMethod",
]
