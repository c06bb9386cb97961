"""Greedy tokens of a real checkpoint's hybrid: the fast paths against the reference path (issue 61's acceptance).

The teacher is a real checkpoint (SmolLM2-135M-Instruct's GGUF: ``smollm2-135m``; Gemma 3 270M's: ``gemma3-270m`` or
the joined ``.gguf`` path the device machine assembles, ``/tmp/g/gemma3-270m.gguf``), hybridized with a 7:1 mask (the
ranked ``hydrahead`` mask for SmolLM2-135M, the equal-budget random ``mask_7to1`` for any other) — the GDN heads newly
initialized, so the text is not meant to be good; what is compared is two ways of computing the same model. Prompts:
``--prompts`` NIAH-single prompts of ``--prompt-tokens`` tokens (headscope's built-in haystack; longer than Gemma 3's
sliding window of 512 by default), each alone (batch 1).

For each dtype (bf16 and fp32 on CUDA; fp32 on the CPU) and each ``generate`` setting: ``model.generate`` greedy for
``--new-tokens`` tokens with the default :class:`~headscope.hybrid.InferenceConfig` (on CUDA: the lean prefill, the
decode kernels, the captured whole-model step) and with every role ``"reference"``; then the reference's cache-free
forward on the reference's tokens gives, at each step, the margin between its best and second-best logit. Recorded per
prompt: whether the token sequences are equal, the first step where they differ and the reference's margin there (a
flip on a near-tie — a margin of one bf16 rounding — shows as a margin near 0), the smallest margin over all steps, how
many distinct tokens the reference made (the untrained GDN heads make repetitive text: SmolLM2's hybrid continues a
596-token prompt with 3 distinct tokens in 16 on the CPU), and the backends each path resolved to. ``equal``: every prompt's tokens equal in every dtype and setting.

    python benchmarks/gpu_greedy_real.py --model smollm2-135m --out greedy_smollm2.json
    python benchmarks/gpu_greedy_real.py --model /tmp/g/gemma3-270m.gguf --out greedy_gemma3.json
    python benchmarks/gpu_greedy_real.py --smoke --family gemma3 --out /tmp/greedy.json   # CPU: a tiny random model
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hybrid_model import hybrid_mask, mask_7to1  # noqa: E402
from family_configs import FAMILIES, chosen_backends, geometry, smoke_config  # noqa: E402

from headscope.hybrid import hybridize, use_inference  # noqa: E402
from headscope.hybrid.backend_registry import replace_all  # noqa: E402
from headscope.hybrid.inference import DEFAULT  # noqa: E402

SETTINGS = {"default": {}, "static": {"cache_implementation": "static"}}
# on the CPU "auto" resolves to the reference everywhere: the smoke run names the fast backends instead
CPU_FAST = replace(DEFAULT, prefill="lean", decode="lean", captured_decode="graph")
_FAMILY_OF = {"llama": "smollm2", "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen2": "qwen2", "qwen3": "qwen3",
              "mistral": "mistral", "gpt_neox": "gpt-neox"}


def _generate(model, ids, n, setting):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, **SETTINGS[setting])


@torch.no_grad()
def compare(model, ids, n: int, setting: str, fast_cfg) -> dict:
    """Fast vs reference greedy tokens of one prompt ``ids`` [1, T]: equal, first differing step, the reference's
    top-1 − top-2 logit margin there and its smallest margin over the steps (cache-free forward, teacher-forced on the
    reference's tokens), each path's backends and wall seconds (the fast one's first call includes its compile)."""
    T = ids.shape[1]
    out = {}
    for name, cfg in (("fast", fast_cfg), ("reference", replace_all(DEFAULT, "reference"))):
        use_inference(model, cfg)
        t = time.perf_counter()
        out[name] = _generate(model, ids, n, setting)[0, T:]
        out[f"{name}_s"] = round(time.perf_counter() - t, 3)
        out[f"{name}_backends"] = chosen_backends(model)
    ref = torch.cat([ids[0], out["reference"]])[None]
    logits = model(ref[:, :-1], use_cache=False).logits[0, T - 1:].float()  # [n, V]: predicts the generated tokens
    top = logits.topk(2, dim=-1).values
    margin = top[:, 0] - top[:, 1]
    diff = (out["fast"] != out["reference"]).nonzero()
    first = int(diff[0]) if len(diff) else None
    return {"setting": setting, "prompt_tokens": T, "steps": n, "equal": first is None, "first_difference": first,
            "reference_margin_at_first_difference": None if first is None else round(float(margin[first]), 5),
            "min_reference_margin": round(float(margin.min()), 5),
            "reference_argmax_is_its_token": bool((logits.argmax(-1) == out["reference"]).all()),
            "distinct_tokens": len(set(out["reference"].tolist())),
            "fast_tokens": out["fast"].tolist(), "reference_tokens": out["reference"].tolist(),
            **{k: out[k] for k in ("fast_s", "reference_s", "fast_backends", "reference_backends")}}


def load(args) -> tuple:
    """(teacher fp32 on the CPU, mask, family, description, prompts [list of [1, T] ids])."""
    if args.smoke:
        cfg, mask, what = smoke_config(args.family)
        torch.manual_seed(0)
        teacher = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, cfg.vocab_size, (1, args.prompt_tokens), generator=g) for _ in range(args.prompts)]
        return teacher, mask, args.family, what, prompts
    from headscope.models import load_hf
    from headscope.tasks import niah_single

    teacher, tok, name = load_hf(args.model, device="cpu", dtype=torch.float32)
    family = _FAMILY_OF.get(teacher.config.model_type, teacher.config.model_type)
    L, H, KV = geometry(teacher.config)
    mask = hybrid_mask("hydrahead") if (family, L, H, KV) == ("smollm2", 30, 9, 3) else mask_7to1(L, H, KV)
    pairs = niah_single(tok, n_pairs=args.prompts, seq_len=args.prompt_tokens, depth=[0.25, 0.75], seed=0)
    return teacher.eval(), mask, family, name, [p.clean[None] for p in pairs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model spec: smollm2-135m, gemma3-270m, a .gguf path")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=["default"], choices=list(SETTINGS))
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, the family's tiny random model, random prompts")
    ap.add_argument("--family", default="smollm2", choices=FAMILIES, help="--smoke: which tiny model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 40), min(args.new_tokens, 6)
    elif not torch.cuda.is_available():
        sys.exit("gpu_greedy_real.py compares the CUDA fast paths: run it on a GPU host, or --smoke on the CPU")
    dev = torch.device("cpu" if args.smoke else "cuda")
    teacher, mask, family, what, prompts = load(args)
    hybrid = hybridize(teacher, mask).eval()
    del teacher
    res = {"what": "greedy generate of a real checkpoint's 7:1 hybrid: fast paths vs every role 'reference'",
           "model": what, "family": family, "n_fa_heads": mask.n_fa, "new_tokens": args.new_tokens,
           "fast_config": asdict(CPU_FAST if args.smoke else DEFAULT),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(),
                        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()},
           "runs": []}
    dtypes = [torch.float32] if args.smoke else [torch.bfloat16, torch.float32]
    for dtype in dtypes:
        model = copy.deepcopy(hybrid).to(dev, dtype)  # each dtype from the fp32 weights
        for setting in args.settings:
            for i, ids in enumerate(prompts):
                run = {"dtype": str(dtype), "prompt": i, **compare(model, ids.to(dev), args.new_tokens, setting,
                                                                   CPU_FAST if args.smoke else DEFAULT)}
                res["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if not k.endswith("_tokens")}), flush=True)
                res["equal"] = all(r["equal"] for r in res["runs"])
                Path(args.out).write_text(json.dumps(res, indent=1))  # saved as it goes
        del model
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("equal" if res["equal"] else "NOT equal", "; wrote", args.out)


if __name__ == "__main__":
    main()
