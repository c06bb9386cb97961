"""The benchmark scripts' CPU checks (each script's --smoke path, and the variant parser they share)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_bench_one_launch_smoke_runs_every_cell_and_they_agree():
    """bench_one_launch.py --smoke: every cell of the kernel's breakdown runs through Triton's interpreter and its FA
    output equals the default's (the script asserts it)."""
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, str(BENCH / "bench_one_launch.py"), "--smoke", "--out", "unused"],
                       capture_output=True, text=True, timeout=600, cwd=BENCH.parent,
                       env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("'smoke': 'ok'") == 2 and "fa_only_ns" in r.stdout


def test_variants_are_parsed_into_configs_and_bad_items_name_the_fix():
    sys.path.insert(0, str(BENCH))
    try:
        from bench_timing import configured, parse_variant, variant_config
    finally:
        sys.path.remove(str(BENCH))
    from headscope.hybrid.inference import DEFAULT, inference_config

    name, ch = parse_variant("compiled_tail:tail_kernel=False,gdn_block_tokens=4096,tail_mode=None,prefill=lean")
    assert name == "compiled_tail"
    assert ch == {"tail_kernel": False, "gdn_block_tokens": 4096, "tail_mode": None, "prefill": "lean"}
    cfg = variant_config(ch)
    assert (cfg.tail_kernel, cfg.gdn_block_tokens, cfg.prefill) == (False, 4096, "lean")
    assert cfg.flash_qla == DEFAULT.flash_qla  # the rest: the defaults
    assert parse_variant("again:") == ("again", {})
    with pytest.raises(ValueError, match="field=value"):
        parse_variant("x:no_such=1")
    with pytest.raises(ValueError, match="field=value"):
        parse_variant("x:lean.DECODE_GDN=kernel")  # the old module switches are gone
    with pytest.raises(ValueError, match="prefill must be a backend name"):
        parse_variant("x:prefill=5")
    from transformers import LlamaConfig

    from headscope.hybrid import HeadwiseHybridAttention

    model = HeadwiseHybridAttention(LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                                head_dim=16), 0, [0])
    with pytest.raises(RuntimeError):  # configured: the config holds inside the block and is restored after an error
        with configured([model], cfg):
            assert inference_config(model) is cfg
            raise RuntimeError
    assert inference_config(model) is DEFAULT


def _rank8b():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_rank_8b
    finally:
        sys.path.remove(str(BENCH))
    return gpu_rank_8b


