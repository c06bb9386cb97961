"""experiments/conversion.py plan → sample → pack → queue → report on a tiny model (CPU): token budgets,
deduplication, resumable jobs, retrieval curves and Wilson intervals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import experiment_module, tiny_llama
from headscope.masks import HeadMask
from headscope.evaluation.accuracy import wilson_interval




def test_wilson_interval_matches_the_closed_form():
    z = 1.959963984540054
    for k, n in [(7, 10), (0, 40), (100, 100), (33, 100)]:
        p = k / n
        c = (p + z * z / (2 * n)) / (1 + z * z / n)
        h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lo, hi = wilson_interval(k, n)
        assert lo == pytest.approx(c - h, abs=1e-9) and hi == pytest.approx(c + h, abs=1e-9)
    with pytest.raises(ValueError, match="hits"):
        wilson_interval(5, 4)


def test_retrieval_hits_equal_greedy_generation(smol_tokenizer):
    """retrieval_hits (bucketed right padding, logits only at the read rows) against greedy generation, one
    prompt at a time: answers set to the model's own greedy continuation must all be hits, and the same
    answers with their last token changed must all be misses."""
    import dataclasses

    from conftest import tiny_llama
    from headscope.tasks import make_pairs
    from headscope.evaluation.accuracy import retrieval_hits

    model = tiny_llama(smol_tokenizer)
    pairs = make_pairs("niah_single", smol_tokenizer, n_pairs=6, seq_len=160, seed=3)
    own, wrong = [], []
    for p in pairs:
        with torch.no_grad():
            gen = model.generate(p.clean[None], attention_mask=torch.ones_like(p.clean[None]), do_sample=False,
                                 max_new_tokens=p.n_answer, min_new_tokens=p.n_answer, pad_token_id=0)[0, p.length :]
        own.append(dataclasses.replace(p, answer=gen, counter_answer=(gen + 1) % len(smol_tokenizer)))
        bad = gen.clone()
        bad[-1] = (bad[-1] + 1) % len(smol_tokenizer)
        wrong.append(dataclasses.replace(p, answer=bad, counter_answer=gen))
    pad = smol_tokenizer.eos_token_id
    for pm in (1, 256):
        assert retrieval_hits(model, own, pad, batch_size=4, pad_multiple=pm).all()
        assert not retrieval_hits(model, wrong, pad, batch_size=4, pad_multiple=pm).any()


@pytest.fixture(scope="module")
def small_dir(small_tokenizer, tmp_path_factory):
    """The tiny Llama on the 2,048-token small_tokenizer, saved as a model directory (its sampling and training are
    the layers' cost, not a 49,152-token LM head's)."""
    d = tmp_path_factory.mktemp("tiny-small-vocab")
    tiny_llama(small_tokenizer).save_pretrained(d)
    small_tokenizer.save_pretrained(d)
    return d


@pytest.mark.slow
def test_plan_sample_pack_queue_report(small_dir, tmp_path):
    from typer.testing import CliRunner

    conv = experiment_module("conversion")
    run = CliRunner()
    out = tmp_path / "conv"
    mask = HeadMask.from_heads([(0, 0), (1, 2)], 2, 4, 2)
    mask.to_json(tmp_path / "mask.json")

    def call(*args):
        res = run.invoke(conv.app, [str(a) for a in args])
        assert res.exit_code == 0, res.output + repr(res.exception)
        return res.output

    call("plan", "--out", out, "--mask", tmp_path / "mask.json", "--model", small_dir, "--budget", "2",
         "--tokens", 4096, "--ablation-tokens", 2048, "--seq-len", 32, "--long-len", 512, "--batch", 2, "--batch-long", 1,
         "--task", "niah_single", "--task", "variable_tracking", "--eval-lengths", 256, "--eval-n", 4, "--eval-batch", 2,
         "--curve-n", 2, "--curve-lengths", 256, "--ablation-task", "niah_single", "--ablation-lengths", 128, "--pieces", "1,2,2", "--ckpt-every", 0, "--gdn-kernel", "torch",
         "--options", '{"fa_pos": "nope", "gdn_rope": true, "fa_gate": true}')
    s = json.loads((out / "settings.json").read_text())
    # 4096 tokens split 15/55/30 % into whole steps (2 × 32 tokens for stages 1-2, 1 × 512 for stage 3)
    assert (s["tokens1"], s["tokens2"], s["tokens3"]) == (64 * round(614.4 / 64), 64 * round(2252.8 / 64), 512 * round(1228.8 / 512))
    assert sorted(p.stem for p in (out / "masks").glob("*.json")) == ["allgdn", "hydrahead", "layerwise", "layerwise3", "random"]
    assert json.loads((out / "jobs" / "abl1_fa_nope.json").read_text())["options"] == {"fa_pos": "nope", "gdn_rope": False, "fa_gate": False}

    call("sample", "--out", out, "--model", small_dir, "--device", "cpu", "--batch", 8, "--doc-len", 40, "--max-docs", 24,
         "--seconds", 1e9)
    blob = torch.load(out / "data" / "docs_0.pt")
    assert len(blob["docs"]) == 24 and all(len(d) == 41 for d in blob["docs"])
    torch.save(blob, out / "data" / "docs_1.pt")  # a shard that repeats shard 0: every document is a duplicate
    info = json.loads(call("pack", "--out", out, "--model", small_dir, "--heldout-docs", 4).strip().splitlines()[-1])
    assert info["docs"] == 48 and info["duplicates_dropped"] >= 24 and info["heldout_docs"] == 4
    assert info["docs_per_shard"] == [24, 24] and len(info["docs_sha256"]) == 64
    assert info["text_docs"] == 48 - info["duplicates_dropped"] - 4
    # stage 3: a quarter of the rows are retrieval rows, in equal shares of the two tasks
    n_ret = max(1, round(info["long_text_rows"] * 0.25 / 0.75))
    assert info["long_retrieval_rows"] == 2 * max(1, n_ret // 2)
    assert len(torch.load(out / "data" / "long.pt")["ids"]) == info["long_text_rows"] + info["long_retrieval_rows"]

    call("queue", "--out", out, "--jobs", "hydrahead,abl0_base,teacher", "--model", small_dir, "--device", "cpu")
    ev = json.loads((out / "hydrahead" / "eval.json").read_text())
    assert [ev["train"][str(k)]["tokens"] for k in (1, 2, 3)] == [s["tokens1"], s["tokens2"], s["tokens3"]]
    assert ev["options"]["fa_pos"] == "nope" and ev["options"]["fa_gate"] is True
    abl = json.loads((out / "abl0_base" / "eval.json").read_text())
    assert abl["options"]["fa_pos"] == "rope" and sum(abl["train"][str(k)]["tokens"] for k in (1, 2, 3)) == 64 * 5 + 64 * 18 + 512 * 1
    assert sorted(k for k in abl if "@" in k) == ["niah_single@128"]  # the ablation's own evaluation
    for cell in ("niah_single@256", "variable_tracking@256"):
        c = ev[cell]
        assert c["n"] == 4 and c["hits"] == round(c["accuracy"] * 4) and (c["lo"], c["hi"]) == wilson_interval(c["hits"], 4)
    # one retrieval point after each piece: stage 1 in one piece, stages 2 and 3 in two
    curve = [json.loads(x) for x in (out / "hydrahead" / "curve.jsonl").read_text().splitlines()]
    seen = [r["tokens_seen"] for r in curve]
    assert [r["stage"] for r in curve] == [1, 2, 2, 3, 3] and seen == sorted(seen) and seen[-1] == sum(
        s[f"tokens{k}"] for k in (1, 2, 3))

    # resumable: with eval.json gone the job re-evaluates from the saved stage-3 student, without training
    log = out / "hydrahead" / "stage3" / "log.csv"
    n_rows = len(pd.read_csv(log))
    (out / "hydrahead" / "eval.json").unlink()
    call("queue", "--out", out, "--jobs", "hydrahead", "--model", small_dir, "--device", "cpu")
    again = json.loads((out / "hydrahead" / "eval.json").read_text())
    assert len(pd.read_csv(log)) == n_rows and again["ppl"] == pytest.approx(ev["ppl"], rel=1e-6)
    assert again["niah_single@256"]["hits"] == ev["niah_single@256"]["hits"]

    table = conv.report(out)
    assert list(table["model"]) == ["teacher", "hydrahead", "abl0_base"]
    ci = pd.read_csv(out / "results_ci.csv")
    assert len(ci) == 2 * 2 + 1 and (ci["lo"] <= ci["accuracy"]).all() and (ci["accuracy"] <= ci["hi"]).all()
    rc = pd.read_csv(out / "retrieval_curves.csv")
    # the ablation's stage 3 is one step: its two pieces end at the same step, one point
    assert set(rc["model"]) == {"hydrahead", "abl0_base"} and len(rc) == 5 + 4
    # an evaluation stopped part-way: its finished cells are reported, the row marked
    (out / "teacher" / "eval.json").rename(out / "teacher" / "eval.partial.json")
    table = conv.report(out)
    assert not (out / "teacher" / "eval.partial.json").with_name("eval.json").exists()
    assert list(table["model"]) == ["teacher (partial)", "hydrahead", "abl0_base"]
    assert table.iloc[0]["niah_single@256"] == json.loads((out / "teacher" / "eval.partial.json").read_text())["niah_single@256"]["accuracy"]
    assert not list(out.glob("*/eval.partial.json"))[1:]  # finished jobs leave no partial file behind


@pytest.mark.slow
def test_gpu_conversion_script_end_to_end_on_cpu(tmp_path, small_tokenizer):
    """experiments/gpu_conversion.sh with both "devices" on the CPU and tiny settings: plan, two sampling
    shards, the teacher's cells beside them, pack, three queues (main masks, teacher, ablation) and the report; a
    second run does nothing. Each process keeps to one intra-op thread (OMP_NUM_THREADS=1): up to four run at once on
