"""Conversion runs that test a head mask (issue 8; SPEC.md §8–9, paper section 4.3).

Converts a teacher (default SmolLM2-135M-Instruct) into head-wise FA/GDN hybrids at one FA budget
(7:1, >= 1 FA head per layer) with four masks, trains each with the same three-stage transfer and
the same token budget per stage, and evaluates each (and the teacher) on retrieval accuracy
(teacher-forced greedy exact match of the answer, :func:`headscope.readout.greedy_exact_match`) at
several context lengths and on held-out perplexity of teacher-sampled text.

Masks:
  hydrahead  top heads of a causal ranking (``--ranking DIR`` written by ``headscope rank``) or a
             given ``--mask mask.json``, under the budget with >= 1 FA head per layer
  random     the same constrained selection on seeded random scores
  layerwise  whole FA layers, as many heads as the budget rounds to (K / n_heads layers), evenly spaced
  layerwise3 whole FA layers at 3:1 (a quarter of the layers, evenly spaced): the paper's layer-wise hybrid
  allgdn     no FA head at all

Usage::

    python experiments/conversion.py run --ranking runs/rank --out runs/conversion \\
        --tokens1 1e6 --tokens2 2e6 --tokens3 1e6 --device cuda --parallel

Writes OUT/data/ (shared rows), OUT/<mask>/stage{1,2,3}/log.csv, OUT/<mask>/eval.json, OUT/teacher/eval.json,
OUT/results.csv + OUT/results.md (the table) and OUT/curves.csv.gz (losses of all runs). Re-running skips
finished evaluations.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

from headscope.runtime import lean_gc

if __name__ == "__main__":  # a command process: collections tuned before the heavy imports (runtime.lean_gc)
    lean_gc()

import numpy as np  # noqa: E402
import pandas as pd
import torch
import typer

from headscope.masks import HeadMask, parse_budget
from headscope.models import check_model, load_hf, load_tokenizer
from headscope.train import (
    TokenRows,
    TrainConfig,
    convert_stage,
    load_student,
    pack,
    sample_teacher_text,
    stage_rows,
)
from headscope.evaluation.accuracy import eval_pairs, evaluate, wilson_interval

app = typer.Typer(add_completion=False)
torch.backends.cuda.matmul.allow_tf32 = True
MASKS = ("hydrahead", "random", "layerwise", "layerwise3", "allgdn")


# ---------------------------------------------------------------------------------------------- masks
def _layerwise(n_layers: int, n_heads: int, n_kv: int, n_fa_layers: int, name: str) -> HeadMask:
    """Whole FA layers, ``n_fa_layers`` of them evenly spaced (the rest all GDN)."""
    layers = sorted({int((i + 0.5) * n_layers / n_fa_layers) for i in range(n_fa_layers)})
    return HeadMask.from_heads(
        [(l, h) for l in layers for h in range(n_heads)], n_layers, n_heads, n_kv,
        meta={"source": f"{name}({n_fa_layers} FA layers {layers})", "min_per_layer": 0},
    )


def build_masks(
    n_layers: int, n_heads: int, n_kv: int, hydra: HeadMask | np.ndarray, budget: str = "7:1", min_per_layer: int = 1, seed: int = 0
) -> dict[str, HeadMask]:
    """The masks of the comparison (see the module docstring): hydrahead, random and layerwise at
    ``budget``; layerwise3 = whole FA layers at 3:1 (a quarter of the layers, the paper's layer-wise
    comparison); allgdn.

    ``hydra``: a HeadMask (used as is) or a [layer, head] score matrix (selected under the budget).
    """
    k = parse_budget(budget, n_layers * n_heads)
    if isinstance(hydra, HeadMask):
        hm = hydra
    else:
        hm = HeadMask.select(np.asarray(hydra), budget, n_kv, min_per_layer=min_per_layer, meta={"source": "hydrahead"})
    rnd = np.random.default_rng(seed).random((n_layers, n_heads))
    rm = HeadMask.select(rnd, budget, n_kv, min_per_layer=min_per_layer, meta={"source": f"random(seed={seed})"})
    lw = _layerwise(n_layers, n_heads, n_kv, max(1, round(k / n_heads)), "layerwise")
    lw3 = _layerwise(n_layers, n_heads, n_kv, max(1, round(n_layers / 4)), "layerwise 3:1 ")
    ag = HeadMask(n_layers, n_heads, n_kv, tuple(() for _ in range(n_layers)), {"source": "allgdn", "min_per_layer": 0})
    return {"hydrahead": hm, "random": rm, "layerwise": lw, "layerwise3": lw3, "allgdn": ag}


# ---------------------------------------------------------------------------------------------- runs
def _settings(out: Path) -> dict:
    return json.loads((out / "settings.json").read_text())


def prepare(out: Path, model: str, device: Optional[str], s: dict) -> None:
    """Sample the shared training / held-out text from the teacher and build the rows of every stage."""
    d = out / "data"
    if (d / "done").exists():
        return
    d.mkdir(parents=True, exist_ok=True)
    # sampling runs in bf16 on a GPU (2x less KV cache, faster); the text is the teacher's own either way
    on_gpu = device is not None and str(device).startswith("cuda") or device is None and torch.cuda.is_available()
    teacher, tok, _ = load_hf(model, device=device, dtype=torch.bfloat16 if on_gpu else torch.float32)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    t0 = time.time()
    docs = sample_teacher_text(teacher, tok, s["text_docs"], s["doc_len"], seed=s["seed"], batch_size=s["sample_batch"])
    held = sample_teacher_text(teacher, tok, s["heldout_docs"], s["doc_len"], seed=s["seed"] + 999, batch_size=s["sample_batch"])
    short, long_rows, counts = stage_rows(docs, tok, s["seq_len"], s["long_len"], s["tasks"], s["retrieval_frac"], s["seed"])
    short.save(d / "short.pt")
    long_rows.save(d / "long.pt")
    pack(held, s["seq_len"], tok.eos_token_id).save(d / "heldout.pt")
    info = {"sample_seconds": round(time.time() - t0, 1), "text_docs": len(docs), "text_tokens": sum(map(len, docs)), **counts}
    (d / "info.json").write_text(json.dumps(info, indent=2))
    (d / "done").write_text("ok")


def _time_stages(teacher: Any, tok: Any, mask: HeadMask, out: Path, s: dict, kernel: str, steps: int) -> dict[int, float]:
    """Tokens per second of each stage for one conversion alone on the device (mean over ``steps``
    steps after two warm-up steps, which also compile the GDN kernels)."""
    from headscope.train import Trainer

    short, long_rows = TokenRows.load(out / "data" / "short.pt"), TokenRows.load(out / "data" / "long.pt")
    dev = next(teacher.parameters()).device
    student = load_student(teacher, mask, calibration_ids=short.ids[:8].to(dev), gdn_kernel=kernel)
    rates = {}
    for stage in (1, 2, 3):
        rows = long_rows if stage == 3 else short
        cfg = TrainConfig(stage=stage, tokens=10**12, batch_size=s["batch_long"] if stage == 3 else s["batch"], lr=1e-5,
                          ckpt_on_exit=False, save_student=False, progress=False)
        d = out / "calibration" / kernel / f"stage{stage}"
        if d.exists():
            shutil.rmtree(d)
        tr = Trainer(student, teacher, rows, cfg, d)
        secs = [tr.train_step()["seconds"] for _ in range(steps + 2)][2:]
        rates[stage] = tr.tokens_per_step / float(np.mean(secs))
        print(f"calibration: stage {stage} with gdn_kernel={kernel}: {rates[stage]:.0f} tokens/s alone", flush=True)
    del student
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rates


def calibrate(out: Path, model: str, device: Optional[str], s: dict, n_workers: int, n_devices: int, minutes: float,
              steps: int = 6, concurrency_gain: float = 1.2) -> dict:
    """Size the per-stage token budgets (the same for every mask) so that ``n_workers`` conversions
    sharing ``n_devices`` GPUs finish their training in about ``minutes``.

    Times each stage on the HydraHead mask; if the chosen GDN kernel fails (e.g. fla's backward on a
    Triton it refuses), falls back to the PyTorch kernel and records that. Per GPU, k concurrent
    conversions are assumed to reach ``concurrency_gain`` times one conversion's throughput in total
    (k ≥ 2). Budgets are split between the stages by ``share1..3`` of ``s``. Updates and returns ``s``.
    """
    teacher, tok, _ = load_hf(model, device=device)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    mask = HeadMask.from_json(out / "masks" / "hydrahead.json")
    kernel = s["gdn_kernel"]
    try:
        rates = _time_stages(teacher, tok, mask, out, s, kernel, steps)
    except Exception as e:  # noqa: BLE001 - any kernel failure: fall back and say so
        if kernel == "torch":
            raise
        print(f"calibration: gdn_kernel={kernel} failed ({type(e).__name__}: {e}); falling back to 'torch'", flush=True)
        s["kernel_fallback"] = f"{kernel} failed: {type(e).__name__}: {str(e)[:300]}"
        kernel = "torch"
        rates = _time_stages(teacher, tok, mask, out, s, kernel, steps)
    per_dev = math.ceil(n_workers / max(1, n_devices))
    speed = (concurrency_gain / per_dev) if per_dev > 1 else 1.0
    seconds = minutes * 60
    for st in (1, 2, 3):
        step_tokens = (s["batch_long"] * s["long_len"]) if st == 3 else (s["batch"] * s["seq_len"])
        tok_budget = rates[st] * speed * seconds * s[f"share{st}"]
        s[f"tokens{st}"] = int(max(1, tok_budget // step_tokens) * step_tokens)
    s["gdn_kernel"] = kernel
    s["calibration"] = {"tokens_per_s_alone": {str(k): round(v) for k, v in rates.items()}, "workers": n_workers,
                        "devices": n_devices, "assumed_speed_each": round(speed, 3), "train_minutes": minutes}
    (out / "settings.json").write_text(json.dumps(s, indent=2, default=str))
    print("calibration:", json.dumps(s["calibration"]), {f"tokens{k}": s[f"tokens{k}"] for k in (1, 2, 3)}, flush=True)
    del teacher
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return s


def job_spec(out: Path, name: str) -> dict:
    """What job ``name`` trains: OUT/jobs/NAME.json ({mask, options, tokens: [t1, t2, t3]}) if written by
    ``plan``, else the mask of that name with the run's hybrid options and token budgets."""
    s = _settings(out)
    f = out / "jobs" / f"{name}.json"
    spec = json.loads(f.read_text()) if f.exists() else {}
    ev = {"tasks": s["tasks"], "lengths": s["eval_lengths"], "n": s["eval_n"], **spec.get("eval", {})}
    return {"mask": spec.get("mask", name), "options": {**s.get("options", {}), **spec.get("options", {})},
            "tokens": spec.get("tokens", [s["tokens1"], s["tokens2"], s["tokens3"]]), "eval": ev}


