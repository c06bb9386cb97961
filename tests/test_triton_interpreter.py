"""tests/triton_interpreter.py's shims change neither what a kernel computes nor what is checked: Triton's interpreter
builds overflow checks that it never asserts (its ``debug`` is off), so a kernel whose 32-bit arithmetic overflows
gives the same wrapped values and no error with the checks built (Triton's default) and without them (the shim)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU machine: kernels are compiled, the shims are not installed
    pytest.skip("Triton's interpreter is not in use (tests/conftest.py sets it without CUDA)", allow_module_level=True)

from triton.runtime import interpreter as ti  # noqa: E402

from triton_interpreter import skip_unasserted_overflow_checks  # noqa: E402


@triton.jit
def _overflowing(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i)
    tl.store(Y + i, x * 3 + x - 7)  # int32: x * 3 passes 2**31 for the large x


def _run() -> torch.Tensor:
    x = torch.tensor([5, -9, 2**30 + 11, 2**31 - 1], dtype=torch.int32)
    y = torch.empty_like(x)
    _overflowing[(1,)](x, y, N=4)
    return y


def test_the_overflow_checks_were_never_asserted(monkeypatch):
    builder = ti.interpreter_builder
    assert builder.options.debug is False and builder.options.sanitize_overflow is False  # the shim, from conftest
    want = torch.tensor([5 * 4 - 7, -9 * 4 - 7, (2**30 + 11) * 4 - 7, (2**31 - 1) * 4 - 7], dtype=torch.int64)
    want = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement wrap-around, computed by hand
    without = _run()
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True))
    built = _run()  # Triton's default: the checks built, and skipped
    assert torch.equal(without, want) and torch.equal(built, want)
    # with debug on the checks assert (this kernel does overflow), and the shim leaves the options alone
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    assert skip_unasserted_overflow_checks() is False and builder.options.sanitize_overflow is True
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _run()
