"""Exact receiver IE of all 1,024 heads of a Llama-3.1-8B-shaped model at 8K tokens on one GPU, side by side
with the one-hook-per-head sweep (the computation of TransformerLens' ``get_act_patch_attn_head_out_all_pos``).

    PYTHONPATH=. python benchmarks/gpu_rank_8b.py --smoke                     # tiny shape, CPU, < 1 min
    PYTHONPATH=. python benchmarks/gpu_rank_8b.py --piece engine --pair-idx 0,1 --out-dir $OUT
    PYTHONPATH=. python benchmarks/gpu_rank_8b.py --piece engine,sweep --pair-idx 2,3,4,5 --out-dir $OUT
    PYTHONPATH=. python benchmarks/gpu_rank_8b.py --piece screen --out-dir $OUT
    PYTHONPATH=. python benchmarks/gpu_rank_8b.py --piece engine,sweep --pair-idx 2 --precision float32 --out-dir $OUT
    python benchmarks/gpu_rank_8b.py --merge A.json B.json C.json --out benchmarks/results/h200_rank_8b.json
    python benchmarks/gpu_rank_8b.py --merge D.json E.json --merge-into benchmarks/results/h200_rank_8b.json

The model: Llama-3.1-8B's shape (32 layers x 32 query heads, 8 KV heads, d_model 4096, d_head 128, MLP 14336,
vocabulary 128,256, RoPE theta 500,000), random weights (normal, std 0.02; norms 1) in bf16, built on the GPU
(on the meta device, then ``to_empty`` and in-place init: seconds, nothing downloaded). The prompts are tokenized
by the SmolLM2 tokenizer (ids < 49,152, inside the model's vocabulary).

Pairs: ``niah_single`` at ``--seq-len`` (8192) with needle depths spread over 0.1..0.9 (one per pair). The engine
recomputes positions from the first clean/corrupted difference (the needle) on, so a pair's cost grows with the
suffix ``T - needle``: the depths are part of the configuration and recorded.

Pieces (``--piece``, comma-separated; each process stops starting new work when ``--budget-s`` would be passed):

* ``engine``: ``receiver_patching`` (public API, exact, all heads, min_gap 0) of the pairs ``--pair-idx``, one call
  per pair, each stored in ``--store-dir`` (a rerun on the same machine resumes from it); the per-pair time,
  patched metrics and counted FLOPs go to the piece's JSON after each pair.
* ``sweep``: the per-head sweep on the first engine pair of this process: one full forward of the model per head,
  a forward pre-hook on that layer's ``o_proj`` writing the corrupted run's hook_z into the head's slice, all
  positions; full logits over all positions (as a TransformerLens forward computes them). Timed on a sample of
  ``--sweep-heads`` heads (one per layer, spread over heads, then more), projected to all heads x pairs.
  The same heads are compared with the engine's values of the full run (``max_abs_diff_vs_bf16_sweep``), and
  ``--fp32-heads`` (16) of them, the planted head included, are recomputed with the model upcast to float32:
  the brute-force reference (``max_abs_diff_vs_bruteforce``: engine vs float32; ``bf16_sweep_vs_fp32``: the
  bf16 sweep's own distance from it).
* ``screen``: ``screen_auto`` (certified screen, top 10) on all pairs: time, verified heads, its peak memory;
  recall@10 against the exact ranking is computed at ``--merge`` time from the engine pieces. A merged result
  keeps no per-head IE, so a screen run later is merged into it with ``--merge-into`` together with engine
  pieces of the same configuration rerun for the purpose (``benchmarks/recipes/rank_8b_screen.sh``: two calls,
  engine pairs 0-3, then pairs 4, 5 and the screen); everything else in the stored result is kept.

FLOPs (``counted_flops``): 2 x multiply-adds of the matmuls the engine runs plus attention's QK^T and PV over
the visible (causal) keys only: per pair, the clean and corrupted full passes (every layer, every position,
unembedding of the read rows), and per patched head at layer l: layer l's o_proj + MLP over the suffix, every
layer > l over the suffix (QKV, attention over prefix + suffix, o_proj, MLP; the last layer's attention queries,
o_proj and MLP at the read rows only, as the engine trims it), the unembedding of the read rows. Norms, RoPE,
softmax and elementwise work are not counted. ``mfu`` = counted FLOPs / (engine seconds x 989.5e12), the H200
SXM's dense bf16 tensor-core peak (NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with 2:4 sparsity, i.e. 989.5 dense).
The sweep's FLOPs are counted the same way for a full forward with logits at every position.

IE needs a clean/corrupted gap, and a random model separates a+ from a- by ~1e-3 logits (its IE is noise, any
bf16 difference is a huge ΔIE). So one head (layer 0, head 0) is planted (:func:`plant_retrieval_head`): it
attends to digit tokens and the digits' unembedding rows read what it writes, giving gaps of logits (recorded per
pair); the other 1,023 heads and every MLP stay random. ``--no-plant`` runs the purely random model. The check
reports the patched metric m's difference (logits) next to the IE difference.

``--precision float32`` (:class:`headscope.patching.Precision`): the engine keeps the bf16 model's residual
stream, norms and RoPE in float32 (matmuls and attention in bf16). A random model amplifies every rounding
(random heads move m by about 0.5 logits), so bf16 runs of one computation in two rounding orders differ by
tenths of a logit; the float32 residual brings the engine nearer the float32 forward than the model's own
bf16 forward. ``--merge`` of pieces run at different precisions records the setting per pair and projects
the total time (see :func:`merge`).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
from typing import Optional  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PEAK_BF16_DENSE = 989.5e12  # H200 SXM, NVIDIA datasheet (1,979 TFLOPS with sparsity / 2)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5)
SMOKE = dict(vocab_size=None, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
             max_position_embeddings=4096, rms_norm_eps=1e-5)


# ---- model, tokenizer, pairs ---------------------------------------------------------------------
def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    for p in [path, ".gpu/smol_tokenizer", "/work/main/.gpu/smol_tokenizer"]:
        if p and Path(p).is_dir():
            return AutoTokenizer.from_pretrained(p), p
    from headscope.model_specs import default_gguf_path

    g = default_gguf_path()
    return AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name), str(g)


def build_model(shape: dict, tokenizer, device: str, dtype: torch.dtype, seed: int = 0):
    """Random Llama of ``shape`` built on ``device`` in ``dtype`` (meta init, to_empty, normal_ std 0.02)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from headscope.models import wrap

    shape = dict(shape)
    if shape["vocab_size"] is None:
        shape["vocab_size"] = len(tokenizer)
    cfg = LlamaConfig(**shape, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    hf = hf.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    hf.eval()
    model = wrap(hf, tokenizer, name="llama3.1-8b-shape-random" if shape["hidden_size"] == 4096 else "tiny-llama")
    restore_rope(model)  # its buffers were left empty by to_empty
    return model


@torch.no_grad()
def plant_retrieval_head(model, tokenizer, layer: int = 0, head: int = 0, score: float = 16.0, gamma: float = 4.0,
                         seed: int = 1) -> dict:
    """Give the random model one digit-copying head, so that clean and corrupted prompts differ in m by logits,
    not by the ~1e-3 of a random model (whose IE would be noise): every embedding row gets a shared direction
    ``c`` and the digit tokens a direction ``e``; head ``head`` of ``layer`` reads ``c`` into its query and ``e``
    into its key on the lowest-frequency RoPE pair (about position-independent over 8K tokens: it attends to
    the digit tokens with a logit margin of ``score``), its value/output stay random, and each digit's
    unembedding row gets ``gamma`` x the unit vector of what the head writes for that digit. Returns the planted
    settings (recorded in the JSON)."""
    hf = model.hf_model
    cfg = hf.config
    d, dh, H = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    kv = head // (H // cfg.num_key_value_heads)
    dev = model.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, 2, generator=gen))
    c, e = basis[:, 0].to(dev), basis[:, 1].to(dev)
    digits = torch.as_tensor(tokenizer.convert_tokens_to_ids(list("0123456789")), device=dev)
    E = hf.model.embed_tokens.weight
    E.add_(c.to(E.dtype))
    E[digits] += e.to(E.dtype)
    att = hf.model.layers[layer].self_attn
    ln = hf.model.layers[layer].input_layernorm

    def normed(rows):
        x = rows.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ln.variance_epsilon) * ln.weight.float()

    sample = normed(E[:4096])
    cx = float((sample @ c).mean())
    xd = normed(E[digits])
    ex = float((xd @ e).mean())
    scale = (score * math.sqrt(dh) / (cx * ex)) ** 0.5
    r = dh // 2 - 1  # rotate_half pairs r with r + dh/2: the lowest RoPE frequency
    q = att.q_proj.weight
    q[head * dh:(head + 1) * dh] = 0
    q[head * dh + r] = (scale * c).to(q.dtype)
    k = att.k_proj.weight
    k[kv * dh + r] = (scale * e).to(k.dtype)
    v = att.v_proj.weight[kv * dh:(kv + 1) * dh].float()
    o = att.o_proj.weight[:, head * dh:(head + 1) * dh].float()
    w = (xd @ v.T) @ o.T  # [10, d]: what the head writes for each digit
    w = w - w.mean(0, keepdim=True)  # the part that tells the digits apart
    U = hf.lm_head.weight
    U[digits] += (gamma * w / w.norm(dim=-1, keepdim=True)).to(U.dtype)
    return {"layer": layer, "head": head, "score_margin": score, "gamma": gamma, "qk_scale": round(scale, 4),
            "c_dot_x": round(cx, 2), "e_dot_x_digits": round(ex, 2), "digit_tokens": digits.tolist()}