def test_rank8b_merge_into_adds_the_screen_with_recall_and_keeps_the_stored_result(tmp_path):
    """gpu_rank_8b --merge-into: recall@10 of a screen piece against the exact IE of rerun engine pieces, written
    into a merged result that has no per-head IE, everything stored kept. 2 layers x 6 heads, m_clean 1 and
    m_corrupt 0 in both pairs, so exact IE = 1 - patched: head i (row-major) has IE 0.1 i, exact top 10 = heads
    2..11; the screen ranks in reverse (top 10 = heads 0..9): 8 in common -> recall 0.8."""
    import json

    g = _rank8b()
    cfg = {"shape": {"hidden_size": 8}, "dtype": "bfloat16", "init": "x", "planted_head": {"layer": 0},
           "tokenizer": "tok", "tokenizer_vocab": 100, "task": "niah_single", "seq_len": 64, "depths": [0.1, 0.9],
           "n_pairs": 2, "readout": "r", "precision": {"residual": "model"}, "budget_s": 540.0}
    ie = [[0.1 * (6 * lay + h) for h in range(6)] for lay in range(2)]
    patched = [[1.0 - v for v in row] for row in ie]

    def engine(i):
        return {str(i): {"seconds": 10.0 + i, "counted_flops": 1.0, "m_clean": 1.0, "m_corrupt": 0.0,
                         "patched": patched}}

    a = {"piece": ["engine"], "pair_idx": [0], "config": cfg, "pair_lengths": [60, 60], "heads": 12,
         "engine": engine(0), "wall_seconds": 20.0}
    b = {"piece": ["engine", "screen"], "pair_idx": [1], "config": cfg, "pair_lengths": [60, 60], "heads": 12,
         "engine": engine(1), "wall_seconds": 30.0,
         "screen": {"seconds": 5.0, "pairs": 2, "verified": 7, "certified": True, "top10": [],
                    "stats": {"n_verified": 7}, "mean_ie": [[1.1 - v for v in row] for row in ie]}}
    stored = {"heads": 12, "seconds": 99.0, "gaps": {"0": 1.0, "1": 0.9}, "config": {**cfg, "tokenizer": "other"},
              "pair_lengths": [60, 60], "fp32_reference": {"pair": 0, "ie": {"0,1": 0.2}},
              "pieces": [{"piece": ["engine"], "pair_idx": [0, 1]}]}
    pa, pb, ps = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "stored.json"
    for path, obj in ((pa, a), (pb, b), (ps, stored)):
        path.write_text(json.dumps(obj))
    with pytest.raises(SystemExit, match=r"engine pairs \[0\] are in none"):
        g.merge_into([str(pb)], str(ps))
    assert json.loads(ps.read_text()) == stored  # refused before writing
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**a, "config": {**cfg, "depths": [0.5, 0.5]}}))
    with pytest.raises(SystemExit, match=r"differs .* in \['depths'\]"):
        g.merge_into([str(other), str(pb)], str(ps))

    out = g.merge_into([str(pa), str(pb)], str(ps))
    assert json.loads(ps.read_text()) == out
    assert {k: out[k] for k in stored if k != "pieces"} == {k: v for k, v in stored.items() if k != "pieces"}
    assert out["pieces"][0] == stored["pieces"][0] and [p["used_for"] for p in out["pieces"][1:]] == ["screen"] * 2
    sc = out["screen"]
    assert sc["recall_at_10"] == 0.8 and sc["verified"] == 7 and sc["seconds"] == 5.0 and "mean_ie" not in sc
    assert sc["exact_top10"] == [[1, 5], [1, 4], [1, 3], [1, 2], [1, 1], [1, 0], [0, 5], [0, 4], [0, 3], [0, 2]]
    ref = sc["exact_reference"]
    assert ref["pairs"] == ["0", "1"] and ref["seconds_per_pair"] == {"0": 10.0, "1": 11.0}
    assert ref["max_abs_gap_diff_vs_stored"] == pytest.approx(0.1)  # gaps 1.0 rerun vs 1.0 / 0.9 stored
    assert ref["max_abs_diff_ie_vs_stored_fp32_reference"] == pytest.approx(0.1)  # head (0, 1): 0.1 vs 0.2


# ---------------------------------------------------------------------------------------------------------------------
# issue 61's per-family table: benchmarks/family_configs.py, the benchmarks' --family, families.sh, families_table.py
# ---------------------------------------------------------------------------------------------------------------------

def _bench(name):
    """A benchmark script imported as a module (benchmarks/ on sys.path while it imports its siblings)."""
    import importlib

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _main(monkeypatch, name, *argv):
    monkeypatch.setattr(sys, "argv", [name + ".py", *argv])
    _bench(name).main()


def test_family_configs_have_the_real_geometry_and_a_7to1_mask():
    """Each family's GPU config is its real model's geometry, and its mask has max(L, round(L·H/8)) FA heads, at least
    one per layer (by hand: Qwen2.5-0.5B 24·14/8 = 42, Qwen3-0.6B 28·16/8 = 56, Mistral 8·32/8 = 32, Gemma 3 18·4/8 = 9
    -> 18, Pythia 12·12/8 = 18; SmolLM2's ranked mask 34); the smoke configs are the tests' tiny models."""
    fc = _bench("family_configs")
    want = {"smollm2": ((30, 9, 3), 34, 49152), "qwen2": ((24, 14, 2), 42, 151936), "qwen3": ((28, 16, 8), 56, 151936),
            "mistral": ((8, 32, 8), 32, 32000), "gemma3": ((18, 4, 1), 18, 262144), "gpt-neox": ((12, 12, 12), 18, 50304)}
    assert set(fc.FAMILIES) == set(want) == set(fc.TRAIN_SHAPE)
    for fam, (geo, n_fa, vocab) in want.items():
        cfg, mask, what = fc.family_config(fam)
        assert fc.geometry(cfg) == geo and cfg.vocab_size == vocab and cfg._attn_implementation == "sdpa", fam
        assert mask.n_fa == n_fa and all(len(h) >= 1 for h in mask.fa_heads) and what, fam
        tiny, tmask, _ = fc.smoke_config(fam)
        assert fc.geometry(tiny) == (tmask.n_layers, tmask.n_heads, tmask.n_kv_heads) and tiny.hidden_size == 64
    assert fc.family_config("qwen2")[0].model_type == "qwen2" and fc.family_config("mistral", layers=4)[0].num_hidden_layers == 4
    assert fc.family_config("gemma3")[0].layer_types.count("full_attention") == 3  # 5 sliding : 1 full
    with pytest.raises(ValueError, match="unknown family"):
        fc.family_config("gpt2")