def _curve_point(out: Path, name: str, student: Any, tok: Any, s: dict, stage: int, tokens_seen: int) -> None:
    """One point of retrieval against tokens seen: OUT/NAME/curve.jsonl (skipped if already there)."""
    f = out / name / "curve.jsonl"
    done = {(r["stage"], r["tokens_seen"]) for r in map(json.loads, f.read_text().splitlines())} if f.exists() else set()
    if (stage, tokens_seen) in done or not s.get("curve_n"):
        return
    ev = evaluate(student, tok, None, s["curve_tasks"], s["curve_lengths"], s["curve_n"], s["eval_batch"],
                  cache_dir=out / "eval_pairs")
    student.train()
    with open(f, "a") as fh:
        fh.write(json.dumps({"stage": stage, "tokens_seen": tokens_seen,
                             **{k: v["accuracy"] for k, v in ev.items()}}) + "\n")


def convert_one(out: Path, name: str, model: str, device: Optional[str], train_seconds: Optional[float]) -> None:
    """Train job ``name`` (:func:`job_spec`) through the three stages and evaluate it.

    Resumable: a finished stage (``stageK/done.json`` + ``student.pt``) is loaded, not retrained; a
    stage with a checkpoint continues from it. Each stage runs in ``s["pieces"][k-1]`` pieces with a
    retrieval point (``curve.jsonl``) after each. ``train_seconds`` caps the training time, counted
    from when the student is built (stage k stops by its cumulative share of it).
    """
    from headscope.train.parallel import find_checkpoint

    s = _settings(out)
    job = job_spec(out, name)
    mask = HeadMask.from_json(out / "masks" / f"{job['mask']}.json")
    teacher, tok, _ = load_hf(model, device=device)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    short, long_rows = TokenRows.load(out / "data" / "short.pt"), TokenRows.load(out / "data" / "long.pt")
    dev = next(teacher.parameters()).device
    opts = {"gdn_kernel": s["gdn_kernel"], **job["options"]}
    student = None
    t0 = time.time()
    c1, c2 = s.get("share1", 0.2), s.get("share1", 0.2) + s.get("share2", 0.45)
    share = {1: c1, 2: c2, 3: 1.0}  # cumulative: stage k must end by this fraction of the time
    summaries, seen = {}, 0
    pieces = s.get("pieces", [1, 1, 1])
    for stage in (1, 2, 3):
        sd = out / name / f"stage{stage}"
        if (sd / "done.json").exists() and (sd / "student.pt").exists():
            summaries[stage] = json.loads((sd / "done.json").read_text())
            seen += summaries[stage]["tokens"]
            if stage == 3 or not (out / name / f"stage{stage + 1}" / "done.json").exists():
                student = load_student(teacher, mask, init=sd / "student.pt", **opts)
            continue
        if student is None:
            student = load_student(teacher, mask, init=(out / name / f"stage{stage - 1}" / "student.pt") if stage > 1 else None,
                                   calibration_ids=short.ids[:8].to(dev), **opts)
        bs = s["batch_long"] if stage == 3 else s["batch"]
        L = s["long_len"] if stage == 3 else s["seq_len"]
        cfg = TrainConfig(stage=stage, tokens=int(job["tokens"][stage - 1]), batch_size=bs, lr=s[f"lr{stage}"],
                          ckpt_every=s["ckpt_every"], ckpt_on_exit=True, save_student=True, seed=s["seed"], progress=s["progress"])
        total_steps = math.ceil(cfg.tokens / (bs * L))
        dl = t0 + share[stage] * train_seconds if train_seconds else None
        for piece in range(1, pieces[stage - 1] + 1):
            target = math.ceil(total_steps * piece / pieces[stage - 1])
            resume = find_checkpoint(sd / "checkpoint") is not None
            student, summ = convert_stage(
                teacher, tok, mask, stage, out / name, config=cfg, student=student, hybrid_options=opts, deadline=dl,
                rows=long_rows if stage == 3 else short, resume=resume, max_steps=target,
            )
            _curve_point(out, name, student, tok, s, stage, seen + summ["tokens"])
            if summ["stopped"] == "deadline" or summ["finished"]:
                break
        summaries[stage] = summ
        seen += summ["tokens"]
        print(name, json.dumps(summ), flush=True)
    heldout = TokenRows.load(out / "data" / "heldout.pt")
    e = job["eval"]
    ev = evaluate(student, tok, heldout, e["tasks"], e["lengths"], e["n"], s["eval_batch"], cache_dir=out / "eval_pairs",
                  partial=out / name / "eval.partial.json")
    ev.update({"mask": name, "n_fa": mask.n_fa, "kv_cache_fraction": mask.kv_cache_fraction, "train": summaries,
               "options": opts, "job": job})
    (out / name / "eval.json").write_text(json.dumps(ev, indent=2))
    (out / name / "eval.partial.json").unlink(missing_ok=True)


