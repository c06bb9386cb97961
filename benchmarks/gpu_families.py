"""The fast engine on a GPU for every adapter family: self-check, exact receiver IE vs brute force, speed.

    python benchmarks/gpu_families.py --tokenizer DIR [--shape 8,512,8,4] [--seq-len 1024] [--out FILE]

For a random model of each family (``headscope.arch.random_models``) on CUDA in fp32: the engine's
build-time self-check, exact receiver patching of all heads for one niah_single pair, and a brute-force
check of a sample of heads (a full forward of the model itself with a forward-pre-hook on the attention
output projection that writes the corrupted run's hook_z slice: no engine code involved). Reports the
largest difference, the engine's time for all heads and the brute-force time per head (ratio = how many
times faster the engine is per head). ``--tokenizer``: a saved Hugging Face tokenizer directory
(nothing is downloaded; SmolLM2's tokenizer works).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headscope.arch import attention_out_module
from headscope.arch.random_models import FAMILIES
from headscope.models import random_family
from headscope.patching import receiver_patching
from headscope.patching.engine import Engine
from headscope.patching.receivers import sequences
from headscope.readout import logit_diff
from headscope.tasks import niah_single


@torch.no_grad()
def brute(model, pair, heads):
    """Noising patched metric of each (layer, head) by a full forward with a pre-hook on o_proj."""
    hf, g = model.hf_model, model.geometry
    clean, corr, read = sequences(pair)
    dev = model.device
    zc = {}
    hooks = [attention_out_module(hf, l).register_forward_pre_hook(
        lambda m, a, l=l: zc.__setitem__(l, a[0].detach().clone())) for l in range(g.n_layers)]
    hf(corr[None].to(dev), use_cache=False)
    for h in hooks:
        h.remove()
    out = []
    for layer, head in heads:
        sl = slice(head * g.d_head, (head + 1) * g.d_head)

        def pre(m, a, layer=layer):
            z = a[0].clone()
            z[..., sl] = zc[layer][..., sl]
            return (z,)

        hk = attention_out_module(hf, layer).register_forward_pre_hook(pre)
        try:
            logits = hf(clean[None].to(dev), use_cache=False).logits[0, read]
        finally:
            hk.remove()
        out.append(float(logit_diff(logits, pair.answer, pair.counter_answer)))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", default="8,512,8,4")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--families", default="all")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    shape = tuple(int(x) for x in args.shape.split(","))
    names = sorted(FAMILIES) if args.families == "all" else args.families.split(",")
    pair = niah_single(tok, n_pairs=1, seq_len=args.seq_len, depth=0.5, seed=0)
    rows = []
    for name in names:
        row: dict = {"family": name}
        try:
            lm = random_family(name, tok, seed=0, shape=shape)
            lm.hf_model.to(args.device)
            lm.device = torch.device(args.device)
            row["self_check"] = Engine(lm).self_check()
            receiver_patching(lm, pair, min_gap=0.0, progress=False, heads=[(0, 0)], path="fast")  # warm-up
            sync()
            t = time.perf_counter()
            res = receiver_patching(lm, pair, min_gap=0.0, progress=False, path="fast")
            sync()
            row["engine_s_all_heads"] = time.perf_counter() - t
            g = lm.geometry
            sample = [(l, (3 * l) % g.n_heads) for l in range(g.n_layers)]
            sync()
            t = time.perf_counter()
            ref = brute(lm, pair[0], sample)
            sync()
            row["brute_s_per_head"] = (time.perf_counter() - t) / len(sample)
            row["engine_s_per_head"] = row["engine_s_all_heads"] / g.n_total
            row["speedup_per_head"] = row["brute_s_per_head"] / row["engine_s_per_head"]
            got = [float(res.patched[0, l, h]) for l, h in sample]
            row["max_abs_diff"] = max(abs(a - b) for a, b in zip(got, ref))
            row["gap"] = float(res.m_clean[0] - res.m_corrupt[0])
        except Exception as e:  # report and go on with the next family
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(row, flush=True)
        rows.append(row)
        sync()
    info = {"shape": shape, "seq_len": args.seq_len,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "torch": torch.__version__, "rows": rows}
    import transformers

    info["transformers"] = transformers.__version__
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