a 2-core machine, where two threads each spin against each other (queues 21 -> 13 s). Smallest settings: each shard is one sampling batch (SAMPLE_BATCH 24 >= its
    documents), and the main models' budget is the smallest whose stage 3 is still one step (1,024 tokens: 2 + 9 + 1
    steps)."""
    import os
    import subprocess
    import sys

    from conftest import tiny_llama

    model = tmp_path / "tiny"
    tiny_llama(small_tokenizer).save_pretrained(model)  # 2,048 tokens: sampling and training are the layers' cost
    small_tokenizer.save_pretrained(model)
    HeadMask.from_heads([(0, 0), (1, 2)], 2, 4, 2).to_json(tmp_path / "mask.json")
    out = tmp_path / "conv"
    env = {**os.environ, "MODEL": str(model), "CONV_OUT": str(out), "MASK": str(tmp_path / "mask.json"),
           "DEV0": "cpu", "DEV1": "cpu", "TOKENS": "1024", "ABL_TOKENS": "1024", "EVAL_N": "2", "SAMPLE_S": "1000",
           "SAMPLE_BATCH": "24", "SAMPLE_MAX_DOCS": "16,24", "HELDOUT_DOCS": "4", "WARMUP": "", "PYTHON": sys.executable,
           "SAMPLE_ARGS": "--doc-len 40", "EARLY_TEACHER": "1", "DEV2": "cpu", "OMP_NUM_THREADS": "1",
           "JOBS0": "hydrahead,layerwise3,abl0_base", "JOBS1": "layerwise,random,teacher,abl1_fa_nope",
           "JOBS2": "abl2_gdn_rope,abl3_fa_gate",
           "EXTRA_PLAN": "--seq-len 32 --long-len 512 --batch 2 --batch-long 1 --task niah_single --eval-lengths 192 "
                         "--curve-n 0 --ablation-task niah_single --ablation-lengths 192 --gdn-kernel torch --budget 2 "
                         "--eval-batch 2 --pieces 1,1,1"}
    root = Path(__file__).resolve().parents[1]
    for n in range(2):
        res = subprocess.run(["bash", "experiments/gpu_conversion.sh"], cwd=root, env=env, capture_output=True, text=True,
                             timeout=900)
        assert res.returncode == 0, res.stdout + res.stderr
        if n == 0:  # the second run starts no queue: every job finished (the queue's own skip: the test below)
            queue_logs = {p.name: p.read_text() for p in (out / "logs").glob("queue*.log")}
    assert len(queue_logs) == 3 and queue_logs == {p.name: p.read_text() for p in (out / "logs").glob("queue*.log")}
    steps = (out / "logs" / "steps.log").read_text().splitlines()
    assert [x.split("] ")[1] for x in steps].count("done") == 2 and sum("sample on" in x for x in steps) == 1
    info = json.loads((out / "data" / "info.json").read_text())
    assert info["docs_per_shard"] == [16, 24]
    assert [(out / "logs" / f"sample{k}.log").read_text().count(" docs, batch ") for k in (0, 1)] == [1, 1]
    table = pd.read_csv(out / "results.csv")
    jobs = ["hydrahead", "layerwise3", "abl0_base", "abl2_gdn_rope", "layerwise", "random", "teacher", "abl1_fa_nope",
            "abl3_fa_gate"]
    assert sorted(table["model"]) == sorted(jobs)
    s = json.loads((out / "settings.json").read_text())
    hyd = table.set_index("model").loc["hydrahead"]
    assert [hyd[f"tokens{k}"] for k in (1, 2, 3)] == [s["tokens1"], s["tokens2"], s["tokens3"]]
    # the evaluation prompts were built once, by the `pairs` step, one file per (task, length, n)
    assert sorted(p.name for p in (out / "eval_pairs").iterdir()) == ["niah_single@192_n2_s1234.json.gz"]
    assert "1 prompt sets" in (out / "logs" / "pairs.log").read_text()
    # the teacher's cells ran beside the sampling (no held-out data yet); its queue added the perplexity
    assert "retrieval cells done" in (out / "logs" / "teacher_early.log").read_text()
    assert table.set_index("model").loc["teacher", "ppl"] > 1 and not (out / "teacher" / "eval.partial.json").exists()
    assert "abl3_fa_gate done" in (out / "logs" / "queue2.log").read_text()


@pytest.mark.slow
def test_queue_goes_on_after_a_failed_job_and_retries_it(tmp_path, monkeypatch):
    import typer

    conv = experiment_module("conversion")
    calls, fails = [], {"b": 1, "d": 99}

    def fake_convert(out, name, model, device, train_seconds):
        calls.append(name)
        if fails.get(name, 0) > 0:
            fails[name] -= 1
            raise RuntimeError(f"CUDA out of memory ({name})")
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "eval.json").write_text("{}")

    monkeypatch.setattr(conv, "convert_one", fake_convert)
    conv.queue(out=tmp_path, jobs="a,b,c", model="m", device=None, retries=1)
    assert calls == ["a", "b", "c", "b"] and (tmp_path / "b" / "eval.json").exists()
    calls.clear()
    conv.queue(out=tmp_path, jobs="a,b,c", model="m", device=None, retries=1)  # finished jobs (eval.json) are skipped
    assert calls == []
    with pytest.raises(typer.Exit) as e:  # a job that keeps failing: the others still run, exit status 1
        conv.queue(out=tmp_path, jobs="d,e", model="m", device=None, retries=2)
    assert e.value.exit_code == 1 and calls == ["d", "e", "d", "d"]
