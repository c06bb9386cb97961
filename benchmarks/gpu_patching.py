"""Exact receiver IE on a GPU: SmolLM2-135M and a Qwen3-1.7B-shaped random model at 4K tokens.

    python benchmarks/gpu_patching.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf [--pairs 6] [--seq-len 4096]

Reports wall time for 6 pairs (fp32 and bf16), an analytic FLOP count of the work the engine does
and the implied utilization of the GPU's dense peak, bf16-vs-fp32 agreement, and a brute-force
check of a few heads (full forward with the patch, no reuse) on the GPU. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headscope.models import load_model, wrap
from headscope.patching import receiver_patching
from headscope.patching.attribution import recall_at_k
from headscope.patching.engine import Engine, head_slice
from headscope.patching.receivers import sequences
from headscope.readout import logit_diff
from headscope.tasks import niah_single

PEAK = {torch.float32: 67e12, torch.bfloat16: 989e12}  # H200 dense: fp32 (no TF32), bf16 tensor cores


def engine_flops(model, pairs) -> float:
    """Multiply-adds x2 of the engine's work: 2 full passes + suffix passes from each layer, per pair."""
    cfg = model.hf_model.config
    g = model.geometry
    d, f = g.d_model, int(cfg.intermediate_size)
    per_tok_layer = 2 * (d * g.n_heads * g.d_head * 2 + d * g.n_kv_heads * g.d_head * 2 + 3 * d * f)
    total = 0.0
    for p in pairs:
        T = p.length + p.n_answer - 1
        start = min(p.first_diff(), p.length - 1)
        S = T - start
        attn_full = sum(4 * g.n_heads * g.d_head * (t + 1) for t in range(T))  # causal QK^T and AV
        total += 2 * (g.n_layers * (T * per_tok_layer + attn_full))
        attn_suffix = sum(4 * g.n_heads * g.d_head * (start + s + 1) for s in range(S))
        for layer in range(g.n_layers):
            rows = g.n_heads
            later = g.n_layers - 1 - layer
            mlp_o = 2 * S * (3 * d * f + g.n_heads * g.d_head * d)
            total += rows * (mlp_o + later * (S * per_tok_layer + attn_suffix))
    return total


def timed(model, pairs, **kw):
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = receiver_patching(model, pairs, progress=False, **kw)
    torch.cuda.synchronize()
    return res, time.perf_counter() - t


def brute_force(model, pair, heads):
    e = Engine(model)
    clean_seq, corr_seq, read = sequences(pair)
    corr = e.run(corr_seq, read)
    out = {}
    for layer, h in heads:
        sl = head_slice(h, model.geometry.d_head)

        def override(lay, z, layer=layer, sl=sl):
            if lay == layer:
                z = z.clone()
                z[0, :, sl] = corr.z[layer][:, sl]
            return z

        out[(layer, h)] = float(logit_diff(e.run(clean_seq, read, z_override=override).logits, pair.answer, pair.counter_answer))
    return out


def run_model(name, make, pairs_fn, n_pairs, results, dtypes=(torch.float32, torch.bfloat16), min_gap=0.1):
    ies = {}
    for dt in dtypes:
        model = make(dt)
        pairs = pairs_fn(model)
        receiver_patching(model, pairs[:1], progress=False, min_gap=0.0, heads=[(0, 0)])  # warm-up
        torch.cuda.reset_peak_memory_stats()
        res, sec = timed(model, pairs, min_gap=min_gap)
        fl = engine_flops(model, pairs)
        key = f"{name}/{str(dt).replace('torch.', '')}"
        results[key] = {
            "pairs": len(pairs),
            "lengths": [p.length for p in pairs],
            "seconds": round(sec, 2),
            "seconds_per_pair": round(sec / len(pairs), 3),
            "tflop": round(fl / 1e12, 2),
            "achieved_tflops": round(fl / sec / 1e12, 1),
            "utilization_of_dense_peak": round(fl / sec / PEAK[dt], 3),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "m_clean": [round(v, 3) for v in res.m_clean.tolist()],
            "skipped": res.skipped,
        }
        if dt == torch.float32:
            heads = [(0, 0), (model.geometry.n_layers // 2, 1), (model.geometry.n_layers - 1, 2)]
            bf = brute_force(model, pairs[0], heads)
            results[key]["brute_force_max_abs_diff"] = max(abs(bf[k] - float(res.patched[0, k[0], k[1]])) for k in heads)
        ies[dt] = res
        print(key, results[key], flush=True)
        del model
        torch.cuda.empty_cache()
    if len(ies) == 2:
        a, b = ies[torch.float32], ies[torch.bfloat16]
        used = [i for i in a.used if i in b.used]
        if used:
            ma, mb = a.ie[used].mean(0), b.ie[used].mean(0)
            results[f"{name}/bf16_vs_fp32"] = {
                "max_abs_diff_mean_ie": float((ma - mb).abs().max()),
                "recall_at_10": recall_at_k(ma.numpy(), mb.numpy(), 10),
            }
            print(name, results[f"{name}/bf16_vs_fp32"], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--out", default="gpu_patching.json")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seq_len": args.seq_len}
    tok_holder = {}

    def smol(dt):
        m = load_model(args.gguf, device="cuda", dtype=dt)
        tok_holder["tok"] = m.tokenizer
        return m

    def smol_pairs(m):
        return niah_single(m.tokenizer, n_pairs=args.pairs, seq_len=args.seq_len, depth=0.5, seed=0)

    run_model("smollm2-135m", smol, smol_pairs, args.pairs, results)

    def qwen(dt):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                          tie_word_embeddings=True)
        with torch.device("cuda"):
            hf = Qwen3ForCausalLM(cfg).to(dt).eval()
        return wrap(hf, tok_holder["tok"], name="qwen3-1.7b-shape-random")

    run_model("qwen3-1.7b-shape-random", qwen, smol_pairs, args.pairs, results, min_gap=0.0)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