def eval_teacher(out: Path, model: str, device: Optional[str]) -> bool:
    """The teacher's cells and held-out perplexity → OUT/teacher/eval.json. The retrieval cells need no
    sampled data: before ``pack`` has written ``data/heldout.pt`` only they are computed (kept in
    ``eval.partial.json``) and False is returned; a later call adds the perplexity and finishes."""
    s = _settings(out)
    teacher, tok, _ = load_hf(model, device=device)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    hf = out / "data" / "heldout.pt"
    heldout = TokenRows.load(hf) if hf.exists() else None
    ev = evaluate(teacher, tok, heldout, s["tasks"], s["eval_lengths"], s["eval_n"], s["eval_batch"],
                  cache_dir=out / "eval_pairs", partial=out / "teacher" / "eval.partial.json")
    if heldout is None:
        return False
    from headscope.model_specs import geometry_of

    g = geometry_of(teacher.config)
    ev.update({"mask": "teacher", "n_fa": g.n_layers * g.n_heads, "kv_cache_fraction": 1.0})
    (out / "teacher").mkdir(parents=True, exist_ok=True)
    (out / "teacher" / "eval.json").write_text(json.dumps(ev, indent=2))
    (out / "teacher" / "eval.partial.json").unlink(missing_ok=True)
    return True


