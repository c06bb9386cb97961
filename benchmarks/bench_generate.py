"""transformers' own ``generate``: a head-wise hybrid against its teacher, same arguments, ms per new token.

The issue-39 table: SmolLM2-135M-shaped models with random weights in bf16 on one GPU, the ranked 7:1 mask
(``experiments/conversion-smollm2-50m/masks/hydrahead.json``), greedy, batch 1 and 16, 8K and 32K prompts, under
two settings of transformers' ``generate``:

- ``default``: ``model.generate(ids, max_new_tokens=n, do_sample=False)`` (the teacher: a ``DynamicCache`` and eager
  steps; the hybrid: its growing ``HybridCache``, the lean prefill and eager lean decode steps);
- ``static``: the same with ``cache_implementation="static"`` (the teacher: a ``StaticCache`` and transformers'
  automatic ``torch.compile`` of the decode forward, CUDA graphs through ``mode="reduce-overhead"``; the hybrid: a
  static ``HybridCache`` whose decode steps replay one captured CUDA graph, ``StaticDecoder.step_replayed``).

``--family mistral`` / ``gemma3`` / ``gpt-neox`` (issue 61): random weights of Mistral-7B's layer shape (sliding window
4096) at ``--layers`` depth (default 8), of Gemma 3 270M's config (18 layers, 5 sliding (window 512) : 1 full, head_dim
256) or of Pythia-160M's (12 layers, 12 heads, head_dim 64, rotary on a quarter of each head, parallel residual), each
with a random 7:1 mask (``mask_7to1``: one FA head per layer at least).

ms per new token = (wall time of a call making 2N tokens − a call making N) / N, both after a warm-up call of the
same shape (compilation, capture and prefill cancel out), the minimum over ``--reps`` repetitions; every call is
forced to make all its tokens (``min_new_tokens``). ``first_call_ms``: the wall time of each model's first call of a
cell (N tokens: compile, capture and autotune of that shape in this process, the prefill included). The hybrid's tokens are checked first, on a short prompt, against
its cache-free forward teacher-forced on them, in the run's dtype and in fp32 (``check_tokens``). Writes one JSON
with each cell, the ratio hybrid / teacher (< 1: the hybrid is faster), the InferenceConfig and versions.

    python benchmarks/bench_generate.py --out benchmarks/results/h200_generate_api.json
    python benchmarks/bench_generate.py --family gemma3 --batches 1 --lengths 8192 --out gemma3_generate.json
    python benchmarks/bench_generate.py --family gpt-neox --out gpt_neox_generate.json
    python benchmarks/bench_generate.py --smoke            # CPU, tiny shape, < 1 min
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, MistralConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hybrid_model import hybrid_mask, mask_7to1, smollm2_config  # noqa: E402

from headscope.arch.random_models import hybrid_families  # noqa: E402
from headscope.hybrid import hybridize  # noqa: E402
from headscope.hybrid.inference import inference_config  # noqa: E402
from headscope.masks import HeadMask  # noqa: E402

SETTINGS = {"default": {}, "static": {"cache_implementation": "static"}}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def _gen(model, ids, n, setting):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, **SETTINGS[setting])


@torch.no_grad()
def ms_per_token(model, ids, n, setting, reps):
    """Minimum over ``reps`` of (wall ms of a 2n-token generate − an n-token one) / n, after one warm-up each."""
    dev = ids.device
    best = float("inf")
    walls = {}
    for k in (n, 2 * n):  # warm-up: compile / capture / autotune of this shape (the first call timed)
        _sync(dev)
        t = time.perf_counter()
        _gen(model, ids, k, setting)
        _sync(dev)
        walls.setdefault("first_call", (time.perf_counter() - t) * 1e3)
    for _ in range(reps):
        for k in (n, 2 * n):
            _sync(dev)
            t = time.perf_counter()
            out = _gen(model, ids, k, setting)
            _sync(dev)
            walls[k] = (time.perf_counter() - t) * 1e3
            assert out.shape[1] == ids.shape[1] + k, out.shape
        best = min(best, (walls[2 * n] - walls[n]) / n)
    return best, walls


@torch.no_grad()
def check_tokens(model, ids, n):
    """The hybrid's generate (each setting) against its own cache-free forward, teacher-forced on what it generated.

    For every generated token the cache-free forward (``use_cache=False``, the reference path) is run on the
    generated sequence; a step *differs* when its argmax is not the generated token (teacher-forced, so one flip
    does not cascade into the later steps). ``max_margin`` is the largest (max logit − logit of the generated
    token) of the cache-free forward over all steps: 0 where every step agrees, and at a differing step the size
    of the near-tie it fell on (in logits). Returns ``{setting: {"steps": k, "differing": d, "max_margin": m}}``.
    """
    T = ids.shape[1]
    res = {}
    for s in SETTINGS:
        gen = _gen(model, ids, n, s)
        logits = model(gen[:, :-1], use_cache=False).logits[:, T - 1:].float()  # [B, n, V]: predicts gen[:, T:]
        got = gen[:, T:]
        margin = logits.max(-1).values - logits.gather(-1, got[..., None])[..., 0]
        res[s] = {"steps": int(got.numel()), "differing": int((logits.argmax(-1) != got).sum()),
                  "max_margin": round(float(margin.max()), 5)}
    return res


def family_config(family: str, layers: int) -> tuple:
    """(config, 7:1 mask, description) of a ``--family`` on the GPU (random weights; sdpa attention)."""
    if family == "smollm2":
        return smollm2_config(), None, "SmolLM2-135M (30 x 9 heads, 3 KV, d 64)"
    if family == "mistral":
        cfg = MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=32000, sliding_window=4096,
                            max_position_embeddings=1 << 17, rope_theta=10000.0)
        what = f"Mistral-7B layer shape x {layers} layers (32 heads, 8 KV, d 128, sliding window 4096)"
    elif family == "gpt-neox":
        cfg = GPTNeoXConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                            vocab_size=50304, rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
                            max_position_embeddings=1 << 17, bos_token_id=0, eos_token_id=0)
        what = "Pythia-160M config (12 layers, 12 heads, d 64, rotary 0.25, parallel residual)"
    else:
        cfg = Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                               query_pre_attn_scalar=256, rope_theta=1e6, max_position_embeddings=1 << 17,
                               layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                            for i in range(18)])
        what = "Gemma 3 270M config (18 layers, 5 sliding (512) : 1 full, 4 heads, 1 KV, d 256)"
    cfg._attn_implementation = "sdpa"
    H = cfg.num_attention_heads
    KV = getattr(cfg, "num_key_value_heads", None) or H
    return cfg, mask_7to1(cfg.num_hidden_layers, H, KV), what


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--new-tokens", type=int, default=32, help="N: calls of N and 2N new tokens")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--mask", default="hydrahead")
    ap.add_argument("--family", default="smollm2", choices=["smollm2", "mistral", "gemma3", "gpt-neox"])
    ap.add_argument("--layers", type=int, default=8, help="--family mistral: decoder layers")
    ap.add_argument("--smoke", action="store_true", help="CPU, 4-layer tiny shape, 64-token prompts")
    ap.add_argument("--out", default="h200_generate_api.json")
    args = ap.parse_args()
    if args.smoke:
        dev, dtype, what = torch.device("cpu"), torch.float32, "tiny (smoke)"
        if args.family == "smollm2":
            cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096)
            cfg._attn_implementation = "sdpa"
        else:  # the tests' tiny model of the family (Mistral: window 24; Gemma 3: window 8, 3 layers)
            cfg = hybrid_families()[{"mistral": "mistral_sw", "gpt-neox": "gpt_neox"}.get(args.family, args.family)](
                128, 0).config
        L, H = cfg.num_hidden_layers, cfg.num_attention_heads
        KV = getattr(cfg, "num_key_value_heads", None) or H
        mask = HeadMask(4, 4, 2, ((0,), (1,), (2, 3), (0,))) if args.family == "smollm2" else mask_7to1(L, H, KV)
        args.batches, args.lengths, args.new_tokens, args.reps = [1, 2], [64], 4, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_generate.py times CUDA generate: run it on a GPU host, or --smoke on the CPU")
        dev, dtype = torch.device("cuda"), torch.bfloat16
        cfg, mask, what = family_config(args.family, args.layers)
        mask = mask or hybrid_mask(args.mask)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    hybrid = hybridize(teacher, mask).to(dev, dtype).eval()
    teacher = teacher.to(dev, dtype)
    g = torch.Generator().manual_seed(1)
    res = {"what": "transformers generate, ms per new token (2N - N tokens)/N, hybrid vs teacher, same arguments",
           "shape": what, "family": args.family,
           "mask": (args.mask if args.family == "smollm2" else "random 7:1") if not args.smoke else "tiny",
           "n_fa_heads": sum(len(h) for h in mask.fa_heads),
           "dtype": str(dtype), "new_tokens": args.new_tokens, "reps": args.reps, "settings": SETTINGS,
           "inference_config": asdict(inference_config(hybrid)),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(),
                        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()},
           "cells": []}
    short = torch.randint(1, cfg.vocab_size, (2, 48), generator=g).to(dev)
    res["check_tokens"] = {str(dtype): check_tokens(hybrid, short, 8)}
    if dtype != torch.float32:  # the same check in fp32: the near-ties of bf16 rounding gone, every step must agree
        torch.manual_seed(0)
        hybrid32 = hybridize(AutoModelForCausalLM.from_config(cfg).eval(), mask).to(dev, torch.float32).eval()
        res["check_tokens"]["torch.float32"] = check_tokens(hybrid32, short, 8)
        del hybrid32
    print("generate vs the cache-free forward, teacher-forced:", res["check_tokens"], flush=True)
    for setting in args.settings:
        for T in sorted(args.lengths):
            for B in args.batches:
                ids = torch.randint(1, cfg.vocab_size, (B, T), generator=g).to(dev)
                cell = {"setting": setting, "batch": B, "prompt": T}
                for name, m in (("teacher", teacher), ("hybrid", hybrid)):
                    ms, walls = ms_per_token(m, ids, args.new_tokens, setting, args.reps)
                    cell[f"{name}_ms_per_token"] = round(ms, 3)
                    cell[f"{name}_first_call_ms"] = round(walls.pop("first_call"), 1)
                    cell[f"{name}_wall_ms"] = {str(k): round(v, 1) for k, v in walls.items()}
                cell["hybrid_over_teacher"] = round(cell["hybrid_ms_per_token"] / cell["teacher_ms_per_token"], 3)
                res["cells"].append(cell)
                print(json.dumps(cell), flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                Path(args.out).write_text(json.dumps(res, indent=1))  # saved as it goes
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
