"""The calibrate stage: activation statistics -> amax (entropy | percentile | mse | max) -> FP8 / INT8-SQ
TensorRT-LLM checkpoint, TensorRT calibration cache and report."""

from .data import CalibrationRecipe, resolve_recipe
from .stage import DEFAULT_METHOD, CalibrateOptions, CalibrationResult, calibrate_checkpoint

__all__ = ["CalibrationRecipe", "CalibrateOptions", "CalibrationResult", "DEFAULT_METHOD",
           "calibrate_checkpoint", "resolve_recipe"]
