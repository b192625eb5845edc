"""Step-time models: how long one engine step takes for a given batch. One interface, several fits."""

from twin.perf.base import StepBatch, StepTimeModel
from twin.perf.fitted import FittedModel
from twin.perf.registry import STEP_MODELS, build_perf
from twin.perf.roofline import RooflineModel

__all__ = ["StepBatch", "StepTimeModel", "RooflineModel", "FittedModel", "STEP_MODELS", "build_perf"]