def _markdown(df: pd.DataFrame) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _curves(out: Path, name: str, losses: list) -> list[dict]:
    """Appends run ``name``'s stage loss logs to ``losses``; returns its retrieval-curve points."""
    for st in (1, 2, 3):
        lf = out / name / f"stage{st}" / "log.csv"
        if lf.exists():
            df = pd.read_csv(lf)[["stage", "step", "tokens", "loss", "lr", "grad_norm"]]
            df.insert(0, "model", name)
            losses.append(df)
    cf = out / name / "curve.jsonl"
    return [{"model": name, **json.loads(line)} for line in cf.read_text().splitlines()] if cf.exists() else []


def report(out: Path) -> pd.DataFrame:
    """OUT/results.csv + results.md (accuracy per cell), OUT/results_ci.csv (hits, n, 95 % Wilson
    interval per cell), OUT/curves.csv.gz (losses of all runs, gzip) and OUT/retrieval_curves.csv (retrieval
    against tokens seen) from the finished runs."""
    rows, curves, cis, rcurves = [], [], [], []
    # a run without eval.json (stopped before its evaluation) still gives its loss and retrieval curves
    found = {p.parent.name for pat in ("*/eval.json", "*/eval.partial.json", "*/curve.jsonl") for p in out.glob(pat)}
    names = [n for n in ("teacher", *MASKS) if n in found] + sorted(found - {"teacher", *MASKS})
    for name in names:
        f = out / name / "eval.json"
        fp = out / name / "eval.partial.json"  # an evaluation stopped part-way: its finished cells
        ev = json.loads(f.read_text()) if f.exists() else ({**json.loads(fp.read_text()), "partial": True}
                                                            if fp.exists() else None)
        if ev is not None:
            ev.pop("_meta", None)
        if ev is None:
            rcurves += _curves(out, name, curves)
            continue
        kv, ppl = ev.get("kv_cache_fraction"), ev.get("ppl")  # absent in a partial evaluation (e.g. teacher_cpu)
        r = {"model": name + (" (partial)" if ev.get("partial") else ""), "n_fa": ev.get("n_fa"),
             "kv_cache": None if kv is None else round(kv, 3), "ppl": None if ppl is None else round(ppl, 3)}
        for k, v in ev.items():
            if "@" in k:
                r[k] = v["accuracy"]
                hits = v.get("hits", round(v["accuracy"] * v["n"]))
                lo, hi = wilson_interval(hits, v["n"])
                cis.append({"model": name, "cell": k, "hits": hits, "n": v["n"], "accuracy": v["accuracy"], "lo": lo, "hi": hi})
        for st, summ in (ev.get("train") or {}).items():
            r[f"tokens{st}"] = summ["tokens"]
            r[f"loss{st}"] = summ["final_loss"]
        rows.append(r)
        rcurves += _curves(out, name, curves)
    table = pd.DataFrame(rows)
    table.to_csv(out / "results.csv", index=False)
    (out / "results.md").write_text(_markdown(table))
    if cis:
        pd.DataFrame(cis).to_csv(out / "results_ci.csv", index=False)
    if curves:  # gzip without a timestamp: the same losses give the same bytes
        pd.concat(curves).to_csv(out / "curves.csv.gz", index=False, compression={"method": "gzip", "mtime": 0})
    if rcurves:
        pd.DataFrame(rcurves).to_csv(out / "retrieval_curves.csv", index=False)
    return table


