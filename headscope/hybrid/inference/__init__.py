"""The hybrid's inference seam: :class:`InferenceConfig`, chosen once per model (:func:`use_inference`)."""

from .config import DEFAULT, InferenceConfig, inference_config, use_inference

__all__ = ["DEFAULT", "InferenceConfig", "inference_config", "use_inference"]
