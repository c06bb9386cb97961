"""The hybrid's fast backends and their configuration: :class:`InferenceConfig`, attached per model
(:func:`use_inference`)."""

from .inference_config import DEFAULT, InferenceConfig, inference_config, use_inference

__all__ = ["DEFAULT", "InferenceConfig", "inference_config", "use_inference"]
