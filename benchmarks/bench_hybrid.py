"""One head-wise hybrid attention layer (7:1, >= 1 FA head per layer) against the all-FA layer.

Measures in one run and one process, B = 1, bf16 on CUDA (fp32 on CPU):

- prefill: forward time of the whole attention module (projections included) over T tokens, and its
  peak extra memory (CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before; CPU:
  the allocator events of the torch profiler), the hybrid layer's on its low-memory path (the elementwise
  stages in place, under ``no_grad``);
- decoding: one token step with T tokens cached in a :class:`HybridDecodeCache` (K/V of the FA heads'
  KV groups, GDN state), replayed from a CUDA graph (``torch.cuda.CUDAGraph``, timed with CUDA events
  over many replays) and run eagerly; and the cache's bytes at T;
- graphed prefill (CUDA): the same prefill of both layers recorded once in a CUDA graph and replayed
  (``headscope.hybrid.inference.graphs.capture``; no host time: the glue's guards and fla's launches are gone),
  its time and the peak allocated while capturing it; the hybrid again with ``--graph-block``-token
  GDN blocks (default 8192: smaller fla intermediates, which cost host time only when eager);
- ``--flash-qla``: the hybrid's prefill again with FlashQLA's GDN forward (``InferenceConfig.flash_qla``; head_dim
  128 only, i.e. the Qwen3 shape), eager and graphed, and its output against fla's;
- parity: the all-FA layer vs the teacher's ``LlamaAttention`` (prefill), and the hybrid decode step
  (eager and graph-replayed) vs the full forward's last position.

"fa" is the all-FA layer (HeadwiseHybridAttention with every head FA, fusion off: the teacher's
numbers, same code path); "teacher" is transformers' LlamaAttention (prefill only). Ratios are
hybrid / fa; timings are only meaningful as ratios within one run. Kernels: fla (GDN) when importable
on CUDA, else the PyTorch GDN path; flash-attn for FA when importable, else SDPA.

    python benchmarks/bench_hybrid.py --out results/             # CUDA: 4K..64K, both shapes
    python benchmarks/bench_hybrid.py --smoke --out /tmp/smoke   # CPU, toy lengths: checks the script
    python benchmarks/bench_hybrid.py --check ...                # + CUDA kernels vs the CPU reference
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from headscope.hybrid.convert import migrate_from
from headscope.hybrid.inference import prefill
import headscope.hybrid.layer as layer_mod
from headscope.hybrid.inference import DEFAULT, inference_config, use_inference
from headscope.hybrid import HeadwiseHybridAttention, HybridOptions, hybridize
from headscope.hybrid.fa_kernels import flash_attn_available, flash_attn_usable
from headscope.hybrid.inference.kernels import splitk
from headscope.hybrid.inference.graphs import capture as capture_graph, warm_up
from headscope.hybrid.gdn_kernels import fla_available, gdn_chunked_torch, gated_delta_rule
from headscope.hybrid.backend_registry import replace_all
from headscope.masks import HeadMask

from bench_timing import configured, parse_variant, time_ms, variant_config

SHAPES = {
    # name: (hidden, q heads, kv heads, head_dim, FA heads of the layer at 7:1 with >= 1 per layer)
    "smollm2-135m": (576, 9, 3, 64, (0,)),
    "qwen3-1.7b": (2048, 16, 8, 128, (0, 1)),
    # a diagnostic shape: the SmolLM2 hybrid layer's FA part alone (one query head over one KV group, no GDN heads),
    # so that its decode step against smollm2-135m's hybrid step shows what the GDN heads cost
    "smollm2-fa-part": (576, 1, 1, 64, (0,)),
}


def _cfg(hidden, h, kv, d):
    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=h, num_key_value_heads=kv, head_dim=d,
                      intermediate_size=4 * hidden, num_hidden_layers=1, vocab_size=1000,
                      max_position_embeddings=1 << 18, rope_theta=100000.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, dev, reps, warmup=1):
    """Mean ms per call (benchmarks/bench_timing.py)."""
    return time_ms(fn, dev, reps, warmup)


def _peak_bytes(fn, dev):
    """Peak bytes allocated by ``fn()`` above what was allocated before it (its output included)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _err(a, ref):
    a, ref = a.float().cpu(), ref.float().cpu()
    m = (a - ref).abs().max().item()
    return {"max_abs": m, "rel_to_max": m / max(ref.abs().max().item(), 1e-30)}


