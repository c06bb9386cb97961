"""Test helpers: a hybrid model's or layer's InferenceConfig set from the default (the lean path on every device)."""

from contextlib import contextmanager
from dataclasses import replace

from headscope.hybrid.inference import DEFAULT, InferenceConfig, inference_config, use_inference

ON = replace(DEFAULT, fast_path="always")  # the lean path on CPU too (Triton kernels in the interpreter)


def use(model, **changes) -> InferenceConfig:
    """Set ``model``'s config to :data:`ON` with ``changes``; returns it."""
    return use_inference(model, replace(ON, **changes))


@contextmanager
def plain(model):
    """Within the block ``model`` takes the reference (plain) path: fast_path="never"."""
    old = inference_config(model)
    use_inference(model, replace(old, fast_path="never"))
    try:
        yield
    finally:
        use_inference(model, old)