def test_bench_generate_smoke_of_a_family_with_biases(tmp_path, monkeypatch):
    """bench_generate.py --smoke --family qwen2 --cells: exactly the cells asked, each with both models' ms per token,
    first calls and the ratio; the hybrid's generate agrees with its cache-free forward at every step (fp32)."""
    import json

    out = tmp_path / "gen.json"
    _main(monkeypatch, "bench_generate", "--smoke", "--family", "qwen2", "--settings", "default", "--cells", "1x40,2x24",
          "--out", str(out))
    res = json.loads(out.read_text())
    assert res["family"] == "qwen2" and list(res["settings"]) == ["default"]
    assert [(c["batch"], c["prompt"]) for c in res["cells"]] == [(1, 40), (2, 24)]
    for c in res["cells"]:
        assert c["hybrid_over_teacher"] == round(c["hybrid_ms_per_token"] / c["teacher_ms_per_token"], 3)
        assert c["teacher_first_call_ms"] > 0 and c["hybrid_first_call_ms"] > 0 and "error" not in c
    assert res["check_tokens"] == {"torch.float32": {"default": {"steps": 16, "differing": 0, "max_margin": 0.0}}}
    assert set(res["backends"]) == {"train", "prefill", "decode", "captured_decode"}
    with pytest.raises(SystemExit):
        _main(monkeypatch, "bench_generate", "--smoke", "--cells", "1x", "--out", str(out))


@pytest.mark.parametrize("family,mode", [("gemma3", "cold"), ("gpt-neox", "warm_up")])
def test_bench_first_call_child_of_a_family(family, mode):
    """bench_first_call.py's measurement (the fresh process's body) on the family's tiny model: every timed call ran
    and the backends it resolved are recorded."""
    fc = _bench("bench_first_call")
    got = fc._child(mode, 1, 40, 3, True, "tiny", family)
    keys = {"cold": ("teacher_first_s", "teacher_second_s", "hybrid_first_s", "hybrid_second_s"),
            "warm_up": ("warm_up_s", "hybrid_first_after_warm_up_s")}[mode]
    assert all(got[k] > 0 for k in keys) and set(got["backends"]) >= {"prefill", "decode"}
    assert got["inference_config"]["decode"] == "auto"


@pytest.mark.parametrize("family", ["gemma3", "gpt-neox"])
def test_bench_train_smoke_of_a_family(tmp_path, monkeypatch, family):
    """bench_train.py --smoke --family: only stage 2 at one shape, the teacher's compiled dense step (Dynamo, eager
    backend on the CPU) and the hybrid's step, with their ratio; both families take the fast step (GPT-NeoX since
    issue 61 gave it a body) with the fused train backend, and the file says so."""
    import json

    out = tmp_path / "train.json"
    _main(monkeypatch, "bench_train", "--smoke", "--family", family, "--out", str(out))
    rep = json.loads(out.read_text())
    assert rep["family"] == family and not rep["errors"] and list(rep["results"]) == ["stage2_2x32"]
    r = rep["results"]["stage2_2x32"]
    assert set(r) == {"dense_compiled", "hybrid_fast"}
    acc = rep["acceptance"]["stage2_2x32"]
    assert acc["ratio_vs_dense_compiled"] == pytest.approx(r["hybrid_fast"]["tok_s"] / r["dense_compiled"]["tok_s"])
    assert all(x > 0 for v in r.values() for x in v["losses"])
    assert acc["hybrid_fast_step"] is True and acc["hybrid_fast_unavailable"] is None
    assert r["hybrid_fast"]["backends"]["train"] == ["fused"]


