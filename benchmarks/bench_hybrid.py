"""One head-wise hybrid attention layer (7:1, >= 1 FA head per layer) against the all-FA teacher layer.

Measures, in one run and one process, for B = 1 and bf16 on CUDA:
- prefill: forward time of the whole attention module (projections included) and its peak extra memory;
- decoding: time of one decode step with a cache holding T tokens, and the cache's bytes;
and prints hybrid / teacher ratios (timings are only meaningful as ratios within one run).

``--check`` first compares the CUDA kernels with the CPU reference (fla chunk / fused recurrent vs the
exact chunked PyTorch form; a whole hybrid layer and a small hybrid model on CUDA vs CPU).

    python benchmarks/bench_hybrid.py --check --lengths 4096 16384 32768 65536 --out results.json
    python benchmarks/bench_hybrid.py --smoke      # CPU, tiny lengths, torch kernels: checks the script
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from headscope.hybrid import HeadwiseHybridAttention, HybridOptions, hybridize
from headscope.hybrid.gdn import gdn_chunked_torch, gated_delta_rule
from headscope.masks import HeadMask

SHAPES = {
    # name: (hidden, q heads, kv heads, head_dim, FA heads of the layer at 7:1 with >= 1 per layer)
    "smollm2-135m": (576, 9, 3, 64, (0,)),
    "qwen3-1.7b": (2048, 16, 8, 128, (0, 1)),
}


def _cfg(hidden, h, kv, d):
    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=h, num_key_value_heads=kv, head_dim=d,
                      intermediate_size=4 * hidden, num_hidden_layers=1, vocab_size=1000,
                      max_position_embeddings=1 << 18, rope_theta=100000.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def _cache_kw(module):
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, dev, reps, warmup=2):
    for _ in range(warmup):
        fn()
    _sync(dev)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def _cache_bytes(cache):
    n = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
        for t in getattr(layer, "_headscope_gdn_state", {}).values():
            n += t.numel() * t.element_size()
    return n


@torch.no_grad()
def bench_layer(shape, T, dev, dtype, kernel, decode_steps=20):
    hidden, h, kv, d, fa = SHAPES[shape]
    cfg = _cfg(hidden, h, kv, d)
    torch.manual_seed(0)
    teacher = LlamaAttention(cfg, 0)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hybrid = HeadwiseHybridAttention(cfg, 0, fa, HybridOptions(gdn_kernel=kernel))
    hybrid.migrate_from(teacher)
    teacher, hybrid = teacher.to(dev, dtype).eval(), hybrid.to(dev, dtype).eval()
    rope = LlamaRotaryEmbedding(cfg).to(dev)
    x = torch.randn(1, T, hidden, device=dev, dtype=dtype)
    pe = rope(x, torch.arange(T, device=dev)[None])
    x1 = torch.randn(1, 1, hidden, device=dev, dtype=dtype)
    pe1 = rope(x1, torch.tensor([[T]], device=dev))
    reps = max(2, min(20, (1 << 16) // T * 2))
    out = {}
    for name, mod in (("fa", teacher), ("hybrid", hybrid)):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ms = _time(lambda: mod(x, position_embeddings=pe, attention_mask=None), dev, reps)
        peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else 0
        cache = DynamicCache()
        mod(x, position_embeddings=pe, attention_mask=None, **{_cache_kw(mod): cache})
        cb = _cache_bytes(cache)

        def step():
            mod(x1, position_embeddings=pe1, attention_mask=None, **{_cache_kw(mod): cache})

        dms = _time(step, dev, decode_steps, warmup=2)
        out[name] = {"prefill_ms": ms, "prefill_peak_bytes": peak, "decode_ms": dms, "cache_bytes": cb}
        del cache
    out["ratio"] = {k: out["hybrid"][k] / out["fa"][k] if out["fa"][k] else float("nan") for k in out["fa"]}
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
    cpu_layer.migrate_from(teacher)
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--check", action="store_true", help="CUDA kernels vs CPU reference first")
    ap.add_argument("--smoke", action="store_true", help="CPU, torch kernels, tiny lengths")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    kernel = "torch" if dev.type == "cpu" else "fla"
    lengths = [256, 512] if a.smoke else a.lengths
    results = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
               "dtype": str(dtype), "kernel": kernel, "bench": {}}

    def dump():
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(results, indent=2))

    if a.check and dev.type == "cuda":
        try:
            results["checks"] = checks(dev)
        except Exception as e:  # keep going: the benchmark is still worth having
            import traceback

            results["checks"] = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(results["checks"], indent=1), flush=True)
        dump()
    for shape in a.shapes:
        for T in lengths:
            try:
                r = bench_layer(shape, T, dev, dtype, kernel)
            except Exception as e:  # pragma: no cover - OOM or a kernel failure: record, go on
                import traceback

                r = {"error": traceback.format_exc()[-2000:]}
                print(r["error"], flush=True)
            results["bench"][f"{shape}@{T}"] = r
            dump()
            if "ratio" in r:
                print(f"{shape:13s} T={T:6d}  FA prefill {r['fa']['prefill_ms']:8.3f} ms  hybrid "
                      f"{r['hybrid']['prefill_ms']:8.3f} ms  ratio {r['ratio']['prefill_ms']:.3f} | decode ratio "
                      f"{r['ratio']['decode_ms']:.3f} | peak mem ratio {r['ratio']['prefill_peak_bytes']:.3f} | "
                      f"cache ratio {r['ratio']['cache_bytes']:.3f}", flush=True)
    dump()
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