def _prefill_graph(call, dev, reps, ref):
    """The prefill replayed from a CUDA graph (``headscope.hybrid.inference.graphs.capture``): ms per replay,
    peak bytes allocated while capturing (the graph's intermediates, its output included; the eager
    warm-ups run before the peak is reset) and the replay's error against the eager output ``ref``."""
    warm_up(call, 2)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph, static = capture_graph(call, warmup=0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    graph.replay()
    err = _err(static, ref)
    ms = _time(graph.replay, dev, reps, warmup=1)
    del graph, static
    torch.cuda.empty_cache()
    return ms, peak, err


def _flash_qla_prefill(mod, call, dev, reps, parity):
    """The hybrid prefill (layer ``mod``) with FlashQLA's GDN forward (``InferenceConfig.flash_qla``) against fla's:
    time, peak, graphed time (or why capture failed) and its output against fla's."""
    r = {}
    if prefill._flash_qla_fwd() is None:
        return {"flash_qla": "not installed"}
    base = inference_config(mod)
    with configured([mod], replace(base, flash_qla=False)):
        ref = call()
    with configured([mod], replace(base, flash_qla=True)):
        r["prefill_ms_flashqla"] = _time(call, dev, reps)
        r["prefill_peak_bytes_flashqla"] = _peak_bytes(call, dev)
        got = call()
        parity["hybrid_flashqla_vs_fla_prefill"] = _err(got, ref)
        try:
            ms, pk, e = _prefill_graph(call, dev, reps, got)
            r["prefill_graph_ms_flashqla"], r["prefill_graph_peak_bytes_flashqla"] = ms, pk
            parity["hybrid_flashqla_prefill_graph_vs_eager"] = e
        except Exception as e:  # noqa: BLE001 - e.g. a host sync inside its context-parallel set-up
            r["prefill_graph_flashqla_error"] = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.synchronize()
    return r


def _prefilled(mod, x, pe, T):
    """A HybridDecodeCache holding the first T tokens of x, the step's (cos, sin), and a function that puts
    back the cache's recurrent state (GDN state, conv tail) as after the prefill."""
    dc = mod.new_decode_cache(1, T + 1)
    mod(x[:, :T], position_embeddings=tuple(t[:, :T] for t in pe), cache=dc)
    bufs = [t for t in (dc.S, dc.conv) if t is not None]
    snap = [t.clone() for t in bufs]

    def restore():
        for t, s_ in zip(bufs, snap):
            t.copy_(s_)

    return dc, tuple(t[:, T:].contiguous() for t in pe), restore


def _graphed(step, restore, ref, dev, graph_reps):
    """Capture ``step`` in a CUDA graph, replay it once from the restored state: (its output against ``ref``,
    ms per replay)."""
    graph, static_out = capture_graph(step, warmup=3)
    restore()
    graph.replay()
    torch.cuda.synchronize()
    err = _err(static_out, ref)
    ms = _time(graph.replay, dev, graph_reps, warmup=3)
    del graph, static_out
    return err, ms


def _decode(mod, x, pe, T, dev, graph_reps, eager_reps):
    """Prefill T tokens into a HybridDecodeCache, then time one decode step at length T."""
    x1 = x[:, T:]
    dc, pe1, restore = _prefilled(mod, x, pe, T)

    def step():
        dc.length = T  # every step is the step at length T (K/V written into slot T)
        return mod(x1, position_embeddings=pe1, cache=dc)[0]

    out_eager = step().clone()
    r = {"cache_bytes": dc.nbytes(T), "step_out": out_eager}
    restore()
    r["eager_ms"] = _time(step, dev, eager_reps, warmup=2)
    if dev.type == "cuda":
        r["graph_vs_eager"], r["graph_ms"] = _graphed(step, restore, out_eager, dev, graph_reps)
    else:
        r["graph_ms"] = None
    del dc
    return r


DECODE_VARIANTS = {  # name: device position; the decode step is the default one-launch step either way (the
    # variants it replaced: docs/performance-variants.md)
    "one_launch": False, "devpos_one_launch": True,
}  # a variant name may add InferenceConfig fields: 'one_launch:fused_out_max_d=0' (bench_timing.parse_variant)


def _decode_variant(mod, x, pe, T, dev, graph_reps, variant, ref, profile=False):
    """The graphed decode step at length T with the InferenceConfig changes of ``variant`` (DECODE_VARIANTS and
    optional fields); device-position variants read the position from device memory (one graph for every
    length). Returns its graph time, its output against ``ref`` (the default eager step), the config and, with
    ``profile``, the GPU kernels of one eager step."""
    base, changes = parse_variant(variant)
    devpos = DECODE_VARIANTS[base]
    config = variant_config(changes, inference_config(mod))
    with configured([mod], config):
        x1 = x[:, T:]
        dc, pe1, restore = _prefilled(mod, x, pe, T)
        pos = torch.full((1,), T, dtype=torch.long, device=dev)
        pid = pos.view(1, 1)

        def step():
            if devpos:
                dc.pos = pos
                return mod(x1, position_embeddings=pe1, cache=dc, position_ids=pid)[0]
            dc.length = T
            return mod(x1, position_embeddings=pe1, cache=dc, position_ids=pid)[0]

        got = step().clone()
        restore()
        r = {"vs_default_eager": _err(got, ref), "config": asdict(config)}
        r["graph_vs_eager"], r["graph_ms"] = _graphed(step, restore, got, dev, graph_reps)
        if profile:
            r["profile"] = _profile_kernels(step, restore)
        return r


def _profile_kernels(step, restore, n=5):
    """GPU kernels of ``n`` eager steps (after a warm-up): name, calls per step and µs per step each,
    the sum, and the kernel count per step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    restore()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
            restore()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us and e.count:
            rows.append({"kernel": e.key[:120], "calls_per_step": e.count / n, "us_per_step": us / n})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"kernels": rows[:40], "sum_us_per_step": sum(r["us_per_step"] for r in rows),
            "launches_per_step": sum(r["calls_per_step"] for r in rows)}


_dd: dict = {}


def _decode_default_step(mod, x, pe, T):
    """One eager default decode step at length T (for the profile; its cache made once per module)."""
    key = (id(mod), T)
    if key not in _dd:
        _dd.clear()
        _dd[key] = _prefilled(mod, x, pe, T)[:2]
    dc, pe1 = _dd[key]
    dc.length = T
    return mod(x[:, T:], position_embeddings=pe1, cache=dc)[0]


def layers(shape, dev, dtype, gdn_kernel, config=DEFAULT):
    """({"teacher": LlamaAttention with random weights, "fa": the all-FA layer (fusion off), "hybrid": the shape's
    hybrid layer}, both migrated from the teacher and run with the InferenceConfig ``config``, on ``dev`` in
    ``dtype``, eval mode; the config)."""
    hidden, h, kv, d, fa = SHAPES[shape]
    cfg = _cfg(hidden, h, kv, d)
    torch.manual_seed(0)
    teacher = LlamaAttention(cfg, 0)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.02)
    mods = {"teacher": teacher,
            "fa": HeadwiseHybridAttention(cfg, 0, tuple(range(h)), HybridOptions(fusion="none", gdn_kernel=gdn_kernel)),
            "hybrid": HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel=gdn_kernel))}
    migrate_from(mods["fa"], teacher)
    migrate_from(mods["hybrid"], teacher)
    for k in ("fa", "hybrid"):
        use_inference(mods[k], config)
    return {k: m.to(dev, dtype).eval() for k, m in mods.items()}, cfg


@torch.no_grad()
def bench_layer(shape, T, dev, dtype, gdn_kernel, graph_reps=200, eager_reps=30, prefill_reps=None,
                before=True, graph_prefill=True, graph_block=8192, flash_qla=False, decode_variants=False,
                profile=False, config=DEFAULT):
    mods, cfg = layers(shape, dev, dtype, gdn_kernel, config)
    teacher, hidden, d = mods["teacher"], cfg.hidden_size, SHAPES[shape][3]
    rope = LlamaRotaryEmbedding(cfg).to(dev)
    x = torch.randn(1, T + 1, hidden, device=dev, dtype=dtype)
    pe = rope(x, torch.arange(T + 1, device=dev)[None])
    xp, pep = x[:, :T], tuple(t[:, :T] for t in pe)
    reps = prefill_reps or max(3, min(20, (1 << 17) // T))
    out = {"T": T, "reps_prefill": reps, "graph_reps": graph_reps, "eager_reps": eager_reps}
    for name, mod in mods.items():
        kw = {"attention_mask": None} if name == "teacher" else {}
        call = lambda: mod(xp, position_embeddings=pep, **kw)[0]  # noqa: E731
        r = {"prefill_ms": _time(call, dev, reps)}
        # eager GDN block graphs (InferenceConfig.eager_gdn_graphs): the peak of the first call, which makes them, or of a later
        # call plus what they hold between calls (static inputs, their memory pool), whichever is larger
        prefill.release_eager_graphs()
        r["prefill_peak_bytes"] = _peak_bytes(call, dev)
        held = prefill.eager_graph_bytes()
        if held:
            r["prefill_peak_bytes_first_call"] = r["prefill_peak_bytes"]
            r["prefill_peak_bytes_steady"] = _peak_bytes(call, dev) + held
            r["eager_graph_held_bytes"] = held
            r["prefill_peak_bytes"] = max(r["prefill_peak_bytes_first_call"], r["prefill_peak_bytes_steady"])
        if name == "hybrid" and before:
            # the layer before the lean path (its default low-memory path)
            with configured([mod], replace_all(config, "reference")):
                r["prefill_peak_bytes_before"] = _peak_bytes(call, dev)
                r["prefill_ms_before"] = _time(call, dev, reps)
                ref_before = call()
        if graph_prefill and dev.type == "cuda" and name != "teacher":
            ref = call()
            r["prefill_graph_ms"], r["prefill_graph_peak_bytes"], e = _prefill_graph(call, dev, reps, ref)
            out.setdefault("parity", {})[f"{name}_prefill_graph_vs_eager"] = e
            if name == "hybrid" and graph_block:  # small GDN blocks: host time no longer matters
                with configured([mod], replace(config, gdn_block_tokens=graph_block)):
                    ms, pk, e = _prefill_graph(call, dev, reps, ref)
                r[f"prefill_graph_ms@block{graph_block}"], r[f"prefill_graph_peak_bytes@block{graph_block}"] = ms, pk
                out["parity"][f"hybrid_prefill_graph_block{graph_block}_vs_eager"] = e
            del ref
        if flash_qla and name == "hybrid" and dev.type == "cuda" and d == 128:
            r.update(_flash_qla_prefill(mod, call, dev, reps, out.setdefault("parity", {})))
        out[name] = r
    out.setdefault("parity", {})
    out["parity"]["fa_layer_vs_teacher_prefill"] = _err(mods["fa"](xp, position_embeddings=pep)[0],
                                                          teacher(xp, position_embeddings=pep, attention_mask=None)[0])
    if before:
        out["parity"]["hybrid_lean_vs_before_prefill"] = _err(mods["hybrid"](xp, position_embeddings=pep)[0], ref_before)
        del ref_before
    for name in ("fa", "hybrid"):
        mod = mods[name]
        dec = _decode(mod, x, pe, T, dev, graph_reps, eager_reps)
        step_out = dec.pop("step_out")
        if name == "hybrid":
            full = mod(x, position_embeddings=pe)[0][:, -1]
            out["parity"]["hybrid_decode_step_vs_full_forward"] = _err(step_out[:, 0], full)
            if "graph_vs_eager" in dec:
                out["parity"]["hybrid_graph_vs_eager_step"] = dec.pop("graph_vs_eager")
        dec.pop("graph_vs_eager", None)
        out[name].update({f"decode_{k}" if not k.startswith("cache") else k: v for k, v in dec.items()})
        if decode_variants and dev.type == "cuda":
            variants = tuple(DECODE_VARIANTS)
            if not isinstance(decode_variants, bool):  # the names given (--variants)
                variants = decode_variants
            for vn in variants:
                try:
                    vr = _decode_variant(mod, x, pe, T, dev, graph_reps, vn, step_out,
                                         profile=profile and (vn == "one_launch" or ":" in vn))
                    out[name][f"decode_graph_ms_{vn}"] = vr.pop("graph_ms")
                    out.setdefault("configs", {})[vn] = vr.pop("config")
                    out["parity"][f"{name}_decode_{vn}_vs_default"] = vr.pop("vs_default_eager")
                    out["parity"][f"{name}_decode_{vn}_graph_vs_eager"] = vr.pop("graph_vs_eager")
                    if "profile" in vr:
                        out.setdefault("profile", {})[f"{name}_{vn}"] = vr["profile"]
                except Exception as e:  # noqa: BLE001 - record and go on (a kernel or capture failure)
                    out[name][f"decode_{vn}_error"] = f"{type(e).__name__}: {e}"[:500]
                    torch.cuda.synchronize()
                torch.cuda.empty_cache()
            if profile:
                try:
                    out.setdefault("profile", {})[f"{name}_default"] = _profile_kernels(
                        lambda: _decode_default_step(mod, x, pe, T), lambda: None)
                except Exception as e:  # noqa: BLE001
                    out.setdefault("profile", {})[f"{name}_default"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    keys = ("prefill_ms", "prefill_peak_bytes", "decode_graph_ms", "decode_eager_ms", "cache_bytes")
    out["ratio"] = {k: (out["hybrid"][k] / out["fa"][k] if out["fa"].get(k) else None) for k in keys}
    out["ratio"]["fa_speedup_prefill"] = out["fa"]["prefill_ms"] / out["hybrid"]["prefill_ms"]
    out["ratio"]["teacher_speedup_prefill"] = out["teacher"]["prefill_ms"] / out["hybrid"]["prefill_ms"]
    if out["fa"].get("decode_graph_ms") and out["hybrid"].get("decode_graph_ms"):
        out["ratio"]["fa_speedup_decode_graph"] = out["fa"]["decode_graph_ms"] / out["hybrid"]["decode_graph_ms"]
    fa_best = min([v for k, v in out["fa"].items() if k.startswith("decode_graph_ms") and v] or [0]) or None
    for k, v in list(out["hybrid"].items()):
        if k.startswith("decode_graph_ms_") and v and out["fa"].get("decode_graph_ms"):
            vn = k[len("decode_graph_ms_"):]
            out["ratio"][f"fa_speedup_decode_graph_{vn}"] = out["fa"]["decode_graph_ms"] / v
            if out["fa"].get(k):  # the all-FA layer with the same decode options
                out["ratio"][f"fa_speedup_decode_graph_{vn}_same_options"] = out["fa"][k] / v
            if fa_best:  # against the fastest all-FA decode step of the run
                out["ratio"][f"fa_best_speedup_decode_graph_{vn}"] = fa_best / v
    for k in ("prefill_graph_ms", "prefill_graph_peak_bytes", f"prefill_graph_ms@block{graph_block}",
              f"prefill_graph_peak_bytes@block{graph_block}"):
        fk = k.split("@")[0]
        if out["hybrid"].get(k) is not None and out["fa"].get(fk):
            out["ratio"][k] = out["hybrid"][k] / out["fa"][fk]
    for k in ("prefill_ms_flashqla", "prefill_graph_ms_flashqla"):
        fk = "prefill_graph_ms" if "graph" in k else "prefill_ms"
        if out["hybrid"].get(k) and out["fa"].get(fk):
            out["ratio"][f"fa_speedup_{k}"] = out["fa"][fk] / out["hybrid"][k]
    if out["ratio"].get("prefill_graph_ms"):
        out["ratio"]["fa_speedup_prefill_graph"] = 1.0 / out["ratio"]["prefill_graph_ms"]
    if before:
        out["ratio"]["prefill_ms_before"] = out["hybrid"]["prefill_ms_before"] / out["fa"]["prefill_ms"]
        out["ratio"]["prefill_peak_bytes_before"] = out["hybrid"]["prefill_peak_bytes_before"] / out["fa"]["prefill_peak_bytes"]
    out["ratio"]["prefill_ms_vs_teacher"] = out["hybrid"]["prefill_ms"] / out["teacher"]["prefill_ms"]
    out["ratio"]["prefill_peak_vs_teacher"] = out["hybrid"]["prefill_peak_bytes"] / out["teacher"]["prefill_peak_bytes"]
    return out


@torch.no_grad()
def checks(dev):
    """CUDA kernels vs the CPU reference. Errors are max |diff| and that divided by max |ref|."""
    res = {}

    def err(a, ref):
        a, ref = a.float().cpu(), ref.float().cpu()
        m = (a - ref).abs().max().item()
        return {"max_abs": m, "rel_to_max": m / max(ref.abs().max().item(), 1e-30)}

    g = torch.Generator().manual_seed(0)
    B, T, H, D = 1, 1000, 8, 64
    q = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    gg = F.logsigmoid(torch.randn(B, T, H, generator=g) + 3)
    beta = torch.rand(B, T, H, generator=g)
    h0 = torch.randn(B, H, D, D, generator=g) * 0.1
    y_ref, s_ref = gdn_chunked_torch(q, k, v, gg, beta, initial_state=h0)
    for dt in (torch.float32, torch.bfloat16):
        c = lambda t: t.to(dev, dt)
        y, s = gated_delta_rule(c(q), c(k), c(v), gg.to(dev), c(beta), initial_state=h0.to(dev), kernel="fla")
        res[f"fla_chunk_{str(dt)[6:]}_T{T}"] = {"y": err(y, y_ref), "state": err(s, s_ref)}
        # decoding: 16 fused-recurrent steps from the state after 984 tokens
        _, s0 = gdn_chunked_torch(q[:, :984], k[:, :984], v[:, :984], gg[:, :984], beta[:, :984], initial_state=h0)
        st = s0.to(dev)
        ys = []
        for t in range(984, T):
            sl = slice(t, t + 1)
            yt, st = gated_delta_rule(c(q[:, sl]), c(k[:, sl]), c(v[:, sl]), gg[:, sl].to(dev), c(beta[:, sl]),
                                      initial_state=st, kernel="fla")
            ys.append(yt)
        res[f"fla_recurrent_{str(dt)[6:]}_16steps"] = {"y": err(torch.cat(ys, 1), y_ref[:, 984:]), "state": err(st, s_ref)}

    # a whole hybrid layer (SmolLM2 shape, 1 FA + 8 GDN, every option on): CUDA (fla + SDPA) vs CPU (torch)
    hidden, h, kv, d, fa = SHAPES["smollm2-135m"]
    cfg = _cfg(hidden, h, kv, d)
    torch.manual_seed(0)
    teacher = LlamaAttention(cfg, 0)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.05)
    opts = dict(gdn_conv=4, fa_gate=True, fa_pos="nope")
    cpu_layer = HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel="torch", **opts)).eval()
    migrate_from(cpu_layer, teacher)
    with torch.no_grad():
        for n, p in cpu_layer.named_parameters():
            if any(s in n for s in ("a_proj", "b_proj", "g_proj")):
                p.normal_(std=0.05)
    x = torch.randn(2, 777, hidden, generator=g)
    rope = LlamaRotaryEmbedding(cfg)
    pe = rope(x, torch.arange(777)[None])
    ref, _ = cpu_layer(x, position_embeddings=pe)
    for dt in (torch.float32, torch.bfloat16):
        gl = HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel="fla", **opts))
        gl.load_state_dict(cpu_layer.state_dict())
        gl = gl.to(dev, dt).eval()
        out, _ = gl(x.to(dev, dt), position_embeddings=tuple(t.to(dev, dt) for t in pe))
        res[f"layer_cuda_vs_cpu_{str(dt)[6:]}"] = err(out, ref)

    # a small hybrid model (SmolLM2 geometry, 4 layers): CUDA fp32 vs CPU logits; CUDA decode vs full
    mcfg = LlamaConfig(hidden_size=hidden, num_attention_heads=h, num_key_value_heads=kv, head_dim=d,
                       intermediate_size=1536, num_hidden_layers=4, vocab_size=2000, rope_theta=100000.0)
    torch.manual_seed(1)
    tm = LlamaForCausalLM(mcfg).eval()
    mask = HeadMask(4, h, kv, ((0,), (4,), (8,), (0, 5)))
    ids = torch.randint(0, 2000, (2, 300), generator=g)
    hm_cpu = hybridize(tm, mask, gdn_kernel="torch", gdn_conv=4).eval()
    lg_ref = hm_cpu(ids).logits
    hm = hybridize(tm, mask, gdn_kernel="fla", gdn_conv=4).to(dev).eval()
    lg = hm(ids.to(dev)).logits
    res["model_cuda_fp32_vs_cpu_logits"] = err(lg, lg_ref)
    pre = hm(ids[:, :-1].to(dev), use_cache=True)
    ck = "cache" if hasattr(pre, "cache") and pre.cache is not None else "past_key_values"
    cache = getattr(pre, ck)
    step = hm(ids[:, -1:].to(dev), use_cache=True, **{ck: cache})
    res["model_cuda_decode_vs_full_last_logits"] = err(step.logits[:, -1], lg[:, -1])
    # all-FA hybrid = teacher on CUDA
    hf = hybridize(tm, HeadMask(4, h, kv, (tuple(range(h)),) * 4), fusion="none").to(dev).eval()
    res["model_cuda_all_fa_vs_teacher"] = err(hf(ids.to(dev)).logits, tm.to(dev)(ids.to(dev)).logits)
    return res



@torch.no_grad()
def block_sweep(shapes, dev, dtype, gdn_kernel, lengths=None, blocks=(8192, 16384, 32768, 65536, 1 << 17),
                graphed=False, variants=(("defaults", {}),), config=DEFAULT):
    """The hybrid layer's prefill time (ms) and peak (bytes) per InferenceConfig.gdn_block_tokens, and the all-FA
    layer's; ``graphed``: replayed from a CUDA graph, peak while capturing (:func:`_prefill_graph`), else eager;
    ``variants``: [(name, InferenceConfig changes)] (bench_timing.parse_variant) on ``config``, each timed at every
    block."""
    res = {"configs": {vname: asdict(variant_config(ch, config)) for vname, ch in variants}}
    for shape in shapes:
        hidden, h, kv, d, fa = SHAPES[shape]
        cfg = _cfg(hidden, h, kv, d)
        torch.manual_seed(0)
        mods = {"fa": HeadwiseHybridAttention(cfg, 0, tuple(range(h)), HybridOptions(fusion="none")),
                "hybrid": HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel=gdn_kernel))}
        for m in mods.values():
            use_inference(m, config)
        mods = {k: m.to(dev, dtype).eval() for k, m in mods.items()}
        rope = LlamaRotaryEmbedding(cfg).to(dev)
        for T in lengths or (32768, 131072):
            x = torch.randn(1, T, hidden, device=dev, dtype=dtype)
            pe = rope(x, torch.arange(T, device=dev)[None])
            reps = max(3, min(10, (1 << 17) // T))
            fa_call = lambda: mods["fa"](x, position_embeddings=pe)[0]  # noqa: E731
            call = lambda: mods["hybrid"](x, position_embeddings=pe)[0]  # noqa: E731
            if graphed and dev.type == "cuda":
                fa_ms, fa_peak, _ = _prefill_graph(fa_call, dev, reps, fa_call())
                row = {"fa_ms": fa_ms, "fa_peak": fa_peak}
                ref = call()  # the eager output, the caller's blocks
            else:
                row = {"fa_ms": _time(fa_call, dev, reps), "fa_peak": _peak_bytes(fa_call, dev)}
            for vname, changes in variants:
                sfx = "" if vname == "defaults" else f"[{vname}]"
                for blk in blocks:
                    with configured([mods["hybrid"]], variant_config({**changes, "gdn_block_tokens": blk}, config)):
                        if graphed and dev.type == "cuda":
                            ms, pk, e = _prefill_graph(call, dev, reps, ref)
                            row[f"hybrid_err@{blk}{sfx}"] = e
                        else:
                            ms, pk = _time(call, dev, reps), _peak_bytes(call, dev)
                    row[f"hybrid_ms@{blk}{sfx}"], row[f"hybrid_peak@{blk}{sfx}"] = ms, pk
            res[f"{shape}@{T}"] = row
            print(f"block sweep {shape}@{T}: " + " ".join(
                f"{k}={v / 2**20:.0f}MB" if "peak" in k else f"{k}={v:.3g}" for k, v in row.items()
                if isinstance(v, (int, float))), flush=True)
            del x, pe
    return res


def _versions():
    """Versions of the optional kernels (fla picks FlashQLA / tilelang for the chunked GDN on Hopper when
    the ``flash_qla`` package is there, unless FLA_FLASH_QLA=0)."""
    import importlib.metadata as md
    import os

    out = {"FLA_FLASH_QLA": os.environ.get("FLA_FLASH_QLA")}
    for name in ("fla-core", "flash-linear-attention", "flash-qla", "flash_qla", "tilelang", "flash-attn", "triton",
                 "transformers", "torch"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def _fmt_row(shape, r):
    f, hy, ra = r["fa"], r["hybrid"], r["ratio"]
    g = lambda v, s=1e3: "   -   " if v is None else f"{v * s:7.1f}"  # noqa: E731
    gr = ""
    if f.get("prefill_graph_ms") is not None:
        gr = f"| graphed {f['prefill_graph_ms']:8.3f} {hy['prefill_graph_ms']:8.3f} x{ra['prefill_graph_ms']:.2f} "
        bk = [k for k in hy if k.startswith("prefill_graph_ms@")]
        if bk:
            pk = "prefill_graph_peak_bytes@" + bk[0].split("@")[1]
            gr += (f"({bk[0].split('@')[1]}: {hy[bk[0]]:8.3f} x{ra[bk[0]]:.2f}, peak x{ra[pk]:.2f}) ")
    return (f"{shape:13s} {r['T']:6d} | prefill ms {f['prefill_ms']:8.3f} {hy['prefill_ms']:8.3f} x{ra['prefill_ms']:.2f} {gr}"
            f"| peak MB {f['prefill_peak_bytes'] / 2**20:7.1f} {hy['prefill_peak_bytes'] / 2**20:7.1f} "
            f"(teacher {r['teacher']['prefill_peak_bytes'] / 2**20:7.1f}) x{ra['prefill_peak_bytes']:.2f} "
            + (f"(held by the eager GDN graphs {hy['eager_graph_held_bytes'] / 2**20:.1f}) "
               if hy.get("eager_graph_held_bytes") else "") +
            f"| decode us graph {g(f['decode_graph_ms'])} {g(hy['decode_graph_ms'])} "
            f"x{'-' if ra['decode_graph_ms'] is None else format(ra['decode_graph_ms'], '.2f')} "
            f"eager {g(f['decode_eager_ms'])} {g(hy['decode_eager_ms'])} x{ra['decode_eager_ms']:.2f} "
            f"| cache MB {f['cache_bytes'] / 2**20:7.2f} {hy['cache_bytes'] / 2**20:7.2f} x{ra['cache_bytes']:.3f}"
            + "".join(f" | {vn} us fa {g(f.get('decode_graph_ms_' + vn))} hybrid {g(hy.get('decode_graph_ms_' + vn))}"
                      for vn in dict.fromkeys(k[len("decode_graph_ms_"):] for k in (*f, *hy)
                                              if k.startswith("decode_graph_ms_"))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--gdn-block", type=int, default=None,
                    help="InferenceConfig.gdn_block_tokens (tokens per GDN kernel call)")
    ap.add_argument("--block-sweep", action="store_true", help="time/peak of the hybrid layer per GDN block size")
    ap.add_argument("--sweep-blocks", type=int, nargs="+", default=None, help="--block-sweep's block sizes (tokens)")
    ap.add_argument("--sweep-lengths", type=int, nargs="+", default=None, help="--block-sweep's lengths")
    ap.add_argument("--sweep-graphed", action="store_true", help="--block-sweep replayed from CUDA graphs")
    ap.add_argument("--sweep-variants", nargs="+", default=None,
                    help="--block-sweep's variants, NAME:field=value,... of InferenceConfig (one named 'defaults' is "
                         "unsuffixed)")
    ap.add_argument("--no-before", action="store_true", help="skip the layer before the lean path")
    ap.add_argument("--no-layer", action="store_true", help="skip the layer benchmark")
    ap.add_argument("--no-graph-prefill", action="store_true", help="skip the CUDA-graph-replayed prefill")
    ap.add_argument("--flash-qla", action="store_true",
                    help="also time the hybrid prefill with FlashQLA's GDN forward (head_dim-128 shapes)")
    ap.add_argument("--graph-block", type=int, default=8192,
                    help="GDN block (tokens) of the second graphed hybrid prefill (0: skip it)")
    ap.add_argument("--decode-variants", action="store_true",
                    help="layer part: also time the device-position decode step")
    ap.add_argument("--variants", nargs="+", default=None,
                    help=f"layer part: only these decode variants, for both layers (implies --decode-variants): each "
                         f"one of {sorted(DECODE_VARIANTS)}, optionally with InferenceConfig fields, "
                         "e.g. one_launch:fused_out_max_d=0")
    ap.add_argument("--profile-at", type=int, nargs="*", default=[],
                    help="lengths at which to record the GPU kernels of one eager decode step (torch.profiler)")
    ap.add_argument("--model", action="store_true", help="whole SmolLM2-shaped model: hybrid vs teacher")
    ap.add_argument("--mask", default="hydrahead",
                    help="--model: the hybrid's FA heads: hydrahead (the ranked SmolLM2 mask, 30 KV groups kept), "
                         "random (34 random heads; the figures before 2026-12-01), or a HeadMask JSON file")
    ap.add_argument("--model-lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--model-batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--compile-tail", action="store_true",
                    help="model part: also time the decode step with each layer's norm + MLP compiled")
    ap.add_argument("--generate", type=int, default=0,
                    help="model part: also time transformers' greedy generate end to end: ms per new token = (wall of a "
                         "2N-token call - an N-token one) / N, decode steps graphed (with --compile-tail also a static "
                         "cache: compiled tails); layer-by-layer eager steps with N = 9")
    ap.add_argument("--generate-only", action="store_true",
                    help="model part: only the end-to-end generate timings (--generate N) of each cell")
    ap.add_argument("--model-cells", default=None,
                    help="only these (batch x length) cells of the model part, e.g. 1x8192,16x32768")
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen3-1.7b"], choices=list(SHAPES))
    ap.add_argument("--check", action="store_true", help="CUDA kernels vs the CPU reference first")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy lengths (64, 128): checks the script")
    ap.add_argument("--out", type=Path, default=None, help="directory for bench_hybrid.json")
    ap.add_argument("--graph-reps", type=int, default=200, help="CUDA-graph replays per decode timing")
    ap.add_argument("--eager-reps", type=int, default=30, help="eager decode steps per timing")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="skip the remaining (shape, length) cells once this many seconds have passed")
    a = ap.parse_args(argv)
    for v in a.variants or ():
        try:
            if parse_variant(v)[0] not in DECODE_VARIANTS:
                ap.error(f"variant {v!r}: the name before ':' must be one of {sorted(DECODE_VARIANTS)}")
        except ValueError as e:
            ap.error(str(e))
    t0 = time.perf_counter()
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # shared CPUs: one thread keeps the smoke run's timings sane
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    gdn_kernel = "fla" if (dev.type == "cuda" and fla_available()) else "torch"
    probe = torch.empty(1, device=dev, dtype=dtype)
    fa_kernel = "flash_attn" if (flash_attn_available() and flash_attn_usable(probe)) else "sdpa"
    lengths = [64, 128] if a.smoke else a.lengths
    eager_reps = 3 if a.smoke else a.eager_reps
    # the layers' InferenceConfig: the defaults, with the lean path on CPU too for --smoke (eager glue)
    config = variant_config({"gdn_block_tokens": a.gdn_block, **({"prefill": "lean", "decode": "lean"} if a.smoke else {})})
    results = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
               "dtype": str(dtype), "gdn_kernel": gdn_kernel, "fa_kernel": fa_kernel, "batch": 1,
               "layer_path": "lean (hybrid/lean.py): fused projection, compiled glue, SDPA + one GDN call per block",
               "config": asdict(config), "glue_compiled": dev.type == "cuda" and config.compile_glue,
               "low_memory_block": layer_mod.BLOCK, "splitk": splitk.launch_defaults(),
               "versions": _versions(), "bench": {}}
    print(f"device {results['device']}  torch {torch.__version__}  {dtype}  GDN kernel {gdn_kernel}  "
          f"FA kernel {fa_kernel}", flush=True)
    out_file = a.out / "bench_hybrid.json" if a.out else None

    def dump():
        results["wall_s"] = time.perf_counter() - t0
        if out_file:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            out_file.write_text(json.dumps(results, indent=2))

    if a.check and dev.type == "cuda":
        try:
            results["checks"] = checks(dev)
        except Exception:  # keep going: the benchmark is still worth having
            import traceback

            results["checks"] = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(results["checks"], indent=1), flush=True)
        dump()
    if a.block_sweep:
        kw = {"blocks": tuple(a.sweep_blocks)} if a.sweep_blocks else {}
        if a.sweep_variants:
            kw["variants"] = [parse_variant(v) for v in a.sweep_variants]
        results["block_sweep"] = block_sweep(a.shapes, dev, dtype, gdn_kernel,
                                             [64, 128] if a.smoke else a.sweep_lengths, graphed=a.sweep_graphed,
                                             config=config, **kw)
        dump()
    rows = []
    for shape in ([] if a.no_layer else a.shapes):
        for T in lengths:
            key = f"{shape}@{T}"
            if time.perf_counter() - t0 > a.budget_s:
                results["bench"][key] = {"skipped": f"time budget {a.budget_s:.0f} s spent"}
                print(f"{key}: skipped (time budget)", flush=True)
                continue
            t1 = time.perf_counter()
            try:
                r = bench_layer(shape, T, dev, dtype, gdn_kernel, graph_reps=a.graph_reps, eager_reps=eager_reps,
                                before=not a.no_before, graph_prefill=not a.no_graph_prefill,
                                graph_block=a.graph_block, flash_qla=a.flash_qla,
                                decode_variants=a.variants or a.decode_variants, profile=T in a.profile_at,
                                config=config, **({"prefill_reps": 2} if a.smoke else {}))
            except Exception:  # pragma: no cover - OOM or a kernel failure: record, go on
                import traceback

                r = {"error": traceback.format_exc()[-3000:]}
                print(r["error"], flush=True)
            r["cell_s"] = time.perf_counter() - t1
            results["bench"][key] = r
            dump()
            if "ratio" in r:
                rows.append(_fmt_row(shape, r))
                print(rows[-1], f"| parity {json.dumps(r['parity'])} | {r['cell_s']:.1f} s", flush=True)
    if a.model and dev.type != "cuda":
        print("--model needs CUDA: the whole-model part is skipped on this machine", flush=True)
        results["model"] = {"skipped": "no CUDA"}
    if a.model and dev.type == "cuda":
        from bench_hybrid_model import bench_model

        cells = None if not a.model_cells else {tuple(int(v) for v in c.split("x")) for c in a.model_cells.split(",")}
        results["model"] = bench_model(dev, dtype, [512, 1024] if a.smoke else a.model_lengths,
                                       [1, 2] if a.smoke else a.model_batches, dump=dump, results=results,
                                       graph_prefill=not a.no_graph_prefill, cells=cells, generate=a.generate,
                                       compile_tail=a.compile_tail, decode_variants=a.decode_variants,
                                       generate_only=a.generate_only, mask=a.mask)
    print("\nshape              T | prefill ms fa / hybrid | peak MB fa / hybrid (plain path) | "
          "decode step us fa / hybrid | cache MB fa / hybrid")
    print("\n".join(rows))
    dump()
    print(f"wall {results['wall_s']:.1f} s" + (f"; wrote {out_file}" if out_file else ""))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