@app.command()
def run(
    out: Path = typer.Option(Path("runs/conversion")),
    model: str = typer.Option("smollm2-135m"),
    ranking: Optional[Path] = typer.Option(None, help="ranking directory (headscope rank) for the HydraHead mask"),
    mask: Optional[Path] = typer.Option(None, help="or a mask.json used as the HydraHead mask"),
    budget: str = typer.Option("7:1"),
    min_per_layer: int = typer.Option(1),
    only: Optional[List[str]] = typer.Option(None, help="masks to convert (default: all)"),
    extra: Optional[List[str]] = typer.Option(None, help="more masks as NAME=PATH (a ranking directory, selected "
                                              "under the same budget, or a mask.json), e.g. hydrahead_k1=runs/fused/one"),
    tokens1: float = typer.Option(1e6), tokens2: float = typer.Option(2e6), tokens3: float = typer.Option(1e6),
    lr1: float = typer.Option(1e-3), lr2: float = typer.Option(2e-4), lr3: float = typer.Option(1e-4),
    seq_len: int = typer.Option(512), long_len: int = typer.Option(2048),
    batch: int = typer.Option(16), batch_long: int = typer.Option(4),
    text_docs: int = typer.Option(2048), heldout_docs: int = typer.Option(64), doc_len: int = typer.Option(512),
    sample_batch: int = typer.Option(256, help="sampling batch (its fp32 KV cache: ~30 GB at 768 x 512 tokens on SmolLM2)"),
    retrieval_frac: float = typer.Option(0.25), task: List[str] = typer.Option(["niah_single"]),
    eval_lengths: List[int] = typer.Option([512, 1024, 2048, 4096]), eval_n: int = typer.Option(20), eval_batch: int = typer.Option(16),
    gdn_kernel: str = typer.Option("auto", help="auto / torch / fla"),
    ckpt_every: int = typer.Option(0), seed: int = typer.Option(0),
    device: Optional[str] = typer.Option(None), parallel: bool = typer.Option(False, help="one process per mask, concurrently"),
    train_seconds: Optional[float] = typer.Option(None, help="wall-clock cap on each conversion's training (stages stop early)"),
    train_minutes: Optional[float] = typer.Option(None, help="size the token budgets (same for every mask) by timing each "
                                                  "stage first, so that the conversions train for about this long"),
    share1: float = typer.Option(0.15), share2: float = typer.Option(0.55), share3: float = typer.Option(0.30),
    devices: Optional[str] = typer.Option(None, help="comma-separated devices for the parallel workers, e.g. cuda:0,cuda:1"),
    progress: bool = typer.Option(True),
) -> None:
    """Build the masks, sample the data, run the conversions and the evaluation, write the table."""
    out.mkdir(parents=True, exist_ok=True)
    s = {k: v for k, v in locals().items() if k not in ("out", "ranking", "mask", "only", "device", "parallel", "devices", "extra")}
    if abs(share1 + share2 + share3 - 1) > 1e-6:
        raise typer.BadParameter(f"share1 + share2 + share3 = {share1 + share2 + share3}, must be 1")
    s.update(tasks=list(task), eval_lengths=list(eval_lengths))
    s.pop("task")
    (out / "settings.json").write_text(json.dumps(s, indent=2, default=str))
    from headscope.model_specs import geometry_of

    if mask is not None:
        hydra: Any = HeadMask.from_json(mask)
    elif ranking is not None:
        from headscope.scores import Ranking

        hydra = Ranking.load(ranking).matrix("score")
    else:
        raise typer.BadParameter("pass --ranking DIR or --mask mask.json for the HydraHead mask")
    teacher, _, _ = load_hf(model, device="cpu")
    g = geometry_of(teacher.config)
    del teacher
    masks = build_masks(g.n_layers, g.n_heads, g.n_kv_heads, hydra, budget, min_per_layer, seed)
    for item in extra or []:
        name, _, path = item.partition("=")
        if not name or not path or name in masks or name == "teacher":
            raise typer.BadParameter(f"--extra {item!r}: give NAME=PATH with a new name")
        pth = Path(path)
        if pth.is_dir():
            from headscope.scores import Ranking

            masks[name] = HeadMask.select(Ranking.load(pth).matrix("score"), budget, g.n_kv_heads,
                                          min_per_layer=min_per_layer, meta={"source": f"{name} ({pth})"})
        else:
            masks[name] = HeadMask.from_json(pth)
    only = list(only) if only else list(masks)
    for name, m in masks.items():
        m.to_json(out / "masks" / f"{name}.json")
        print(name, m.summary(), flush=True)
    prepare(out, model, device, s)
    if torch.cuda.is_available():  # the sampler's KV cache must not stay reserved while the workers train
        torch.cuda.empty_cache()
    print("data", (out / "data" / "info.json").read_text(), flush=True)
    todo = [n for n in only if not (out / n / "eval.json").exists()]
    devs = devices.split(",") if devices else ([device] if device else [None])
    if train_minutes and todo:
        calibrate(out, model, devs[0], s, len(todo) if parallel else 1, len(devs) if parallel else 1, train_minutes)
        train_seconds = train_seconds or train_minutes * 60 * 1.25
    if parallel:
        procs = []
        for i, name in enumerate(todo):
            cmd = [sys.executable, __file__, "one", "--out", str(out), "--name", name, "--model", model]
            dv = devs[i % len(devs)]
            cmd += ["--device", dv] if dv else []
            cmd += ["--train-seconds", str(train_seconds)] if train_seconds else []
            log = open(out / f"{name}.log", "w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        if not (out / "teacher" / "eval.json").exists():
            eval_teacher(out, model, devs[-1])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for p in procs:
            p.wait()
    else:
        if not (out / "teacher" / "eval.json").exists():
            eval_teacher(out, model, device)
        for name in todo:
            convert_one(out, name, model, device, train_seconds)
    print(report(out).to_string(index=False))


@app.command()
def data(
    out: Path = typer.Option(Path("runs/conversion")), model: str = typer.Option("smollm2-135m"),
    seq_len: int = typer.Option(512), long_len: int = typer.Option(2048),
    text_docs: int = typer.Option(2048), heldout_docs: int = typer.Option(64), doc_len: int = typer.Option(512),
    sample_batch: int = typer.Option(256), retrieval_frac: float = typer.Option(0.25),
    task: List[str] = typer.Option(["niah_single"]), seed: int = typer.Option(0), device: Optional[str] = typer.Option(None),
) -> None:
    """Only sample and pack the shared data (``run`` with the same data options then reuses it)."""
    out.mkdir(parents=True, exist_ok=True)
    s = {"seq_len": seq_len, "long_len": long_len, "text_docs": text_docs, "heldout_docs": heldout_docs, "doc_len": doc_len,
         "sample_batch": sample_batch, "retrieval_frac": retrieval_frac, "tasks": list(task), "seed": seed}
    prepare(out, model, device, s)
    print("data", (out / "data" / "info.json").read_text(), flush=True)


@app.command()
def one(out: Path = typer.Option(...), name: str = typer.Option(...), model: str = typer.Option("smollm2-135m"),
        device: Optional[str] = typer.Option(None), train_seconds: Optional[float] = typer.Option(None)) -> None:
    """Convert and evaluate one mask (a worker of ``run --parallel``)."""
    convert_one(out, name, model, device, train_seconds)


@app.command("report")
def report_cmd(out: Path = typer.Option(Path("runs/conversion"))) -> None:
    """Tables and curves of the finished runs in OUT (see :func:`report`); prints the accuracy table."""
    print(report(out).to_string(index=False))


@app.command()
def figure(out: Path = typer.Option(Path("runs/conversion")), png: Optional[Path] = typer.Option(None)) -> None:
    """Training curves (loss against tokens, one panel per stage) from OUT/curves.csv.gz (or an older curves.csv), as PNG."""
    import plotly.express as px

    df = pd.read_csv(out / "curves.csv.gz" if (out / "curves.csv.gz").exists() else out / "curves.csv")
    fig = px.line(df, x="tokens", y="loss", color="model", facet_col="stage", facet_col_spacing=0.06,
                  labels={"tokens": "tokens", "loss": "loss"}, title="Three-stage transfer: loss per step")
    fig.update_xaxes(matches=None)
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text={"stage=1": "stage 1: alignment (MSE/var)", "stage=2": "stage 2: KL to teacher",
                                                      "stage=3": "stage 3: LM loss, 2K tokens"}.get(a.text, a.text)))
    dest = png or out / "curves.png"
    fig.write_image(dest, width=1400, height=450, scale=1)
    print(dest)