def test_gpu_greedy_real_smoke(tmp_path, monkeypatch):
    """gpu_greedy_real.py --smoke (tiny Gemma 3, CPU, fp32): the named fast backends (lean prefill and decode, the
    captured step) give the reference's greedy tokens, and the file says which backends each path took."""
    import json

    out = tmp_path / "greedy.json"
    _main(monkeypatch, "gpu_greedy_real", "--smoke", "--family", "gemma3", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["equal"] is True and len(res["runs"]) == 2
    for r in res["runs"]:
        assert r["equal"] and r["fast_tokens"] == r["reference_tokens"] and len(r["fast_tokens"]) == 6
        assert r["reference_argmax_is_its_token"] and r["min_reference_margin"] > 0
        assert r["fast_backends"]["prefill"] == ["lean"] and r["reference_backends"]["prefill"] == ["reference"]


FAMILIES_SH = BENCH / "recipes" / "families.sh"


def test_families_recipe_runs_the_parts_it_is_given(tmp_path):
    """families.sh OUT PART...: each part is one command with its own result file and log (a stand-in Python records
    the arguments); a failing part does not stop the next, the exit code says one failed; unknown parts or families
    are refused before anything runs."""
    stub = tmp_path / "py"
    stub.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\ncase "$*" in *train_gemma3*) exit 3;; esac\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(stub)}
    r = subprocess.run(["bash", str(FAMILIES_SH), str(out), "gen_qwen3", "train_gemma3", "first_gpt-neox",
                        "greedy_gemma3"], capture_output=True, text=True, env={**env, "GEMMA3_GGUF": "/x/g.gguf"},
                       cwd=BENCH.parent, timeout=60)
    assert r.returncode == 1 and "failed parts: train_gemma3" in r.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [
        f"benchmarks/bench_generate.py --family qwen3 --settings default --cells 1x8192,16x32768 --reps 1 "
        f"--out {out}/generate_qwen3.json",
        f"benchmarks/bench_train.py --family gemma3 --out {out}/train_gemma3.json",
        f"benchmarks/bench_first_call.py --family gpt-neox --batches 1 --lengths 8192 --cache-dir "
        f"/tmp/first_call_gpt-neox --out {out}/first_call_gpt-neox.json",
        f"benchmarks/gpu_greedy_real.py --model /x/g.gguf --out {out}/greedy_gemma3.json"]
    assert sorted(p.name for p in out.iterdir()) == ["first_gpt-neox.log", "gen_qwen3.log", "greedy_gemma3.log",
                                                      "train_gemma3.log"]
    for bad in ("gen_llama", "rank_smollm2"):
        r = subprocess.run(["bash", str(FAMILIES_SH), str(out), "gen_qwen2", bad], capture_output=True, text=True,
                           env=env, cwd=BENCH.parent, timeout=60)
        assert r.returncode == 2 and "unknown" in r.stderr and len((tmp_path / "calls").read_text().splitlines()) == 4


@pytest.mark.slow
def test_families_recipe_commands_parse_on_the_cpu(tmp_path):
    """Each kind of part with the real scripts on a machine without CUDA: the arguments parse and every script stops
    at its GPU check (not on an unknown flag, not building a model)."""
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("checks the scripts' refusal without CUDA")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(BENCH.parent)}
    # two runs of two parts at once (each part a process that mostly imports: one core each); each run goes on past
    # its first part's failure and exits 1
    runs = [subprocess.Popen(["bash", str(FAMILIES_SH), str(out), *parts], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=BENCH.parent, env=env)
            for parts in (("gen_mistral", "train_qwen2"), ("first_gemma3", "greedy_smollm2"))]
    for r in runs:
        stdout = r.communicate(timeout=600)[0]
        assert r.returncode == 1 and stdout.count("== ") == 4, stdout[-2000:]
    for part in ("gen_mistral", "train_qwen2", "first_gemma3", "greedy_smollm2"):
        log = (out / f"{part}.log").read_text()
        assert "GPU host" in log and "unrecognized" not in log and "Traceback" not in log, (part, log[-1000:])


