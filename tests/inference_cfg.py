"""Test helpers: a hybrid model's or layer's InferenceConfig set from the default (the lean backends on every
device)."""

from contextlib import contextmanager
from dataclasses import replace

from headscope.hybrid.backend_registry import replace_all
from headscope.hybrid.inference import DEFAULT, InferenceConfig, inference_config, use_inference

ON = replace(DEFAULT, prefill="lean", decode="lean", captured_decode="graph")  # also on CPU (Triton interpreter)


def use(model, **changes) -> InferenceConfig:
    """Set ``model``'s config to :data:`ON` with ``changes``; returns it."""
    return use_inference(model, replace(ON, **changes))


@contextmanager
def plain(model):
    """Within the block ``model`` takes the reference forward: every role "reference"."""
    old = inference_config(model)
    use_inference(model, replace_all(old, "reference"))
    try:
        yield
    finally:
        use_inference(model, old)