@app.command()
def significance(out: Path = typer.Option(Path("runs/conversion")), a: str = typer.Option("hydrahead"),
                 b: List[str] = typer.Option(["layerwise3", "layerwise", "random", "allgdn", "teacher", "hydrahead_k1"])) -> None:
    """Fisher's exact test (two-sided) of retrieval hits of mask ``a`` against each ``b``, per task and
    length and pooled over lengths; prints a markdown table."""
    from scipy.stats import fisher_exact

    ev = {n: json.loads((out / n / "eval.json").read_text()) for n in [a, *b] if (out / n / "eval.json").exists()}
    keys = [k for k in ev[a] if "@" in k]
    print("| vs | " + " | ".join(keys) + " | pooled |")
    print("|---|" + "---|" * (len(keys) + 1))
    for other in b:
        if other not in ev:
            continue
        cells, ha, hb, na, nb = [], 0, 0, 0, 0
        for k in keys:
            x, y = ev[a][k], ev[other][k]
            xa, xb = round(x["accuracy"] * x["n"]), round(y["accuracy"] * y["n"])
            p = fisher_exact([[xa, x["n"] - xa], [xb, y["n"] - xb]])[1]
            cells.append(f"{xa}/{x['n']} vs {xb}/{y['n']} (p={p:.2g})")
            ha, hb, na, nb = ha + xa, hb + xb, na + x["n"], nb + y["n"]
        p = fisher_exact([[ha, na - ha], [hb, nb - hb]])[1]
        print(f"| {other} | " + " | ".join(cells) + f" | {ha}/{na} vs {hb}/{nb} (p={p:.2g}) |")


# ---------------------------------------------------------------------------------------------- the ≥ 50M-token plan
ABLATION = {  # the paper's Table 3, cumulative; GDN MHA expansion (own K/V per GDN head) is always on here
    "abl0_base": {"fa_pos": "rope", "gdn_rope": False, "fa_gate": False},
    "abl1_fa_nope": {"fa_pos": "nope", "gdn_rope": False, "fa_gate": False},
    "abl2_gdn_rope": {"fa_pos": "nope", "gdn_rope": True, "fa_gate": False},
    "abl3_fa_gate": {"fa_pos": "nope", "gdn_rope": True, "fa_gate": True},
}