def test_families_table_from_hand_made_result_files(tmp_path):
    """families_table.py on small result files with hand-set figures: each goal marked met or missed at its bound
    (generate ≤ 0.6, training ≥ 0.9, first call ≤ the teacher's + 2 s, greedy equal), an out-of-memory cell and a failed
    training run as missed, absent files as not measured, links to the files that are there, the tally below."""
    import json

    H100 = "NVIDIA H100 80GB HBM3"

    def cell(B, T, h=None, t=None, fh=None, ft=None, error=None):
        c = {"setting": "default", "batch": B, "prompt": T}
        if error:
            return {**c, "error": error}
        return {**c, "teacher_ms_per_token": t, "hybrid_ms_per_token": h, "hybrid_over_teacher": round(h / t, 3),
                "teacher_first_call_ms": ft, "hybrid_first_call_ms": fh}

    def run(dtype, prompt, equal, first=None, margin=None):
        return {"dtype": dtype, "prompt": prompt, "steps": 32, "equal": equal, "first_difference": first,
                "reference_margin_at_first_difference": margin}

    files = {
        "generate_qwen3": {"versions": {"device": H100}, "cells": [
            cell(1, 8192, h=5.0, t=20.0, fh=2100.0, ft=400.0),  # 0.25 met; 2.1 s <= 0.4 + 2 met
            {**cell(16, 32768, error={"teacher": "OutOfMemoryError: CUDA out of memory"}),  # no teacher: not counted
             "hybrid_ms_per_token": 3.0, "hybrid_first_call_ms": 5000.0}]},
        "generate_mistral": {"versions": {"device": H100}, "cells": [
            cell(1, 8192, error={"hybrid": "OutOfMemoryError: CUDA out of memory", "teacher": "RuntimeError: x"})]},
        "train_qwen3": {"device": H100, "acceptance": {"stage2_16x512": {
            "ratio_vs_dense_compiled": 0.85, "hybrid_tok_s": 85000.0, "dense_compiled_tok_s": 100000.0,
            "hybrid_fast_step": True}}, "errors": {}},
        "first_call_qwen3": {"cells": [{"batch": 1, "prompt": 8192, "hybrid_first_cached_s": 0.94}]},
        "generate_gemma3": {"versions": {"device": H100}, "cells": [
            cell(1, 8192, h=6.1, t=10.0, fh=31000.0, ft=2200.0),  # 0.61 missed; 31.0 > 2.2 + 2 missed
            cell(16, 32768, h=1.0, t=20.0, fh=3000.0, ft=1500.0)]},  # 0.05 met; 3.0 <= 3.5 met
        "train_gemma3": {"device": H100, "acceptance": {},
                         "errors": {"stage2_16x512/hybrid_fast": "OutOfMemoryError: CUDA out of memory. Tried"}},
        "greedy_gemma3": {"versions": {"device": H100}, "runs": [
            run("torch.bfloat16", 0, False, 5, 0.0078), run("torch.bfloat16", 1, True),
            run("torch.float32", 0, True), run("torch.float32", 1, True)]},
        "greedy_smollm2": {"versions": {"device": H100}, "runs": [run("torch.bfloat16", 0, True)]},
        "train_gpt-neox": {"device": H100, "acceptance": {"stage2_32x512": {
            "ratio_vs_dense_compiled": 0.5, "hybrid_tok_s": 50000.0, "dense_compiled_tok_s": 100000.0,
            "hybrid_fast_step": False}}, "errors": {}},
    }
    for name, data in files.items():
        (tmp_path / f"h100_{name}.json").write_text(json.dumps(data))
    ft = _bench("families_table")
    text = ft.markdown(tmp_path, prefix="h100_", link_dir="R/")
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in text.splitlines()[2:8]}
    L = "[{0}](R/h100_{1}.json)"
    assert rows["Qwen3-0.6B"] == [
        "0.25 (5.00 / 20.00 ms): met", "teacher out of memory; hybrid 3.00 ms",
        "0.85 (85.0K / 100.0K tok/s, 16 × 512): **missed**", "2.1 / 0.4 s: met (caches kept: 0.9 s)",
        "5.0 s / teacher out of memory", "no checkpoint installed",
        " ".join(L.format(k, f) for k, f in (("generate", "generate_qwen3"), ("train", "train_qwen3"),
                                              ("first call", "first_call_qwen3"))) + " |"]
    assert rows["Gemma 3 270M"][:6] == [
        "0.61 (6.10 / 10.00 ms): **missed**", "0.050 (1.00 / 20.00 ms): met",
        "failed (hybrid_fast: OutOfMemoryError): **missed**", "31.0 / 2.2 s: **missed**", "3.0 / 1.5 s: met",
        "differ in 1 of 4 (bfloat16 prompt 0 from step 5, reference margin 0.0078; 2 prompts × 32 tokens, "
        "bfloat16 + float32): **missed**"]
    assert rows["SmolLM2-135M"][:6] == ["not measured"] * 5 + ["equal (1 prompts × 32 tokens, bfloat16): met"]
    assert rows["Mistral-7B layer shape, 8 layers"][:5] == [
        "failed (hybrid, teacher): **missed**", "not measured", "not measured", "failed (hybrid, teacher): **missed**",
        "not measured"]
    assert rows["Pythia-160M (GPT-NeoX)"][2] == "0.50 (50.0K / 100.0K tok/s, 32 × 512, plain step): **missed**"
    assert rows["Qwen2.5-0.5B config (biases)"] == ["not measured"] * 5 + ["no checkpoint installed", "— |"]
    assert text.splitlines()[-2] == f"Devices: {H100}."
    assert text.splitlines()[-1] == (
        "Goals met: generate B1·8K 1 of 3; generate B16·32K 1 of 1; training step 0 of 3; first call B1·8K 1 of 3; "
        "first call B16·32K 1 of 1; greedy tokens 1 of 2.")
