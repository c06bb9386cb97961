"""Which GDN head counts FlashQLA's Hopper chunk forward compiles: its tilelang kernels lowered for sm_90 (no GPU
needed, no kernel run) at each head count, against ``headscope.hybrid.inference.prefill.flash_qla_shape``, the rule
the lean prefill uses to send a layer's GDN heads to FlashQLA (else fla).

Lowers ``chunk_local_cumsum`` (the gate's per-chunk cumsum; dense and varlen forms), ``kkt_solve`` and
``fused_gdr_fwd``'s kernel at head_dim 128, bf16 inputs, fp32 gate, the arguments ``chunk_gated_delta_rule_fwd``
passes. With flash-qla 0.1.3 and tilelang 0.1.15 the cumsum fails LayoutInference ("no available layout found") at
every odd head count ≥ 3 and nowhere else; the other two lower at every count. Needs flash_qla and tilelang
importable (the GPU host's environment); exits 1 when a count's result disagrees with the rule.

    python benchmarks/flash_qla_layouts.py --heads 1-40 --out flash_qla_layouts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _lower(jit, *args, **kwargs) -> str:
    """'ok', or the first line of the lowering's error that says what failed."""
    import tilelang
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90"})
    try:
        with target:
            tilelang.lower(jit.get_tir(*args, **kwargs), target=target)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the result is the message
        lines = str(e).strip().splitlines() or [type(e).__name__]
        return next((ln for ln in lines if "Check failed" in ln), lines[-1])[:200]


def lower_all(H: int) -> dict:
    """{kernel: 'ok' or the error} for FlashQLA's forward kernels at H heads (head_dim 128)."""
    from flash_qla.ops.gated_delta_rule.chunk.hopper import fused_fwd, kkt_solve
    from flash_qla.ops.utils import cumsum

    cs = dict(accum_dtype="float32", g_dtype="float32", seqlen_dtype="int32", reverse=False, zero_last_chunk=False)
    return {
        "cumsum": _lower(cumsum.tilelang_chunk_local_cumsum, H, 64, is_varlen=False, **cs),
        "cumsum_varlen": _lower(cumsum.tilelang_chunk_local_cumsum, H, 64, is_varlen=True, **cs),
        "kkt_solve": _lower(kkt_solve.tilelang_kkt_solve, H, H, 128, 64, qkva_dtype="bfloat16", b_dtype="bfloat16",
                            seqlen_dtype="int32", accum_dtype="float32", is_varlen=False),
        "fused_fwd": _lower(fused_fwd.tilelang_fused_chunk_gdr_fwd, H, H, 128, 128, 64, 128 ** -0.5,
                            qkva_dtype="bfloat16", g_dtype="float32", b_dtype="bfloat16", h0_dtype="float32",
                            ht_dtype="float32", h_dtype="bfloat16", o_dtype="bfloat16", seqlen_dtype="int32",
                            accum_dtype="float32", use_initial_state=True, store_final_state=True, store_h=False,
                            store_o=True, is_varlen=False, is_cp=False, state_v_first=False, block_DV=64),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="1-40", help="head counts: a range A-B or a comma list")
    ap.add_argument("--out", default="flash_qla_layouts.json")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from headscope.hybrid.inference.prefill import flash_qla_shape

    a, _, b = args.heads.partition("-")
    heads = list(range(int(a), int(b) + 1)) if b else [int(h) for h in args.heads.split(",")]
    res, wrong = {}, []
    for H in heads:
        r = lower_all(H)
        compiles = all(v == "ok" for v in r.values())
        res[H] = {**r, "rule": flash_qla_shape(H, 128, 128)}
        if compiles != res[H]["rule"]:
            wrong.append(H)
        print(H, json.dumps(res[H]), flush=True)
    Path(args.out).write_text(json.dumps({"heads": res, "disagree_with_rule": wrong}, indent=1))
    print("wrote", args.out, "| disagree with prefill.flash_qla_shape:", wrong or "none")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
