"""Whole model: a SmolLM2-135M-shaped hybrid (7:1, >= 1 FA head per layer) vs its teacher, random weights.

Part of ``bench_hybrid.py --model``. Both models run through :class:`headscope.hybrid.inference.decoder.StaticDecoder`
(preallocated per-layer caches, lean attention path); the teacher is the all-FA hybrid with fusion off,
which computes the teacher's function (checked against transformers' own forward in the run). Per
(batch, T):

- prefill: tokens/s of ``prefill`` over B sequences of T tokens (fills the caches), and its peak memory
  above the weights and the preallocated caches (``torch.cuda.max_memory_allocated``); the same prefill
  replayed from a CUDA graph (``StaticDecoder.prefill_graphed``: no host time per layer), its tokens/s,
  the peak allocated while capturing it and its output against the eager prefill's;
- decode: one step of B tokens with T cached, replayed from a CUDA graph: tokens/s = B / step time;
- ``--compile-tail``: the graphed decode step again with ``StaticDecoder(compile_tail=True)`` (each layer's
  norms + MLP compiled), its time and its logits against the eager-tail step's;
- the decode options are the models' InferenceConfig (the defaults; recorded as ``config``; the variants they
  replaced: ``docs/performance-variants.md``); the ratio ``decode_tok_s_best_each`` compares each model's fastest
  step;
- ``--generate N``: end-to-end greedy ``model.generate`` (transformers' own), ms per new token = (wall of a
  2N-token call − wall of an N-token call) / N after a warm-up call of each: its default (decode steps replayed from
  a CUDA graph of the whole step, eager layer tails: ``generate_ms_per_token_graph``), layer-by-layer eager steps
  (``InferenceConfig.decode_graphs="never"``, N = 9: ``generate_ms_per_token_eager``), and with ``--compile-tail``
  a static cache (``cache_implementation="static"``: compiled tails and the layer-tail kernel, the library's fastest
  decode: ``generate_ms_per_token_graph_compiled_tail``); ``bench_generate.py`` compares the teacher's transformers
  model under the same calls;
- cache bytes per sequence at T; concurrent sequences of 32K tokens that fit in 100 GiB next to the
  weights: floor((100 GiB − weights) / (cache per sequence at 32K + decode activations per sequence)).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from headscope.hybrid import hybridize
from headscope.hybrid.inference import inference_config, use_inference
from headscope.hybrid.inference.decoder import StaticDecoder
from headscope.masks import HeadMask

from bench_timing import time_ms

GIB = 1 << 30


def smollm2_config(layers: int = 30) -> LlamaConfig:
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                      rope_theta=100000.0, max_position_embeddings=1 << 17, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    return cfg


def mask_7to1(layers: int, heads: int = 9, kv: int = 3, seed: int = 0) -> HeadMask:
    """A random 7:1 mask: ``max(layers, round(layers * heads / 8))`` FA heads (SmolLM2: 34 of 270; the Qwen3-1.7B
    shape: 56 of 448), one random head per layer, the rest in random layers."""
    g = torch.Generator().manual_seed(seed)
    n_fa = max(layers, round(layers * heads / 8))
    fa = [{int(torch.randint(heads, (1,), generator=g))} for _ in range(layers)]
    while sum(len(s) for s in fa) < n_fa:
        fa[int(torch.randint(layers, (1,), generator=g))].add(int(torch.randint(heads, (1,), generator=g)))
    return HeadMask(layers, heads, kv, tuple(tuple(sorted(s)) for s in fa))


HYDRAHEAD_MASK = Path(__file__).resolve().parent.parent / "experiments" / "conversion-smollm2-50m" / "masks" / "hydrahead.json"
MASKS = ("hydrahead", "random")


def hybrid_mask(which: str, layers: int = 30, heads: int = 9, kv: int = 3) -> HeadMask:
    """The 7:1 hybrid's FA heads: ``"hydrahead"`` — the mask that headscope's causal ranking chose for
    SmolLM2-135M-Instruct and that the 50M-token conversion trained (``experiments/conversion-smollm2-50m/masks/
    hydrahead.json``: 34 FA heads, one KV group kept per layer, 30 of 90); ``"random"`` — :func:`mask_7to1`
    (34 heads at random, >= 1 per layer: 34 KV groups kept); or a path to a HeadMask JSON file. A decode step
    reads the K/V cache of every KV group that holds an FA head, so the kept groups, not the FA heads, set the
    split-K attention's time.

    ``heads`` / ``kv``: query and KV heads per layer (SmolLM2's 9 / 3 by default; e.g. 16 / 8 for the
    Qwen3-1.7B shape, where only ``"random"`` or a file of that geometry applies).

    Raises:
        ValueError: an unknown name, ``"hydrahead"`` at another geometry than SmolLM2's (30 layers × 9 heads,
            3 KV heads), or a mask file of another geometry.
    """
    if which == "random":
        return mask_7to1(layers, heads, kv)
    if which == "hydrahead":
        if (layers, heads, kv) != (30, 9, 3):
            raise ValueError(f"the hydrahead mask is SmolLM2's (30 layers x 9 heads, 3 KV heads), not {layers} x "
                             f"{heads}, {kv}; use --mask random")
        return HeadMask.from_json(HYDRAHEAD_MASK)
    if Path(which).is_file():
        m = HeadMask.from_json(which)
        m.check_geometry(layers, heads, kv)
        return m
    raise ValueError(f"mask {which!r}: want one of {MASKS} or a HeadMask JSON file")


def _ms(fn, reps):
    """Mean ms per call on the current CUDA device after one warm-up call (benchmarks/bench_timing.py)."""
    return time_ms(fn, torch.device("cuda"), reps, warmup=1)


GENERATE = {"graph": {}, "graph_compiled_tail": {"cache_implementation": "static"}, "eager": {}}


@torch.no_grad()
def _generate_ms_per_token(model, B, T, vocab, n, setting):
    """End-to-end greedy ``model.generate`` of B random prompts of T tokens under ``setting`` (a key of
    :data:`GENERATE`; ``"eager"``: ``InferenceConfig.decode_graphs="never"``): ms per new token = (wall of a 2n-token
    call − wall of an n-token call) / n, each after a warm-up call of its own shape (compilation, capture and prefill
    cancel out)."""
    ids = torch.randint(0, vocab, (B, T), device="cuda")
    cfg = inference_config(model)
    if setting == "eager":
        use_inference(model, replace(cfg, decode_graphs="never"))
    walls = []
    try:
        for k in (n, 2 * n):
            for _ in range(2):  # warm-up, then the timed call
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                               do_sample=False, pad_token_id=0, **GENERATE[setting])
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
    finally:
        use_inference(model, cfg)
    return (walls[1] - walls[0]) / n * 1e3


def _variants(compile_tail: bool, decode_variants: bool = False) -> dict:
    """Decode-step variants timed beside the default: name -> compile_tail (``decode_variants``: kept for the
    command line; the decode options it chose between are the defaults now)."""
    return {"compiled_tail": True} if compile_tail else {}


def bench_model(dev, dtype, lengths, batches, dump=None, results=None, layers=30, graph_reps=30, graph_prefill=True,
                cells=None, generate=0, compile_tail=False, decode_variants=False, generate_only=False, mask="hydrahead"):
    cfg = smollm2_config(layers)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in teacher.parameters():  # weights of a trained model's scale (default init is near-zero)
            p.normal_(std=0.02)
    mask_name, mask = mask, hybrid_mask(mask, layers)
    models = {
        "teacher": hybridize(teacher, HeadMask(layers, 9, 3, (tuple(range(9)),) * layers), fusion="none").to(dev, dtype).eval(),
        "hybrid": hybridize(teacher, mask).to(dev, dtype).eval(),
    }
    weights = sum(p.numel() * p.element_size() for p in models["hybrid"].parameters())
    out = {"layers": layers, "mask": mask_name, "kv_groups_kept": sum(len(g) for g in mask.kv_groups()), "n_fa_heads": mask.n_fa, "fa_heads": [list(h) for h in mask.fa_heads],
           "weights_bytes": {k: sum(p.numel() * p.element_size() for p in m.parameters()) for k, m in models.items()},
           "config": asdict(inference_config(models["hybrid"])), "cells": {}}
    # parity: the all-FA hybrid = transformers' teacher forward; StaticDecoder prefill = the model's forward
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device=dev, generator=torch.Generator(dev).manual_seed(0))
    teacher = teacher.to(dev)
    ref = teacher(ids).logits[:, -1].float()
    dec = StaticDecoder(models["teacher"], 2, 300)
    got = dec.prefill(ids).float()
    out["parity"] = {"teacher_static_vs_transformers_last_logits": (got - ref).abs().max().item() / ref.abs().max().item()}
    # transformers' own teacher prefill at B = 1 for reference (SDPA, no cache)
    teacher_hf_ms = {}
    for T in lengths:
        x = torch.randint(0, cfg.vocab_size, (1, T), device=dev)
        teacher_hf_ms[T] = _ms(lambda: teacher.model(x), 2)
    out["transformers_teacher_prefill_ms_b1"] = teacher_hf_ms
    del teacher, dec
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    for B in batches:
        for T in lengths:
            if cells is not None and (B, T) not in cells:
                continue
            cell = {name: {} for name in models}
            for name, model in ({} if generate_only else models).items():
                dec = StaticDecoder(model, B, T + 1)
                ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                dec.prefill(ids)  # warm-up (compiles the glue on first use)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                reps = 1 if B * T >= (1 << 19) else 2
                ms = _ms(lambda: dec.prefill(ids), reps)
                peak = torch.cuda.max_memory_allocated() - base
                gcell = {}
                if graph_prefill:  # the same prefill replayed from a CUDA graph (no host time per layer)
                    ref = dec.prefill(ids).float()
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base_g = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    dec.capture_prefill(ids, warmup=0)  # warmed up by the eager prefills above
                    torch.cuda.synchronize()
                    g_peak = torch.cuda.max_memory_allocated() - base_g
                    got = dec.prefill_graphed(ids).float()
                    g_ms = _ms(lambda: dec.prefill_graphed(ids), max(reps, 3))
                    gcell = {"prefill_graph_ms": g_ms, "prefill_graph_tok_s": B * T / g_ms * 1e3,
                             "prefill_graph_peak_bytes": g_peak,
                             "prefill_graph_vs_eager": (got - ref).abs().max().item() / ref.abs().max().item()}
                    dec._pf_graph = dec._pf_out = None
                    del ref, got
                    torch.cuda.empty_cache()
                nxt = ids[:, -1:].contiguous()
                static_logits = dec.capture(nxt)
                step_ms = _ms(dec.replay, graph_reps)
                for vn, tail in _variants(compile_tail, decode_variants).items():
                    # the same graphed step with each layer's norm + MLP tail compiled
                    try:
                        dc2 = StaticDecoder(model, B, T + 1, compile_tail=tail)
                        dc2.prefill(ids)
                        got = dc2.capture(nxt)
                        gcell[f"decode_step_ms_{vn}"] = _ms(dc2.replay, graph_reps)
                        dc2.replay()
                        dec.replay()
                        torch.cuda.synchronize()
                        ref = static_logits.float()
                        gcell[f"{vn}_vs_eager_step"] = (got.float() - ref).abs().max().item() / ref.abs().max().item()
                        del dc2, got, ref
                    except Exception as e:  # noqa: BLE001 - record and go on
                        gcell[f"decode_{vn}_error"] = f"{type(e).__name__}: {e}"[:500]
                    torch.cuda.empty_cache()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base2 = torch.cuda.memory_allocated()
                dec.replay()
                torch.cuda.synchronize()
                step_peak = torch.cuda.max_memory_allocated() - base2
                cell[name] |= {"prefill_ms": ms, "prefill_tok_s": B * T / ms * 1e3, "prefill_peak_bytes": peak,
                              "decode_step_ms": step_ms, "decode_tok_s": B / step_ms * 1e3,
                              "cache_bytes_per_seq": dec.cache_bytes(T) // B, "decode_act_bytes": step_peak, **gcell}
                del dec, ids
                torch.cuda.empty_cache()
            if generate:  # end-to-end decoding through transformers' generate: graphed steps vs eager steps
                for name, model in models.items():
                    cell[name]["generate_ms_per_token_graph"] = _generate_ms_per_token(model, B, T, cfg.vocab_size, generate,
                                                                                       "graph")
                    if compile_tail:  # a static cache: the library's fastest decode path (compiled tail, tail kernel)
                        cell[name]["generate_ms_per_token_graph_compiled_tail"] = _generate_ms_per_token(
                            model, B, T, cfg.vocab_size, generate, "graph_compiled_tail")
                        print(f"model B={B:2d} T={T:6d} {name}: generate ms/token graphed, compiled tail: "
                              f"{cell[name]['generate_ms_per_token_graph_compiled_tail']:.2f}", flush=True)
                    cell[name]["generate_ms_per_token_eager"] = _generate_ms_per_token(model, B, T, cfg.vocab_size, 9,
                                                                                       "eager")
                    print(f"model B={B:2d} T={T:6d} {name}: generate ms/token graphed "
                          f"{cell[name]['generate_ms_per_token_graph']:.2f}, eager {cell[name]['generate_ms_per_token_eager']:.2f}",
                          flush=True)
                    torch.cuda.empty_cache()
            t, h = cell["teacher"], cell["hybrid"]
            if generate_only:
                cell["ratio"] = {k: t[k] / h[k] for k in h if k.startswith("generate_ms") and k in t}
                print(f"model B={B:2d} T={T:6d} | generate speed-up hybrid vs teacher {json.dumps(cell['ratio'])}", flush=True)
                out["cells"][f"B{B}@{T}"] = cell
                if results is not None and dump is not None:
                    results["model"] = out
                    dump()
                continue
            cell["ratio"] = {"prefill_tok_s": h["prefill_tok_s"] / t["prefill_tok_s"],
                             "decode_tok_s": h["decode_tok_s"] / t["decode_tok_s"],
                             "prefill_peak": h["prefill_peak_bytes"] / t["prefill_peak_bytes"],
                             "cache_per_seq": h["cache_bytes_per_seq"] / t["cache_bytes_per_seq"]}
            for vn in _variants(compile_tail, decode_variants):
                if f"decode_step_ms_{vn}" in h and f"decode_step_ms_{vn}" in t:
                    cell["ratio"][f"decode_tok_s_{vn}"] = t[f"decode_step_ms_{vn}"] / h[f"decode_step_ms_{vn}"]
                    print(f"model B={B:2d} T={T:6d} | decode step ms, {vn}: teacher {t[f'decode_step_ms_{vn}']:.3f} "
                          f"hybrid {h[f'decode_step_ms_{vn}']:.3f} x{cell['ratio'][f'decode_tok_s_{vn}']:.2f} "
                          f"(default {t['decode_step_ms']:.3f} / {h['decode_step_ms']:.3f})", flush=True)
            steps = {n: min([c[k] for k in c if k.startswith("decode_step_ms")]) for n, c in (("teacher", t), ("hybrid", h))}
            cell["ratio"]["decode_tok_s_best_each"] = steps["teacher"] / steps["hybrid"]  # each model's fastest step
            if "prefill_graph_tok_s" in h:
                cell["ratio"]["prefill_graph_tok_s"] = h["prefill_graph_tok_s"] / t["prefill_graph_tok_s"]
                cell["ratio"]["prefill_graph_peak"] = h["prefill_graph_peak_bytes"] / t["prefill_graph_peak_bytes"]
                print(f"model B={B:2d} T={T:6d} | graphed prefill tok/s teacher {t['prefill_graph_tok_s']:10.0f} hybrid "
                      f"{h['prefill_graph_tok_s']:10.0f} x{cell['ratio']['prefill_graph_tok_s']:.2f} | peak GB "
                      f"{t['prefill_graph_peak_bytes'] / 1e9:6.2f} {h['prefill_graph_peak_bytes'] / 1e9:6.2f}", flush=True)
            out["cells"][f"B{B}@{T}"] = cell
            print(f"model B={B:2d} T={T:6d} | prefill tok/s teacher {t['prefill_tok_s']:10.0f} hybrid "
                  f"{h['prefill_tok_s']:10.0f} x{cell['ratio']['prefill_tok_s']:.2f} | decode tok/s "
                  f"{t['decode_tok_s']:8.0f} {h['decode_tok_s']:8.0f} x{cell['ratio']['decode_tok_s']:.2f} | "
                  f"peak GB {t['prefill_peak_bytes'] / 1e9:6.2f} {h['prefill_peak_bytes'] / 1e9:6.2f} | cache MB/seq "
                  f"{t['cache_bytes_per_seq'] / 2**20:7.1f} {h['cache_bytes_per_seq'] / 2**20:7.1f} "
                  f"| {time.perf_counter() - t0:.0f} s", flush=True)
            if results is not None and dump is not None:
                results["model"] = out
                dump()
    out["concurrent_32k_in_100GiB"] = concurrency(models, out)
    del weights
    return out


def concurrency(models, out, length=32768, budget=100 * GIB):
    """Sequences of ``length`` tokens whose caches fit in ``budget`` next to the weights: cache bytes per
    sequence from the per-layer cache shapes (K/V of the kept groups per token + fixed GDN state), plus the
    largest measured decode activations per sequence (0 when no cell ran)."""
    conc = {}
    for name, model in models.items():
        dec = StaticDecoder(model, 1, 1)
        per_seq = sum(2 * c.k[0, :, 0].numel() * c.k.element_size() * length for c in dec.caches if c.k is not None)
        per_seq += sum(t.numel() * t.element_size() for c in dec.caches for t in (c.S, c.conv) if t is not None)
        act = max((c.get(name, {}).get("decode_act_bytes", 0) / max(int(k[1:].split("@")[0]), 1)
                   for k, c in out.get("cells", {}).items()), default=0)
        w = sum(p.numel() * p.element_size() for p in model.parameters())
        conc[name] = {"cache_bytes_per_seq": per_seq, "decode_act_bytes_per_seq": act, "weights_bytes": w,
                      "sequences": int((budget - w) // (per_seq + act))}
        del dec
    conc["ratio"] = conc["hybrid"]["sequences"] / conc["teacher"]["sequences"]
    print(f"concurrent {length}-token sequences in {budget / GIB:.0f} GiB: teacher {conc['teacher']['sequences']}, "
          f"hybrid {conc['hybrid']['sequences']} (x{conc['ratio']:.2f})", flush=True)
    return conc
