"""Moved: what tools/predict.py runs is ``wsod.run.predict_from_config`` (beside training and evaluation,
sharing their setup), and the image-file helpers are in ``wsod.data.images``. These names stay
importable from here."""

from wsod.data.images import IMAGE_EXTENSIONS, ImageFiles, find_images
from wsod.run import PREDICTION_FILES, predict_from_config

__all__ = ["IMAGE_EXTENSIONS", "ImageFiles", "find_images", "predict_from_config", "PREDICTION_FILES"]