def restore_rope(model) -> None:
    """A fresh RoPE module (float32 frequencies) on the model's device."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = model.hf_model
    hf.model.rotary_emb = LlamaRotaryEmbedding(config=hf.config).to(model.device)


def make_pairs(tokenizer, n: int, seq_len: int, seed: int = 0):
    from headscope.tasks import niah_single

    depths = [round(0.1 + 0.8 * i / max(n - 1, 1), 3) for i in range(n)]
    return niah_single(tokenizer, n_pairs=n, seq_len=seq_len, depth=depths, seed=seed), depths


# ---- FLOP counts ---------------------------------------------------------------------------------
def _layer_flops(cfg, n_tok: int, n_q: int, q_pos_sum: int, qkv_tok: int | None = None) -> float:
    """One layer: QKV of ``qkv_tok`` tokens, attention of ``n_q`` queries (sum of visible keys ``q_pos_sum``),
    o_proj + MLP of ``n_q`` tokens."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    H, KV, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv_tok = n_tok if qkv_tok is None else qkv_tok
    return (2 * qkv_tok * d * (H + 2 * KV) * dh + 4 * H * dh * q_pos_sum
            + 2 * n_q * (H * dh * d + 3 * d * f))


def pair_flops(cfg, pair) -> dict:
    """Counted FLOPs of one pair's engine work (see the module docstring) and of one sweep forward."""
    L, d, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    H, dh, f = cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size
    T = pair.length + pair.n_answer - 1
    read = list(range(pair.length - 1, T))
    start = min(pair.first_diff(), read[0])
    S = T - start
    full_layer = _layer_flops(cfg, T, T, T * (T + 1) // 2)
    head_rows = 2 * len(read) * d * V
    full_pass = L * full_layer + head_rows
    suffix_layer = _layer_flops(cfg, S, S, sum(t + 1 for t in range(start, T)))
    last_layer = _layer_flops(cfg, S, len(read), sum(r + 1 for r in read), qkv_tok=S)
    patched = 0.0
    for lay in range(L):
        own = 2 * (S if lay < L - 1 else len(read)) * (H * dh * d + 3 * d * f)
        later = (L - 2 - lay) * suffix_layer + last_layer if lay < L - 1 else 0.0
        patched += H * (own + later + head_rows)
    sweep_forward = L * full_layer + 2 * T * d * V
    return {"engine": 2 * full_pass + patched, "sweep_forward": sweep_forward, "T": T, "start": start, "S": S}


# ---- the per-head sweep (plain PyTorch hooks) -------------------------------------------------------
class Sweep:
    """One full forward per head, a pre-hook on ``o_proj`` replacing the head's slice of hook_z with the
    corrupted run's; the readout (final RMSNorm + unembedding at the read rows) in float32 as the engine's."""

    def __init__(self, model, pair):
        from headscope.patching.receivers import sequences

        self.hf = model.hf_model
        self.dh = model.geometry.d_head
        self.clean, self.corr, self.read = sequences(pair)
        self.pair = pair
        self.dev = model.device
        self.layers = self.hf.model.layers

    def _readout(self, h):
        norm, lm = self.hf.model.norm, self.hf.lm_head
        x = F.rms_norm(h.float(), (h.shape[-1],), norm.weight.float(), norm.variance_epsilon)
        return x @ lm.weight.float().T

    @torch.no_grad()
    def forward(self, ids, layer: int | None = None, head: int | None = None, src=None, capture=False):
        got, hooks, zs = {}, [], {}
        read = torch.as_tensor(self.read, device=self.dev)

        def grab_final(mod, args):
            got["h"] = args[0][0, read]

        hooks.append(self.hf.model.norm.register_forward_pre_hook(grab_final))
        if capture:
            for i, blk in enumerate(self.layers):
                hooks.append(blk.self_attn.o_proj.register_forward_pre_hook(
                    lambda mod, args, i=i: zs.__setitem__(i, args[0].detach().clone())))
        if layer is not None:
            sl = slice(head * self.dh, (head + 1) * self.dh)

            def patch(mod, args):
                z = args[0].clone()
                z[..., sl] = src[layer][..., sl]
                return (z,)

            hooks.append(self.layers[layer].self_attn.o_proj.register_forward_pre_hook(patch))
        try:
            out = self.hf(ids[None].to(self.dev), use_cache=False)  # logits at every position, as TL computes
            del out
        finally:
            for hk in hooks:
                hk.remove()
        from headscope.readout import logit_diff

        m = float(logit_diff(self._readout(got["h"]), self.pair.answer, self.pair.counter_answer))
        return m, zs

    def run(self, heads, budget_end: float | None = None, sync=None):
        """(m_clean, m_corrupt, {head: m}, seconds per head forward list, seconds of the two base passes)."""
        sync = sync or (lambda: None)
        sync()
        t = time.perf_counter()
        m_c, _ = self.forward(self.clean)
        m_x, src = self.forward(self.corr, capture=True)
        sync()
        base_s = time.perf_counter() - t
        self.forward(self.clean, heads[0][0], heads[0][1], src)  # warm-up of the hooked path
        vals, secs = {}, []
        for lay, h in heads:
            if budget_end is not None and secs and time.perf_counter() + 2 * max(secs) > budget_end:
                break
            sync()
            t = time.perf_counter()
            vals[(lay, h)], _ = self.forward(self.clean, lay, h, src)
            sync()
            secs.append(time.perf_counter() - t)
        del src
        return m_c, m_x, vals, secs, base_s


def sample_heads(n_layers: int, n_heads: int, n: int) -> list[tuple[int, int]]:
    """``n`` distinct heads, one per layer first (head index spread), ascending layers."""
    out, k = [], 0
    while len(out) < min(n, n_layers * n_heads):
        for lay in range(n_layers):
            h = (7 * lay + 3 + 11 * k) % n_heads
            if (lay, h) not in out and len(out) < n:
                out.append((lay, h))
        k += 1
    return sorted(out)


# ---- helpers ------------------------------------------------------------------------------------
def versions() -> dict:
    import transformers

    import headscope

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
         "headscope": getattr(headscope, "__version__", "?")}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["device"] = torch.cuda.get_device_name()
    try:
        import subprocess

        v["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return v


def write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, all pieces, < 1 min")
    ap.add_argument("--piece", default="engine,sweep,screen", help="comma list of engine, sweep, screen")
    ap.add_argument("--pair-idx", default=None, help="engine pairs of this process, e.g. 0,1 (default all)")
    ap.add_argument("--screen-own-pairs", action="store_true",
                    help="the screen ranks only the --pair-idx pairs (recall@10 against their exact IE), not all")
    ap.add_argument("--n-pairs", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall seconds of this process, from its start")
    ap.add_argument("--sweep-heads", type=int, default=32)
    ap.add_argument("--fp32-heads", type=int, default=16, help="sweep heads recomputed in float32 (the brute-force "
                    "reference; 4.35 s per head at 8K on an H200)")
    ap.add_argument("--precision", default="model", choices=["model", "float32"],
                    help="the engine's residual stream: in the model's dtype (bf16) or in float32 "
                         "(headscope.patching.Precision; bf16 matmuls and attention either way)")
    ap.add_argument("--no-plant", action="store_true", help="purely random weights (gaps ~1e-3 logits: IE is noise)")
    ap.add_argument("--plant-gamma", type=float, default=8.0, help="unembedding gain of the planted digit-copying head")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default .gpu/smol_tokenizer, else the GGUF)")
    ap.add_argument("--store-dir", default=None, help="resume store (default /tmp/headscope_rank8b)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    ap.add_argument("--merge", nargs="*", default=None, help="piece JSONs to merge into --out")
    ap.add_argument("--out", default="benchmarks/results/h200_rank_8b.json")
    ap.add_argument("--merge-into", default=None, metavar="STORED_JSON",
                    help="with --merge: add the pieces' screen (seconds, verified heads, recall@10 against the exact "
                         "IE of the pieces' engine pairs) to this already merged result, keeping the rest of it")
    args = ap.parse_args()
    if args.merge_into is not None:
        if not args.merge:
            raise SystemExit("--merge-into needs the piece JSONs: --merge A.json B.json --merge-into STORED_JSON")
        merge_into(args.merge, args.merge_into)
        return None
    if args.merge is not None:
        return merge(args.merge, args.out)

    budget_end = T_START + args.budget_s
    smoke = args.smoke
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    seq_len = 160 if smoke else args.seq_len
    n_pairs = 2 if smoke else args.n_pairs
    pieces = set(args.piece.split(","))
    unknown = pieces - {"engine", "sweep", "screen"}
    if unknown:
        raise SystemExit(f"unknown --piece {sorted(unknown)}: use engine, sweep, screen")
    if "sweep" in pieces and "engine" not in pieces:
        raise SystemExit("--piece sweep compares with the engine's values of the same process: add engine")
    pair_idx = (list(range(n_pairs)) if args.pair_idx is None
                else [int(x) for x in args.pair_idx.split(",")])
    if smoke:
        import tempfile

        store_root = Path(tempfile.mkdtemp(prefix="headscope_rank8b_smoke_"))
    else:
        store_root = Path(args.store_dir or "/tmp/headscope_rank8b") / f"T{seq_len}_n{n_pairs}"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{'-'.join(sorted(pieces))}_{'-'.join(map(str, pair_idx))}"
    whole_smoke = smoke and pieces == {"engine", "sweep", "screen"} and pair_idx == list(range(n_pairs))
    if smoke:  # the whole smoke run keeps its one file name; smoke pieces get their own (to test --merge-into)
        tag = "smoke" if whole_smoke else f"smoke_{tag}"
    if args.precision != "model" and not smoke:
        tag += f"_resid-{args.precision}"
    out_path = out_dir / f"rank8b_{tag}.json"

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in true fp32
    from headscope.patching import Precision, receiver_patching

    precision = Precision(args.precision)

    shape = SMOKE if smoke else LLAMA_8B
    tok, tok_src = load_tokenizer(args.tokenizer)
    t = time.perf_counter()
    model = build_model(shape, tok, device, torch.bfloat16)
    sync()
    build_s = time.perf_counter() - t
    planted = None if args.no_plant else plant_retrieval_head(model, tok, gamma=args.plant_gamma)
    cfg = model.hf_model.config
    t = time.perf_counter()
    pairs, depths = make_pairs(tok, n_pairs, seq_len)
    pairs_s = time.perf_counter() - t
    g = model.geometry
    res: dict = {
        "piece": sorted(pieces), "pair_idx": pair_idx, "smoke": smoke, "versions": versions(),
        "config": {"shape": {**{k: getattr(cfg, k, None) for k in LLAMA_8B}, "rope_parameters": getattr(cfg, "rope_parameters", None)}, "dtype": "bfloat16", "init": "normal(0, 0.02), norms 1", "planted_head": planted,
                   "tokenizer": tok_src, "tokenizer_vocab": len(tok), "task": "niah_single", "seq_len": seq_len,
                   "depths": depths, "n_pairs": n_pairs, "readout": "lam 0.9, noising, min_gap 0 (float32 readout)",
                   "precision": precision.to_dict(),
                   "budget_s": args.budget_s},
        "heads": g.n_layers * g.n_heads, "build_seconds": round(build_s, 2), "pairs_seconds": round(pairs_s, 2),
        "pair_lengths": [p.length for p in pairs], "pair_needle_start": [min(p.first_diff(), p.length - 1) for p in pairs],
    }
    print(f"built {model.name} in {build_s:.1f} s; pairs {res['pair_lengths']} needle {res['pair_needle_start']}",
          flush=True)
    write(out_path, res)
    warnings.simplefilter("ignore")  # LowPrecisionWarning on every random-model pair: the gaps are recorded

    # ---- engine -------------------------------------------------------------------------------
    eng: dict = {}
    peak_before_screen = 0  # bytes: the process's peak before the screen resets the counter
    if "engine" in pieces:
        receiver_patching(model, pairs[:1], min_gap=0.0, progress=False, heads=[(0, 0), (g.n_layers - 1, 0)],
                          precision=precision)  # warm-up
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rate = None
        res["engine"] = eng
        for i in pair_idx:
            fl = pair_flops(cfg, pairs[i])
            left = budget_end - time.perf_counter()
            if rate is not None and fl["engine"] / rate > left - 30:
                print(f"pair {i}: needs ~{fl['engine'] / rate:.0f} s, {left:.0f} s left: stopping (rerun resumes)",
                      flush=True)
                break
            sync()
            t = time.perf_counter()
            r = receiver_patching(model, [pairs[i]], min_gap=0.0, progress=True, store_dir=str(store_root / f"pair{i}"),
                                  store_config={"bench": "rank8b", "smoke": smoke, "seq_len": seq_len},
                                  precision=precision)
            sync()
            sec = time.perf_counter() - t
            rate = fl["engine"] / sec
            eng[str(i)] = {"seconds": round(sec, 3), "counted_flops": fl["engine"], "T": fl["T"], "start": fl["start"],
                           "suffix": fl["S"], "sweep_forward_flops": fl["sweep_forward"],
                           "mfu": round(fl["engine"] / sec / PEAK_BF16_DENSE, 4) if cuda else None,
                           "m_clean": float(r.m_clean[0]), "m_corrupt": float(r.m_corrupt[0]),
                           "patched": r.patched[0].tolist(), "path": r.path, "precision": r.precision.to_dict()}
            if cuda:
                res["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
            print(f"pair {i}: {sec:.1f} s, suffix {fl['S']}/{fl['T']}, {fl['engine'] / 1e15:.1f} PFLOP counted, "
                  f"{fl['engine'] / sec / 1e12:.0f} TFLOP/s", flush=True)
            write(out_path, res)

    # ---- sweep + brute-force check ----------------------------------------------------------------
    if "sweep" in pieces and eng:
        i = int(next(iter(eng)))
        heads = sample_heads(g.n_layers, g.n_heads, max(args.sweep_heads, 16) if not smoke else g.n_layers * g.n_heads)
        if (0, 0) not in heads:
            heads = sorted(heads + [(0, 0)])  # the planted head
        sw = Sweep(model, pairs[i])
        end = budget_end - 60 if not smoke else None
        m_c, m_x, vals, secs, base_s = sw.run(heads, end, sync)
        per = sorted(secs)[len(secs) // 2] if secs else math.nan
        mean = sum(secs) / max(len(secs), 1)
        e = eng[str(i)]
        gap_e, gap_s = e["m_clean"] - e["m_corrupt"], m_c - m_x
        d_m = [abs(vals[k] - e["patched"][k[0]][k[1]]) for k in vals]
        ie_e = {k: (e["m_clean"] - e["patched"][k[0]][k[1]]) / gap_e for k in vals}
        ie_s = {k: (m_c - vals[k]) / gap_s for k in vals}
        res["sweep"] = {
            "pair": i, "heads_timed": len(secs), "seconds_per_head_forward_mean": round(mean, 4),
            "seconds_per_head_forward_median": round(per, 4), "seconds_base_passes": round(base_s, 3),
            "sweep_forward_flops": e["sweep_forward_flops"],
            "mfu_sweep": round(e["sweep_forward_flops"] / mean / PEAK_BF16_DENSE, 4) if cuda and secs else None,
            "m_clean": m_c, "m_corrupt": m_x, "values": {f"{k[0]},{k[1]}": v for k, v in vals.items()},
        }
        res["check"] = {
            "pair": i, "heads": len(vals), "gap_engine": gap_e, "gap_sweep": gap_s,
            "max_abs_diff_m_logits": max(d_m) if d_m else None,
            "max_abs_diff_ie": max(abs(ie_e[k] - ie_s[k]) for k in vals) if vals else None,
            "m_clean_diff": abs(m_c - e["m_clean"]), "m_corrupt_diff": abs(m_x - e["m_corrupt"]),
        }
        print("sweep", {k: v for k, v in res["sweep"].items() if k != "values"}, flush=True)
        print("check", res["check"], flush=True)
        write(out_path, res)
        nf = min(args.fp32_heads, len(vals))
        if nf and (smoke or budget_end - time.perf_counter() > 120):
            try:
                model.hf_model.float()
                ref = Sweep(model, pairs[i])
                fh = [k for k in heads if k in vals][:: max(1, len(vals) // nf)][:nf]
                f_c, f_x, fv, fsec, _ = ref.run(fh, budget_end - 20 if not smoke else None, sync)
                gap_f = f_c - f_x
                ie_f = {k: (f_c - fv[k]) / gap_f for k in fv}
                res["fp32_reference"] = {
                    "pair": i, "heads": [list(k) for k in fv], "m_clean": f_c, "m_corrupt": f_x,
                    "gap": gap_f, "seconds_per_head": fsec, "engine_precision": precision.to_dict(),
                    "ie": {f"{k[0]},{k[1]}": v for k, v in ie_f.items()},
                    "m_clean_diff_engine": abs(f_c - e["m_clean"]), "m_corrupt_diff_engine": abs(f_x - e["m_corrupt"]),
                    "m_clean_diff_sweep_bf16": abs(f_c - m_c), "m_corrupt_diff_sweep_bf16": abs(f_x - m_x),
                    "max_abs_diff_m_engine_bf16": max(abs(fv[k] - e["patched"][k[0]][k[1]]) for k in fv),
                    "max_abs_diff_m_sweep_bf16": max(abs(fv[k] - vals[k]) for k in fv),
                    "max_abs_diff_ie_engine_bf16": max(abs(ie_f[k] - ie_e[k]) for k in fv),
                    "max_abs_diff_ie_sweep_bf16": max(abs(ie_f[k] - ie_s[k]) for k in fv),
                    "mean_abs_diff_ie_engine_bf16": sum(abs(ie_f[k] - ie_e[k]) for k in fv) / len(fv),
                    "mean_abs_diff_ie_sweep_bf16": sum(abs(ie_f[k] - ie_s[k]) for k in fv) / len(fv),
                }
                print("fp32", res["fp32_reference"], flush=True)
            except torch.OutOfMemoryError as err:
                res["fp32_reference"] = {"error": str(err)[:300]}
            finally:
                model.hf_model.to(torch.bfloat16)
                restore_rope(model)  # .to(dtype) rounded the RoPE frequencies to bf16
                if cuda:
                    torch.cuda.empty_cache()
            write(out_path, res)

    # ---- screen ----------------------------------------------------------------------------------
    if "screen" in pieces:
        from headscope.patching.screen import screen_auto

        left = budget_end - time.perf_counter()
        if left < 60 and not smoke:
            res["screen"] = {"skipped": f"{left:.0f} s left"}
        else:
            import signal

            def alarm(signum, frame):
                raise TimeoutError(f"screen stopped at the budget ({args.budget_s} s)")

            if not smoke:
                signal.signal(signal.SIGALRM, alarm)
                signal.alarm(max(1, int(budget_end - time.perf_counter() - 15)))
            if cuda:  # the screen's own peak, after the engine pieces of this process
                peak_before_screen = torch.cuda.max_memory_allocated()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            try:
                sync()
                s_idx = pair_idx if args.screen_own_pairs else list(range(n_pairs))
                s = screen_auto(model, [pairs[i] for i in s_idx], top_k=10, min_gap=0.0, progress=True)
                signal.alarm(0)
                sync()
                sec = time.perf_counter() - t
                mean = s.ie.double().nanmean(0)
                top = torch.topk(torch.nan_to_num(mean, nan=-1e30).flatten(), 10).indices.tolist()
                st = s.stats.as_dict()
                res["screen"] = {"seconds": round(sec, 2), "pairs": len(s_idx), "pair_idx": s_idx,
                                 "verified": st["n_verified"],
                                 "certified": st["certified"],
                                 "top10": [[t_ // g.n_heads, t_ % g.n_heads] for t_ in top],
                                 "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
                                 "stats": st, "mean_ie": mean.tolist()}
                print("screen", sec, st, flush=True)
            except (torch.OutOfMemoryError, TimeoutError) as err:
                signal.alarm(0)
                res["screen"] = {"error": str(err)[:300], "seconds_until_stop": round(time.perf_counter() - t, 1)}
        write(out_path, res)

    if cuda:  # incl. sweep, fp32, screen
        res["peak_gb_process"] = round(max(torch.cuda.max_memory_allocated(), peak_before_screen) / 1e9, 2)
    res["wall_seconds"] = round(time.perf_counter() - T_START, 2)
    write(out_path, res)
    print(f"wrote {out_path} ({res['wall_seconds']} s)", flush=True)
    if whole_smoke:
        merge([str(out_path)], str(out_dir / "rank8b_smoke_merged.json"))


# ---- merge --------------------------------------------------------------------------------------
def _precision(piece: dict) -> str:
    return piece["config"].get("precision", {"residual": "model"})["residual"]


def merge(paths: list[str], out: str) -> None:
    """The acceptance keys from piece JSONs (:func:`merged`) written to ``out``."""
    out_obj = merged([json.loads(Path(p).read_text()) for p in paths])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write(Path(out), out_obj)
    print(json.dumps({k: v for k, v in out_obj.items() if k not in ("config", "versions", "flops_counting")}, indent=1,
                     default=str))


def exact_ie(eng: dict, n_pairs: int, idx: Optional[list] = None):
    """Exact receiver IE (noising) per pair from the engine pieces' patched metrics:
    ``(m_clean - m_patched) / (m_clean - m_corrupt)``, Float[ndarray, "pair layer head"] over the pairs ``idx``
    (default all ``n_pairs``)."""
    import numpy as np

    idx = list(range(n_pairs)) if idx is None else idx
    pt = np.array([eng[str(i)]["patched"] for i in idx])
    mc = np.array([eng[str(i)]["m_clean"] for i in idx])[:, None, None]
    mx = np.array([eng[str(i)]["m_corrupt"] for i in idx])[:, None, None]
    return (mc - pt) / (mc - mx)


def screen_summary(sc: dict, eng: dict, n_pairs: int) -> dict:
    """The screen piece's figures without its per-head means; with the exact IE of all ``n_pairs`` engine pairs
    also ``recall_at_10`` (the screen's top 10 by mean IE vs the exact top 10, :func:`recall_at_k`) and
    ``exact_top10`` ([layer, head] lists)."""
    import numpy as np

    from headscope.patching.attribution import recall_at_k

    out = {k: v for k, v in sc.items() if k != "mean_ie"}
    idx = sc.get("pair_idx", list(range(n_pairs)))  # the pairs the screen ran on (--screen-own-pairs: a subset)
    if "mean_ie" not in sc or any(str(i) not in eng for i in idx):
        return out
    exact = exact_ie(eng, n_pairs, idx).mean(0)
    heads = exact.shape[1]
    top = np.argsort(-exact.ravel(), kind="stable")[:10].tolist()
    out.update(recall_at_10=recall_at_k(exact, np.array(sc["mean_ie"]), 10),
               exact_top10=[[t // heads, t % heads] for t in top])
    return out


def engine_pairs(parts: list[dict]) -> tuple[dict, dict]:
    """(pair -> the engine's figures of the last piece that ran it, with its ``precision_residual``;
    precision -> pair -> seconds of every piece's measurement)."""
    eng: dict = {}
    by_prec: dict[str, dict[str, float]] = {}
    for p in parts:
        pr = _precision(p)
        for k, e in p.get("engine", {}).items():
            eng[k] = {**e, "precision_residual": pr}
            by_prec.setdefault(pr, {})[k] = e["seconds"]
    return eng, by_prec


def merged(parts: list[dict]) -> dict:
    """The acceptance keys from piece dicts: engine pairs from every piece (a later piece's pair replaces an
    earlier one's), sweep/check/fp32 reference/screen from the last piece that has them.

    Pieces may differ in the engine's precision (``config.precision``): then ``seconds`` sums times measured
    at different settings, and ``seconds_projected`` scales every pair measured only at the other setting by
    the time ratio of the pairs measured at both (its basis is recorded); a full rerun at one setting
    replaces the projection."""
    eng, by_prec = engine_pairs(parts)
    first = parts[0]
    n_pairs = first["config"]["n_pairs"]
    heads = first["heads"]
    seconds = sum(e["seconds"] for e in eng.values())
    flops = sum(e["counted_flops"] for e in eng.values())
    last = lambda key: next((p[key] for p in reversed(parts) if key in p), None)  # noqa: E731
    sw, ck, f32, sc = last("sweep"), last("check"), last("fp32_reference"), last("screen")
    ck_piece = next((p for p in reversed(parts) if "check" in p), None)
    precs = sorted({e["precision_residual"] for e in eng.values()})
    projected = None
    if len(precs) > 1 and ck_piece is not None:
        target = _precision(ck_piece)  # the setting the accuracy check ran with
        other = [q for q in by_prec if q != target]
        both = [k for k in by_prec.get(target, {}) if all(k in by_prec[q] for q in other)]
        if both:
            ratio = (sum(by_prec[target][k] for k in both)
                     / sum(by_prec[q][k] for q in other for k in both))
            tot = sum(e["seconds"] if e["precision_residual"] == target else e["seconds"] * ratio
                      for e in eng.values())
            projected = {"precision_residual": target, "seconds": round(tot, 2), "time_ratio": round(ratio, 4),
                         "basis_pairs": both,
                         "note": f"pairs measured only at residual={other} scaled by the {target}/{other} time "
                                 f"ratio of pairs {both} (measured at both); not a measurement"}
    f32_ok = f32 is not None and "error" not in f32
    proj = None
    if sw:
        fwd = sw["seconds_per_head_forward_mean"]
        proj = heads * n_pairs * fwd + n_pairs * sw["seconds_base_passes"]
    out_obj = {
        "heads": heads, "pairs": len(eng), "pairs_planned": n_pairs, "seq_len": first["config"]["seq_len"],
        "pair_lengths": first["pair_lengths"], "seconds": round(seconds, 2),
        "seconds_per_pair": {k: e["seconds"] for k, e in sorted(eng.items())},
        "sweep_seconds_projected": None if proj is None else round(proj, 1),
        "sweep_ratio": None if proj is None or len(eng) < n_pairs else round(proj / seconds, 2),
        "precision_by_pair": {k: e["precision_residual"] for k, e in sorted(eng.items())},
        "seconds_mixed_precision": len(precs) > 1,
        "seconds_projected": projected,
        "sweep_ratio_projected": (None if proj is None or projected is None or len(eng) < n_pairs
                                  else round(proj / projected["seconds"], 2)),
        "mfu": round(flops / seconds / PEAK_BF16_DENSE, 4) if seconds else None,
        "counted_tflop": round(flops / 1e12, 1),
        "peak_gb": max((p.get("peak_gb", 0) for p in parts), default=None),
        # brute force = the float32 per-head sweep (model upcast) where it ran, else the bf16 sweep
        "max_abs_diff_vs_bruteforce": (f32["max_abs_diff_ie_engine_bf16"] if f32_ok
                                       else None if ck is None else ck["max_abs_diff_ie"]),
        "max_abs_diff_vs_bruteforce_m_logits": (f32["max_abs_diff_m_engine_bf16"] if f32_ok
                                                else None if ck is None else ck["max_abs_diff_m_logits"]),
        "bruteforce_reference": (f"float32 per-head sweep (model upcast), {len(f32['heads'])} heads of pair "
                                 f"{f32.get('pair', None if ck is None else ck['pair'])}" if f32_ok
                                 else None if ck is None else f"bf16 per-head sweep, {ck['heads']} heads"),
        "max_abs_diff_vs_bf16_sweep": None if ck is None else ck["max_abs_diff_ie"],
        "bf16_sweep_vs_fp32": None if not f32_ok else f32["max_abs_diff_ie_sweep_bf16"],
        "gaps": {k: round(e["m_clean"] - e["m_corrupt"], 4) for k, e in sorted(eng.items())},
        "check": ck, "fp32_reference": f32,
        "sweep": None if sw is None else {k: v for k, v in sw.items() if k != "values"},
        "flops_counting": ("engine: 2 x multiply-adds of its matmuls + causal attention QK^T/PV over visible keys "
                           "(clean and corrupted full passes; per patched head its layer's o_proj + MLP and every later "
                           "layer over the suffix from the needle, the last layer at the read rows); mfu = counted / "
                           "(seconds x 989.5e12, H200 SXM dense bf16 peak, NVIDIA datasheet 1,979 TFLOPS sparse / 2)"),
        "versions": first["versions"], "config": first["config"],
        "pieces": [{"piece": p["piece"], "pair_idx": p["pair_idx"], "wall_seconds": p.get("wall_seconds"),
                    "build_seconds": p.get("build_seconds")} for p in parts],
    }
    if sc:
        out_obj["screen"] = screen_summary(sc, eng, n_pairs)
    return out_obj


#: the configuration entries that must agree between a stored result and the pieces merged into it (the same
#: model, pairs and readout; the precision, budget and tokenizer path may differ)
SAME_RUN_KEYS = ("shape", "dtype", "init", "planted_head", "tokenizer_vocab", "task", "seq_len", "depths", "n_pairs",
                 "readout")


def merge_into(paths: list[str], stored: str) -> dict:
    """Add the screen of the pieces ``paths`` to the already merged result ``stored`` (whose pieces are gone),
    keeping everything it holds; returns the updated dict (also written to ``stored``).

    The stored result keeps only aggregates of its engine pairs (no per-head IE), so recall@10 is computed
    against the exact IE of the engine pairs in ``paths`` (a rerun of the same model and pairs: seeded weights,
    same depths). Written: ``screen`` (seconds, pairs, verified heads, certified, its peak memory, top 10,
    ``recall_at_10`` and ``exact_top10``, the screen's stats) with ``screen.exact_reference``: which pairs and
    precision the exact IE came from, their rerun seconds, and how far the rerun is from the stored run (the
    clean-corrupted gaps per pair; the IE of the stored float32 brute-force heads where that pair was rerun).
    The pieces are appended to ``pieces`` with ``used_for: "screen"``.

    Raises:
        SystemExit: no screen piece; a screen piece without its per-head means; engine pairs missing; a piece
            of another configuration (model shape, planted head, pairs, readout) than ``stored``.
    """
    st = json.loads(Path(stored).read_text())
    parts = [json.loads(Path(p).read_text()) for p in paths]
    for p, path in zip(parts, paths):
        diff = [k for k in SAME_RUN_KEYS if p["config"].get(k) != st["config"].get(k)]
        if p.get("pair_lengths") != st.get("pair_lengths"):
            diff.append("pair_lengths")  # another tokenizer
        if diff:
            raise SystemExit(f"{path}: its configuration differs from {stored} in {diff}: its exact IE is of "
                             "another model or other pairs")
    eng, n_pairs = engine_pairs(parts)[0], st["config"]["n_pairs"]
    sc = next((p["screen"] for p in reversed(parts) if "screen" in p), None)
    if sc is None:
        raise SystemExit(f"no screen piece among {paths}: run --piece screen (with engine pairs) first")
    if "error" in sc or "skipped" in sc:
        st["screen"] = screen_summary(sc, {}, n_pairs)  # the stop is the result: recorded as it is
    else:
        missing = [i for i in sc.get("pair_idx", range(n_pairs)) if str(i) not in eng]
        if "mean_ie" not in sc:
            raise SystemExit("the screen piece has no per-head means (mean_ie): rerun it with this script")
        if missing:
            raise SystemExit(f"recall@10 needs the exact IE of the screen's pairs: engine pairs {missing} are in "
                             f"none of {paths} (the stored result keeps no per-head IE); run --piece engine "
                             f"--pair-idx {','.join(map(str, missing))}")
        out = screen_summary(sc, eng, n_pairs)
        ref: dict = {
            "source": "engine pieces rerun with the stored configuration (not the stored run's own pairs)",
            "pairs": sorted(eng, key=int), "seconds_per_pair": {k: eng[k]["seconds"] for k in sorted(eng, key=int)},
            "precision_by_pair": {k: eng[k]["precision_residual"] for k in sorted(eng, key=int)},
            "gaps": {k: round(eng[k]["m_clean"] - eng[k]["m_corrupt"], 4) for k in sorted(eng, key=int)},
        }
        old_gaps = st.get("gaps") or {}
        both = [k for k in ref["gaps"] if k in old_gaps]
        if both:
            ref["max_abs_gap_diff_vs_stored"] = max(abs(ref["gaps"][k] - old_gaps[k]) for k in both)
        f32 = st.get("fp32_reference") or {}
        k32 = str(f32.get("pair"))
        if "ie" in f32 and k32 in eng:
            ie = exact_ie(eng, n_pairs)[int(k32)]
            d = [abs(float(ie[tuple(map(int, h.split(",")))]) - v) for h, v in f32["ie"].items()]
            ref["max_abs_diff_ie_vs_stored_fp32_reference"] = max(d)
            ref["fp32_reference_pair_precision"] = eng[k32]["precision_residual"]
        out["exact_reference"] = ref
        st["screen"] = out
        print(f"screen: {out['seconds']} s, {out.get('verified')} heads verified, recall@10 {out['recall_at_10']}"
              f" (exact reference: pairs {ref['pairs']}, gap diff vs stored {ref.get('max_abs_gap_diff_vs_stored')})",
              flush=True)
    st.setdefault("pieces", []).extend(
        {"piece": p["piece"], "pair_idx": p["pair_idx"], "wall_seconds": p.get("wall_seconds"),
         "build_seconds": p.get("build_seconds"), "used_for": "screen"} for p in parts)
    write(Path(stored), st)
    return st


if __name__ == "__main__":
    sys.exit(main())
