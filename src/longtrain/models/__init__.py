"""The small reference model used by the demo and the end-to-end tests."""

from longtrain.models.tiny_lm import LAYER_KINDS, StepInputs, TinyLM, TinyLMConfig, default_layer_pattern

__all__ = ["LAYER_KINDS", "StepInputs", "TinyLM", "TinyLMConfig", "default_layer_pattern"]
