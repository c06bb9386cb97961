"""Argument checks that run before any work (issue #19).

Every entry point (the ``headscope`` commands, :func:`headscope.rank`, :func:`headscope.selectors.select`,
:func:`headscope.hybridize`, :func:`headscope.ablate`, ...) calls these helpers first, so that a bad
argument, a missing file or an unmet precondition is reported in seconds, before a model is loaded,
data are sampled or a sweep starts. Every helper raises :class:`~headscope.errors.HeadscopeInputError`
(or one of its variants in :mod:`headscope.errors`) with a message that names the fix.

What needs the model's geometry (a budget of 300 heads, a mask of another model, a prompt longer
than the context) is judged from the model's config without loading weights: ``config.json`` of a
local directory or of a cached hub id, or the metadata of a GGUF file (:func:`model_geometry`).
"""

from .commands import (
    DIRECTIONS,
    FIGURE_FORMATS,
    MODES,
    SENDER_MODES,
    as_mask,
    check_anatomy_args,
    check_figure_formats,
    check_hybridize_args,
    check_mask_layers,
    check_rank_args,
    check_rank_store,
    check_select_args,
    check_task_settings,
    parse_verify,
)
from .core import (
    check_budget,
    check_choice,
    check_device,
    check_device_map,
    check_dtype,
    check_file,
    check_int,
    check_model,
    check_out_dir,
    check_real,
    config_geometry,
    gguf_geometry,
)

__all__ = [
    "DIRECTIONS", "FIGURE_FORMATS", "MODES", "SENDER_MODES", "as_mask", "check_anatomy_args", "check_budget",
    "check_choice", "check_device", "check_device_map", "check_dtype", "check_figure_formats", "check_file",
    "check_hybridize_args", "check_int", "check_mask_layers", "check_model", "check_out_dir", "check_rank_args",
    "check_rank_store", "check_real", "check_select_args", "check_task_settings", "config_geometry",
    "gguf_geometry", "parse_verify",
]