@app.command()
def plan(
    out: Path = typer.Option(...), mask: Path = typer.Option(..., help="the HydraHead mask.json"),
    model: str = typer.Option("smollm2-135m"), budget: str = typer.Option("7:1"), min_per_layer: int = typer.Option(1),
    tokens: float = typer.Option(50e6, help="tokens per model, all stages"), ablation_tokens: float = typer.Option(10e6),
    share1: float = typer.Option(0.15), share2: float = typer.Option(0.55), share3: float = typer.Option(0.30),
    options: str = typer.Option('{"fa_pos": "nope", "gdn_rope": true, "fa_gate": true}', help="hybrid options (JSON)"),
    seq_len: int = typer.Option(512), long_len: int = typer.Option(2048), batch: int = typer.Option(64), batch_long: int = typer.Option(16),
    task: List[str] = typer.Option(["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking"]),
    eval_lengths: List[int] = typer.Option([512, 1024, 2048, 4096, 8192, 16384]), eval_n: int = typer.Option(100),
    eval_batch: int = typer.Option(16), pieces: str = typer.Option("1,2,2", help="pieces (curve points) per stage"),
    ablation_task: List[str] = typer.Option(["niah_single", "variable_tracking"]),
    ablation_lengths: List[int] = typer.Option([1024, 4096, 16384]),
    curve_n: int = typer.Option(50), curve_lengths: List[int] = typer.Option([1024, 4096]), ckpt_every: int = typer.Option(300), gdn_kernel: str = typer.Option("auto"), seed: int = typer.Option(0),
) -> None:
    """Write OUT/settings.json, OUT/masks/ and OUT/jobs/ for the comparison (hydrahead, layerwise3, layerwise,
    random, allgdn at ``tokens`` each) and the ablation (:data:`ABLATION` on the HydraHead mask at
    ``ablation_tokens``, evaluated on ``ablation_task`` × ``ablation_lengths``). Token budgets are whole steps (a step is batch × seq_len = batch_long × long_len here)."""
    from headscope.model_specs import geometry_of

    out.mkdir(parents=True, exist_ok=True)
    if abs(share1 + share2 + share3 - 1) > 1e-6:
        raise typer.BadParameter(f"share1 + share2 + share3 = {share1 + share2 + share3}, must be 1")

    def split(total: float) -> list[int]:
        step = [batch * seq_len, batch * seq_len, batch_long * long_len]
        return [int(max(1, round(total * sh / st)) * st) for sh, st in zip((share1, share2, share3), step)]

    s = {"model": model, "budget": budget, "min_per_layer": min_per_layer, "options": json.loads(options),
         "seq_len": seq_len, "long_len": long_len, "batch": batch, "batch_long": batch_long, "tasks": list(task),
         "eval_lengths": list(eval_lengths), "eval_n": eval_n, "eval_batch": eval_batch, "gdn_kernel": gdn_kernel,
         "ckpt_every": ckpt_every, "seed": seed, "progress": False, "share1": share1, "share2": share2, "share3": share3,
         "lr1": 1e-3, "lr2": 2e-4, "lr3": 1e-4, "pieces": [int(x) for x in pieces.split(",")], "curve_n": curve_n,
         "curve_tasks": ["niah_single", "variable_tracking"], "curve_lengths": list(curve_lengths), "retrieval_frac": 0.25}
    t = split(tokens)
    s.update(tokens1=t[0], tokens2=t[1], tokens3=t[2])
    (out / "settings.json").write_text(json.dumps(s, indent=2))
    g = check_model(model) or geometry_of(load_hf(model, device="cpu")[0].config)  # its config, else the loaded model's
    masks = build_masks(g.n_layers, g.n_heads, g.n_kv_heads, HeadMask.from_json(mask), budget, min_per_layer, seed)
    for name, m in masks.items():
        m.to_json(out / "masks" / f"{name}.json")
        print(name, m.summary(), flush=True)
    (out / "jobs").mkdir(exist_ok=True)
    for name, o in ABLATION.items():
        (out / "jobs" / f"{name}.json").write_text(json.dumps({
            "mask": "hydrahead", "options": o, "tokens": split(ablation_tokens),
            "eval": {"tasks": list(ablation_task), "lengths": list(ablation_lengths), "n": eval_n}}))
    print(json.dumps({k: s[k] for k in ("tokens1", "tokens2", "tokens3")}), "ablation", split(ablation_tokens))


@app.command()
def sample(
    out: Path = typer.Option(...), shard: int = typer.Option(0), model: str = typer.Option("smollm2-135m"),
    device: Optional[str] = typer.Option(None), seconds: float = typer.Option(120.0, help="stop starting new batches after this"),
    batch: int = typer.Option(2048), doc_len: int = typer.Option(512), max_docs: int = typer.Option(10**7),
    cache_implementation: str = typer.Option("", help="generate's KV cache, e.g. static (falls back to the default on failure)"),
) -> None:
    """Teacher text for shard ``shard``: batches of ``batch`` documents of ``doc_len`` sampled tokens
    (seed = 1000 · shard + batch index) until ``seconds`` have passed; OUT/data/docs_SHARD.pt."""
    d = out / "data"
    d.mkdir(parents=True, exist_ok=True)
    on_gpu = str(device).startswith("cuda")
    teacher, tok, _ = load_hf(model, device=device, dtype=torch.bfloat16 if on_gpu else torch.float32)
    t0, docs, i = time.time(), [], 0
    cache = cache_implementation or None
    while time.time() - t0 < seconds and len(docs) < max_docs:
        t1 = time.time()
        try:
            docs += sample_teacher_text(teacher, tok, min(batch, max_docs - len(docs)), doc_len, seed=1000 * shard + i,
                                        batch_size=batch, progress=False, cache_implementation=cache)
        except Exception as e:  # noqa: BLE001 - a cache the generate path cannot take: fall back to its default
            if cache is None:
                raise
            print(f"shard {shard}: cache_implementation={cache} failed ({type(e).__name__}: {str(e)[:200]}); dynamic cache", flush=True)
            cache = None
            continue
        i += 1
        print(f"shard {shard}: {len(docs)} docs, batch {time.time() - t1:.1f} s, total {time.time() - t0:.0f} s"
              f" (cache {cache or 'dynamic'})", flush=True)
    torch.save({"docs": docs, "seconds": time.time() - t0}, d / f"docs_{shard}.tmp")
    (d / f"docs_{shard}.tmp").replace(d / f"docs_{shard}.pt")


def pack_shards(out: Path, tok: Any, s: dict, heldout_docs: int = 256) -> dict:
    """Join OUT/data/docs_*.pt, drop exact duplicate documents, hold out ``heldout_docs`` (seeded), and
    write short.pt (seq_len rows), long.pt (long_len rows of text mixed with ``retrieval_frac`` of
    retrieval rows of every task at long_len/4, /2 and long_len) and heldout.pt; returns data info."""
    d = out / "data"
    shards = sorted(d.glob("docs_*.pt"))
    if not shards:
        raise typer.BadParameter(f"no {d}/docs_*.pt: run `conversion.py sample` first")
    docs, secs, per_shard = [], 0.0, []
    for f in shards:
        blob = torch.load(f)
        docs += blob["docs"]
        per_shard.append(len(blob["docs"]))
        secs = max(secs, blob["seconds"])
    uniq = list({tuple(x): None for x in docs})
    digest = hashlib.sha256(torch.tensor([t for x in uniq for t in x], dtype=torch.int32).numpy().tobytes()).hexdigest()
    if not 0 < heldout_docs <= len(uniq) // 2:
        raise typer.BadParameter(f"--heldout-docs {heldout_docs}: give 1..{len(uniq) // 2} (half of the {len(uniq)} unique documents)")
    perm = np.random.default_rng(s["seed"]).permutation(len(uniq))
    held = [list(uniq[i]) for i in perm[:heldout_docs]]
    train = [list(uniq[i]) for i in perm[heldout_docs:]]
    short, long_rows, counts = stage_rows(train, tok, s["seq_len"], s["long_len"], s["tasks"], s["retrieval_frac"], s["seed"])
    short.save(d / "short.pt")
    long_rows.save(d / "long.pt")
    pack(held, s["seq_len"], tok.eos_token_id).save(d / "heldout.pt")
    info = {"sample_seconds": round(secs, 1), "shards": len(shards), "docs": len(docs), "duplicates_dropped": len(docs) - len(uniq),
            "heldout_docs": len(held), "text_docs": len(train), "text_tokens": sum(map(len, train)), **counts,
            "docs_per_shard": per_shard, "docs_sha256": digest}
    (d / "info.json").write_text(json.dumps(info, indent=2))
    (d / "done").write_text("ok")
    return info


