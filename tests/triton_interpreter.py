"""Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without CUDA) without its repeated
language patching and without the integer-overflow checks whose assertion it skips: test-time speed-ups, no change to
what a kernel computes or to what is checked.

Triton 3.x's interpreter re-patches ``triton.language`` (``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math``,
``tl.core``...) on EVERY call of a ``@triton.jit`` helper made from inside a kernel
(``InterpretedFunction.__call__`` -> ``_patch_lang``), on top of the patching the kernel's launch
(``GridExecutor.__call__``) already did and undoes at its end. The helpers of headscope's decode kernels are called in
loops, once per program and tile: measured on ``test_device_position_decoding_equals_eager_steps``, 42,000 such
re-patches were a quarter of the test's time. Here a helper patches the language the first time it is called within
a launch (exactly as before: same modules, same replacements) and calls straight through after that; the launch's
own patching and restore are untouched. A helper reached outside a launch keeps Triton's behaviour.

Triton 3.x's interpreter also builds an overflow check around every 32-bit integer ``+``, ``-`` and ``*`` of a kernel
(``sanitize_overflow`` in its ``InterpreterOptions``: casts of both operands to int64, the operation again, two
comparisons) and hands it to ``device_assert``, which returns at once unless the options' ``debug`` is on — and the
interpreter's is always off. Those discarded checks were ~45 % of
``test_device_position_decoding_equals_eager_steps``; :func:`skip_unasserted_overflow_checks` stops building them while
``debug`` is off (tests/test_triton_interpreter.py: an overflowing kernel gives the same values and no error either
way).
"""

from __future__ import annotations


def patch_once_per_launch() -> bool:
    """Install the shim on ``triton.runtime.interpreter``; False (nothing changed) where triton or the two entry
    points it wraps are missing, or their shape changed (then Triton's own behaviour stays)."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # no triton: nothing to speed up
        return False
    grid_call, device_call = getattr(ti.GridExecutor, "__call__", None), getattr(ti.InterpretedFunction, "__call__", None)
    if grid_call is None or device_call is None or not hasattr(ti, "_patch_lang") or getattr(grid_call, "_headscope", False):
        return False
    patched: list[set] = []  # per launch in progress (innermost last): the helpers that patched the language in it

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper(self, *args, **kwargs):
        if not patched or self.fn not in patched[-1]:
            if patched:
                patched[-1].add(self.fn)
            return device_call(self, *args, **kwargs)  # Triton's own call: patches the language, then runs
        fn = self.rewrite()  # what Triton's call does after its (here redundant) patching
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    launch._headscope = True
    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = helper
    return True


def skip_unasserted_overflow_checks() -> bool:
    """Set the interpreter's ``sanitize_overflow`` off while its ``debug`` is off (the checks' assertion is skipped
    then); False (nothing changed) where triton, its interpreter builder or those options are missing, or ``debug`` is
    on."""
    import dataclasses

    try:
        from triton.runtime import interpreter as ti
    except Exception:  # no triton: nothing to speed up
        return False
    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if (not dataclasses.is_dataclass(options) or getattr(options, "debug", True)
            or not hasattr(options, "sanitize_overflow")):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
