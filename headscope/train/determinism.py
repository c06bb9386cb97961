"""Deterministic training (``headscope convert --deterministic``, :attr:`TrainConfig.deterministic`; issue 62 item 5).

What the setting turns on, for the document sampling and every training step of a conversion:

* ``torch.use_deterministic_algorithms(True, warn_only=False)``: PyTorch's deterministic implementations where it
  has them (index_add / index_select backward, scatter, SDPA's flash and memory-efficient backward, cuDNN; since
  torch 2.10 also Inductor's deterministic mode, which skips the on-device benchmarking that picks reduction
  configs: pytorch/pytorch#165950), and a ``RuntimeError`` naming the op where one has none, never a silent
  fallback;
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's condition for bit-equal GEMMs across streams; set before the first
  GEMM of the process when it is not set, refused when it is set to another value);
* ``torch.backends.cudnn.deterministic = True``, ``torch.backends.cudnn.benchmark = False``.

The data order, the rows, the documents' sampler seeds and the GDN heads' initialization are seeded in every
run, with or without the setting (:mod:`headscope.train.recipe`, the trainer's ``Loader``).

Kernels outside PyTorch's switch are listed by :func:`nondeterministic_parts` and saved with the run (the
``StepPlan``'s ``nondeterministic``): fla's Triton GDN kernels (no atomic adds in their source, but block sizes
chosen by timing on first use, cached per Triton cache folder), Inductor before torch 2.10, flash-attn's backward
(``headscope convert`` trains the FA heads with SDPA instead under the setting: :func:`fa_kernel_override`) and
the gradient all-reduce of data-parallel runs. On a CPU in one process the list is empty.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..errors import HeadscopeInputError

#: the value of CUBLAS_WORKSPACE_CONFIG set for deterministic cuBLAS (PyTorch also accepts ":16:8")
CUBLAS_WORKSPACE = ":4096:8"
_CUBLAS_OK = (":4096:8", ":16:8")
#: the first torch release whose Inductor follows torch.use_deterministic_algorithms (pytorch/pytorch#165950)
INDUCTOR_DETERMINISTIC_FROM = (2, 10)


def check_environment(environ: Optional[dict[str, str]] = None) -> None:
    """The environment allows deterministic cuBLAS: ``CUBLAS_WORKSPACE_CONFIG`` unset (it is then set) or one of
    ``:4096:8`` / ``:16:8``.

    Raises:
        HeadscopeInputError: another value (cuBLAS would choose its workspace by it; PyTorch raises at the first GEMM).
    """
    v = (os.environ if environ is None else environ).get("CUBLAS_WORKSPACE_CONFIG")
    if v is not None and v not in _CUBLAS_OK:
        raise HeadscopeInputError(f"CUBLAS_WORKSPACE_CONFIG={v!r} in the environment: deterministic training needs "
                                  f"{' or '.join(_CUBLAS_OK)}; unset it (headscope then sets {CUBLAS_WORKSPACE}) or leave "
                                  "--deterministic off")


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True) -> Iterator[dict[str, Any]]:
    """Within the block, PyTorch's deterministic settings (module docstring); the previous flags come back at the
    end (``CUBLAS_WORKSPACE_CONFIG`` stays set: cuBLAS reads it once per process). ``enabled=False``: nothing
    changes. Yields what was set (for the record).

    Raises:
        HeadscopeInputError: ``CUBLAS_WORKSPACE_CONFIG`` set to a value other than ``:4096:8`` / ``:16:8``.
    """
    if not enabled:
        yield {}
        return
    check_environment()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield {"use_deterministic_algorithms": True, "warn_only": False, "cudnn_deterministic": True,
               "cudnn_benchmark": False, "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"]}
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def _torch_version(version: Optional[str] = None) -> tuple[int, int]:
    parts = (version or torch.__version__).split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _hybrid_kernels(student: nn.Module) -> tuple[Optional[str], Optional[str]]:
    """(gdn_kernel, fa_kernel) of a headscope hybrid's options, or (None, None) for another model."""
    spec = getattr(getattr(student, "config", None), "headscope_hybrid", None)
    opts = (spec or {}).get("options") or {}
    return opts.get("gdn_kernel"), opts.get("fa_kernel")


def nondeterministic_parts(student: nn.Module, device: torch.device, world: int = 1, compiled: bool = False,
                           fla: Optional[bool] = None, flash_attn: Optional[bool] = None,
                           torch_version: Optional[str] = None) -> tuple[str, ...]:
    """The parts of a training step that PyTorch's deterministic switch does not cover, each with why (empty: none
    known). ``fla`` / ``flash_attn``: whether those packages are installed (default: searched); ``torch_version``:
    default the running one."""
    from ..hybrid.fa_kernels import flash_attn_available
    from ..hybrid.gdn_kernels import fla_available

    out: list[str] = []
    cuda = torch.device(device).type == "cuda"
    gdn, fa = _hybrid_kernels(student)
    fla = fla_available() if fla is None else fla
    flash_attn = flash_attn_available() if flash_attn is None else flash_attn
    if cuda and (gdn == "fla" or (gdn == "auto" and fla)):
        cache = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
        cached = os.environ.get("FLA_CACHE_RESULTS", "1") == "1"
        out.append("GDN heads: fla's Triton kernels (chunk_gated_delta_rule forward and backward) are outside "
                   "PyTorch's switch; their source has no atomic adds, but their block sizes are chosen by timing on "
                   "first use" + (f" and cached in the Triton cache ({cache}; fla's FLA_CACHE_RESULTS=1): runs sharing "
                                  "that cache are expected to match, a fresh cache may choose other blocks (rounding "
                                  "differences)" if cached else " on every run (FLA_CACHE_RESULTS=0)")
                   + "; --gdn-kernel torch runs PyTorch ops only (slower)")
    if cuda and (fa == "flash_attn" or (fa == "auto" and flash_attn)):
        out.append("FA heads: flash-attn's backward adds with atomics (headscope convert --deterministic trains them "
                   "with SDPA instead)")
    if cuda and compiled and _torch_version(torch_version) < INDUCTOR_DETERMINISTIC_FROM:
        out.append(f"torch.compile: Inductor before torch {'.'.join(map(str, INDUCTOR_DETERMINISTIC_FROM))} may benchmark "
                   "reduction configs on the device (pytorch/pytorch#165950 made it follow the switch)")
    if world > 1:
        out.append(f"the gradient all-reduce over {world} ranks (NCCL / gloo collectives are outside PyTorch's switch; "
                   "equal on one fixed machine in practice, not guaranteed)")
    return tuple(out)


def fa_kernel_override(deterministic: bool, hybrid_options: dict[str, Any], device: Any) -> dict[str, Any]:
    """The hybrid options a deterministic conversion trains with: ``fa_kernel="sdpa"`` on CUDA where flash-attn
    would otherwise run (its backward is not deterministic; SDPA's is under the switch), else unchanged.

    Raises:
        HeadscopeInputError: ``fa_kernel="flash_attn"`` asked for explicitly together with the setting.
    """
    from ..hybrid.fa_kernels import flash_attn_available

    fa = hybrid_options.get("fa_kernel", "auto")
    if not deterministic or torch.device(device).type != "cuda":
        return dict(hybrid_options)
    if fa == "flash_attn":
        raise HeadscopeInputError("fa_kernel='flash_attn' has no deterministic backward here; use fa_kernel='sdpa' "
                                  "(or 'auto') with --deterministic, or leave --deterministic off")
    if fa == "auto" and flash_attn_available():
        return {**hybrid_options, "fa_kernel": "sdpa"}
    return dict(hybrid_options)