def eval_cells(out: Path) -> list[tuple[str, int, int]]:
    """Every (task, length, n) prompt set that the run's evaluations use: the main cells, the
    retrieval-curve cells and each job's own (``OUT/jobs/*.json``), longest first."""
    s = _settings(out)
    cells = {(t, int(L), int(s["eval_n"])) for t in s["tasks"] for L in s["eval_lengths"]}
    if s.get("curve_n"):
        cells |= {(t, int(L), int(s["curve_n"])) for t in s["curve_tasks"] for L in s["curve_lengths"]}
    for f in sorted((out / "jobs").glob("*.json")):
        e = job_spec(out, f.stem)["eval"]
        cells |= {(t, int(L), int(e["n"])) for t in e["tasks"] for L in e["lengths"]}
    return sorted(cells, key=lambda c: (-c[1] * c[2], c[0]))


_POOL_TOK: Any = None  # the tokenizer and cache folder of the `pairs` workers (fork: inherited)
_POOL_DIR: Optional[Path] = None


def _build_cell(cell: tuple[str, int, int]) -> str:
    t0 = time.time()
    eval_pairs(_POOL_TOK, cell[0], cell[1], cell[2], cache_dir=_POOL_DIR)
    return f"{cell[0]}@{cell[1]} n={cell[2]}: {time.time() - t0:.1f} s"


@app.command("pairs")
def pairs_cmd(out: Path = typer.Option(...), model: str = typer.Option("smollm2-135m"),
              workers: int = typer.Option(0, help="processes (0: half the CPU cores)")) -> None:
    """Build every evaluation prompt set of the run into OUT/eval_pairs once (CPU, in parallel; the
    queues then read them instead of tokenizing 16K-token prompts for each model)."""
    import multiprocessing as mp

    global _POOL_TOK, _POOL_DIR
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _POOL_TOK = load_tokenizer(model)
    _POOL_DIR = out / "eval_pairs"
    cells = eval_cells(out)
    n = workers or max(1, (os.cpu_count() or 2) // 2)
    t0 = time.time()
    with mp.get_context("fork").Pool(min(n, len(cells))) as pool:  # fork: the workers share the tokenizer
        for msg in pool.imap_unordered(_build_cell, cells):
            print(msg, flush=True)
    print(f"{len(cells)} prompt sets in {time.time() - t0:.0f} s", flush=True)


@app.command("pack")
def pack_cmd(out: Path = typer.Option(...), model: str = typer.Option("smollm2-135m"), heldout_docs: int = typer.Option(256)) -> None:
    """Build the training / held-out rows from the sampled shards (see :func:`pack_shards`)."""
    tok = load_tokenizer(model)
    print(json.dumps(pack_shards(out, tok, _settings(out), heldout_docs)), flush=True)


@app.command()
def queue(out: Path = typer.Option(...), jobs: str = typer.Option(..., help="comma-separated job names, run in order"),
          model: str = typer.Option("smollm2-135m"), device: Optional[str] = typer.Option(None),
          retries: int = typer.Option(1, help="rounds in which the jobs that failed (e.g. out of GPU memory) run again")) -> None:
    """Run jobs one after another on one device (``teacher`` evaluates the teacher); finished jobs
    (``eval.json``) are skipped and unfinished ones resume from their stage checkpoints. A job that fails
    does not stop the queue: its error is printed, the next job runs, and the failed jobs run again (from
    their checkpoints) after the others, ``retries`` times; exit status 1 if any still fails."""
    import gc
    import traceback

    pending = [n for n in jobs.split(",") if n]
    failed: list[str] = []
    for round_ in range(retries + 1):
        failed = []
        for name in pending:
            if (out / name / "eval.json").exists():
                continue
            t0 = time.time()
            try:
                if name == "teacher":
                    if not eval_teacher(out, model, device):
                        print("teacher: retrieval cells done; its perplexity waits for the held-out data (pack)", flush=True)
                        continue
                else:
                    convert_one(out, name, model, device, None)
            except Exception:  # noqa: BLE001 - e.g. CUDA out of memory beside other jobs: go on, retry later
                traceback.print_exc()
                print(f"{name} failed after {time.time() - t0:.0f} s", flush=True)
                failed.append(name)
            else:
                print(f"{name} done in {time.time() - t0:.0f} s", flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if not failed:
            return
        pending = failed
        if round_ < retries:
            print(f"running the failed jobs again: {','.join(failed)}", flush=True)
    print(f"failed: {','.join(failed)}", flush=True)
    raise typer.Exit(1)


if __name__ == "__main__":
    app()
