"""Compile headscope's Triton kernels for a Hopper GPU (sm_90) on a machine without one, to read what a launch
would need there — above all its shared memory, which Triton only checks when the kernel is loaded on the device
(``OutOfResources: shared memory``). Triton's own CUDA compiler runs on the CPU (its wheel carries ``ptxas``); only
the launch needs a GPU.

:func:`recorded_launches` swaps the launch of every ``@triton.jit`` kernel for a record of its arguments while
headscope's kernel wrappers run on CPU tensors (their checks see Triton's interpreter, ``TRITON_INTERPRET=1``; no
kernel body runs, so the outputs are left unwritten); :func:`compile_for_hopper` then compiles each record with
Triton's own argument binding and specialization (``JITFunction`` internals of Triton 3.x), fp16 pointers as bf16
and the GPU path's settings (``SYNC`` on, all ``PHASES`` in one launch), and returns the compiled kernel's metadata
(``shared``: bytes of dynamic shared memory per program). Both need a process that imported triton without
``TRITON_INTERPRET=1`` (tests/conftest.py sets it: ``triton.language``'s own helpers are then interpreted ones):
:func:`run_clean` runs a function of a test module in such a process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

HOPPER_SHARED_LIMIT = 232_448  # bytes per thread block on the H100 / H200 (227 KiB; the figure Triton reports)
KERNEL_MODULES = ("splitk", "gdn_step", "fa_prep", "one_launch", "layer_tail")


def run_clean(module: str, function: str, *calls: tuple) -> Any:
    """``module.function(*args)`` (a module of tests/, returning JSON data) in a fresh Python process whose environment
    lacks ``TRITON_INTERPRET`` -> its result. With ``calls`` (argument tuples of JSON values): one process per tuple,
    all at once (compiling is single-threaded: the CPU's other cores take the other calls) -> their results in order."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests), env.get("PYTHONPATH", "")])
    procs = []
    for args in calls or ((),):
        code = (f"import json, {module} as m; "
                f"print('RESULT ' + json.dumps(m.{function}(*json.loads({json.dumps(json.dumps(list(args)))}))))")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tests, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not lines:
            raise RuntimeError(f"{module}.{function} failed in its process:\n{err[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results if calls else results[0]


@dataclasses.dataclass
class Launch:
    kernel: Any  # the JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def _clean_import() -> bool:
    """Whether triton.language's helpers were made as compiled functions (triton imported without the interpreter)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return isinstance(tl.standard.sum, JITFunction)


def _modules():
    import importlib

    return [importlib.import_module(f"headscope.hybrid.inference.kernels.{m}") for m in KERNEL_MODULES]


@contextlib.contextmanager
def recorded_launches() -> Iterator[list]:
    """Within: headscope's kernels are built as compiled (not interpreted) Triton functions, and each launch
    ``kernel[grid](...)`` appends a :class:`Launch` to the yielded list instead of running. Afterwards the kernel
    caches are emptied, so that the next use builds them as before (interpreted under ``TRITON_INTERPRET=1``)."""
    import triton
    from triton.runtime.jit import JITFunction

    knobs = triton.knobs.runtime.__dict__  # a knob set in Python is kept here (and written to the environment)
    env, knob, run = os.environ.get("TRITON_INTERPRET"), knobs.get("interpret"), JITFunction.run
    mods = _modules()
    records: list = []
    for m in mods:
        m._kernels.clear()
    triton.knobs.runtime.interpret = False  # triton.jit makes JITFunctions...
    os.environ["TRITON_INTERPRET"] = "1"  # ...while the wrappers' checks accept CPU tensors

    def record(self, *args, grid, warmup, **kwargs):
        records.append(Launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield records
    finally:
        JITFunction.run = run
        knobs.pop("interpret", None)
        if knob is not None:
            knobs["interpret"] = knob
        if env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env
        for m in mods:
            m._kernels.clear()


def _source(launch: Launch, capability: int) -> tuple:
    """(ASTSource, target, backend, options) of one recorded launch for CUDA ``capability``, bound as Triton binds a
    launch: fp16 pointers as bf16 (the interpreter refuses bf16 dots; both are 2 bytes), ``SYNC`` (the in-launch
    barriers on CUDA) True and ``PHASES`` all in one launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if not _clean_import():
        raise RuntimeError("compiling for Hopper needs a process that imported triton without TRITON_INTERPRET=1 "
                           "(run_clean)")
    kern = launch.kernel
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    kwargs.update({k: v for k, v in (("SYNC", True), ("PHASES", 31)) if k in kwargs})
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    bound, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kern._pack_args(backend, kwargs, bound, spec, options)
    signature = {k: (v.replace("fp16", "bf16") if isinstance(v, str) else v) for k, v in signature.items()}
    return ASTSource(kern, signature, constexprs, attrs), target, backend, options


def compile_for_hopper(launch: Launch, capability: int = 90) -> dict:
    """Compile one recorded launch for CUDA ``capability`` (90: H100 / H200) down to the cubin (ptxas) -> the
    compiled kernel's metadata as a dict (``shared``, ``num_warps``, ``num_stages``, ``name``); arguments bound as
    :func:`_source` says."""
    from triton.compiler import compile

    src, target, _, options = _source(launch, capability)
    md = compile(src, target=target, options=options.__dict__).metadata
    return {"name": launch.name, "shared": md.shared, "num_warps": md.num_warps, "num_stages": md.num_stages}


_SHARED: dict = {}  # the compile key of a launch -> its shared memory (launches of one key compile once)


def shared_for_hopper(launch: Launch, capability: int = 90) -> int:
    """Bytes of dynamic shared memory per program of one recorded launch compiled for CUDA ``capability``: the
    figure of :func:`compile_for_hopper`'s metadata (Triton sets it in its ``make_llir`` stage, from the
    ``ttg.shared`` attribute that its shared-memory allocation pass writes), read after Triton's own ``make_ttir``
    and ``make_ttgir`` stages and ``make_llir``'s passes up to that allocation — without the LLVM lowering and -O3,
    the PTX and ptxas, two thirds of a compile's time (tests/test_triton_hopper_smem.py checks both give the same
    figures). Launches of one compile key (kernel, signature, constexprs, specialization, options) compile once."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    src, target, backend, options = _source(launch, capability)
    options = backend.parse_options(options.__dict__)
    key = (src.hash(), options.hash(), capability)  # as in Triton's compile cache key
    if key not in _SHARED:
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                          context)
        metadata = {"hash": "", "target": target, **options.__dict__}
        stages: dict = {}
        backend.add_stages(stages, options, src.language)
        mod = stages["ttgir"](stages["ttir"](mod, metadata), metadata)
        pm = ir.pass_manager(mod.context)  # make_llir's passes up to the shared-memory allocation (Triton 3.9)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm, False)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability,
                                                            get_ptx_version_from_options(options, target.arch))
        pm.run(mod, "allocate_shared_memory")
        _SHARED[key] = mod.get_int_attr("ttg.shared")
    return _SHARED[key]
