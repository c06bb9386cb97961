"""Does a converted model still retrieve in formats it never saw? (issue 40)

Arms (the same documents for every arm of a seed): hydra-7to1 (the HydraHead mask), layer-3to1 and
layer-7to1 (whole FA layers), random-7to1 (seeded random heads), teacher. Stage-3 retrieval rows come
from the ``train`` template family on the training documents (:func:`headscope.train.format_rows`);
the evaluation is :mod:`headscope.train.retention`'s seen / unseen suite, the unseen haystack from
documents sampled apart from every seed's training text. Every piece is resumable and sized to fit a
10-minute command on one H200; a rerun skips what is stored:

    run.py --piece suite --out OUT --model M              # haystack documents + all prompt sets
    run.py --piece data  --out OUT --model M --seed 0     # training / held-out documents, stage rows
    run.py --piece train --out OUT --model M --seed 0 --arm hydra-7to1 --tokens 50M   (rerun until "trained")
    run.py --piece eval  --out OUT --model M --seed 0 --arm hydra-7to1 --tokens 50M   (teacher: --arm teacher)
    run.py --piece report --out OUT                       # retention.csv, retention_summary.csv, retention_seeds.csv
    run.py --smoke                                         # every piece on a tiny random model, CPU, < 1 min

OUT/manifest.json records the commit, every command with its outcome and seconds, the hardware, the
seeds and the SHA-256 of every document set.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from headscope.masks import HeadMask  # noqa: E402
from headscope.runtime import atomic_write_text  # noqa: E402
from headscope.train import TokenRows, TrainConfig, convert_stage, format_rows, load_student, mix, pack  # noqa: E402
from headscope.train.retention import SuiteConfig, evaluate_suite, retention_table, suite_pairs  # noqa: E402

ARMS = {"hydra-7to1": "hydrahead", "layer-3to1": "layerwise3", "layer-7to1": "layerwise", "random-7to1": "random", "teacher": None}
HYBRID = {"fa_pos": "nope", "gdn_rope": True, "fa_gate": True}
SHARES = (0.15, 0.55, 0.30)
LRS = (1e-3, 2e-4, 1e-4)
SUITE_SAMPLE_SEED = 999_000_000  # sampler seeds of the haystack documents; training seed S uses 10_000·S + batch


def _conversion_module() -> Any:
    spec = importlib.util.spec_from_file_location("conversion_experiment", ROOT / "experiments" / "conversion.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_tokens(s: str) -> int:
    """'50M' / '200M' / '1.5e6' / '12000' -> tokens."""
    s = str(s).strip()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:].upper())
    return int(float(s[:-1]) * mult) if mult else int(float(s))


def sha256_docs(docs: list[list[int]]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(torch.tensor(d, dtype=torch.int32).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- settings
def _settings_of(a: argparse.Namespace) -> dict[str, Any]:
    return {"model": a.model, "budget": "7:1", "min_per_layer": 1, "hybrid": HYBRID, "gdn_kernel": a.gdn_kernel,
            "seq_len": a.seq_len, "long_len": a.long_len, "batch": a.batch, "batch_long": a.batch_long,
            "shares": list(SHARES), "lrs": list(LRS), "retrieval_frac": 0.25, "doc_len": a.doc_len, "docs": a.docs,
            "heldout_docs": a.heldout_docs, "suite_docs": a.suite_docs, "sample_batch": a.sample_batch,
            "corpus": a.corpus, "hydra_mask": a.hydra_mask, "ckpt_every": a.ckpt_every,
            "suite": {"tasks": list(a.tasks), "formats": list(a.formats), "lengths": list(a.lengths), "n": a.n,
                      "gen_n": a.gen_n, "gen_max_len": a.gen_max_len, "batch_tokens": a.batch_tokens}}


def settings(a: argparse.Namespace) -> dict[str, Any]:
    """Frozen study settings: OUT/settings.json, written by the first command. Later commands read it;
    an option given there with a value other than the stored one is refused (another --out is the fix)."""
    s = _settings_of(a)
    f = Path(a.out) / "settings.json"
    if f.exists():
        old = json.loads(f.read_text())
        dflt = _settings_of(parser().parse_args([]))

        def flat(d: dict) -> dict:
            return {**{k: v for k, v in d.items() if k != "suite"}, **{f"suite.{k}": v for k, v in d.get("suite", {}).items()}}

        new, old_f, dflt = flat(s), flat(old), flat(dflt)
        diff = {k: (old_f.get(k), v) for k, v in new.items() if v != dflt.get(k) and v != old_f.get(k)}
        if diff:
            raise SystemExit(f"{f} was written with other settings {diff} (stored, given); use another --out for new settings")
        return old
    f.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(f, json.dumps(s, indent=2))
    return s


def suite_config(s: dict) -> SuiteConfig:
    q = s["suite"]
    return SuiteConfig(tasks=tuple(q["tasks"]), formats=tuple(q["formats"]), lengths=tuple(q["lengths"]), n=q["n"], gen_n=q["gen_n"],
                       gen_max_len=q["gen_max_len"], batch_tokens=q["batch_tokens"])


def stage_tokens(s: dict, tokens: int) -> list[int]:
    """Whole steps per stage (shares 15 / 55 / 30 % of ``tokens``)."""
    step = [s["batch"] * s["seq_len"], s["batch"] * s["seq_len"], s["batch_long"] * s["long_len"]]
    return [int(max(1, round(tokens * sh / st)) * st) for sh, st in zip(s["shares"], step)]


# ---------------------------------------------------------------------------------------------- manifest
def record(out: Path, a: argparse.Namespace, outcome: str, seconds: float, extra: Optional[dict] = None) -> None:
    f = out / "manifest.json"
    m = json.loads(f.read_text()) if f.exists() else {"commands": [], "data": {}}
    commit = os.environ.get("HEADSCOPE_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                          timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    m["commit"] = commit or "unknown (no git checkout; set HEADSCOPE_COMMIT)"
    m["hardware"] = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                     "torch": torch.__version__}
    m["commands"].append({"argv": " ".join(sys.argv), "piece": a.piece, "outcome": outcome, "seconds": round(seconds, 1),
                          "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    m["seeds"] = sorted({*m.get("seeds", []), *([a.seed] if a.piece in ("data", "train", "eval") else [])})
    for k, v in (extra or {}).items():
        m["data"][k] = v
    atomic_write_text(f, json.dumps(m, indent=2))


# ---------------------------------------------------------------------------------------------- models
def load_teacher(a: argparse.Namespace, for_sampling: bool = False) -> tuple[Any, Any]:
    """The teacher and its tokenizer (fp32; bf16 on CUDA when it only samples text, as the 50M study did)."""
    if a.smoke:
        return smoke_teacher(a)
    from headscope.models import load_hf

    bf16 = for_sampling and str(a.device).startswith("cuda")
    teacher, tok, _ = load_hf(a.model, device=a.device, dtype=torch.bfloat16 if bf16 else torch.float32)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return teacher, tok


def _cpu_tokenizer(a: argparse.Namespace) -> Any:
    """The teacher's tokenizer without touching a GPU (the model is loaded on the CPU and dropped)."""
    from headscope.models import load_hf

    _, tok, _ = load_hf(a.model, device="cpu")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def smoke_tokenizer(a: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    from headscope.models import default_gguf_path

    if a.tokenizer:
        return AutoTokenizer.from_pretrained(a.tokenizer)
    p = default_gguf_path()
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


_SMOKE_TOK: Any = None


def smoke_teacher(a: argparse.Namespace) -> tuple[Any, Any]:
    """A 2-layer random Llama (8 query / 2 KV heads, d 64) on the SmolLM2 tokenizer (loaded once per process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    global _SMOKE_TOK
    if _SMOKE_TOK is None:
        _SMOKE_TOK = smoke_tokenizer(a)
    tok = _SMOKE_TOK
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval(), tok


def smoke_corpus(n_docs: int, seed: int = 0) -> list[str]:
    """Plain seeded sentences (no digits) standing in for teacher text in ``--smoke``."""
    rng = random.Random(seed)
    subj = ["The farmer", "A young painter", "The old sailor", "My neighbour", "The teacher", "A quiet student", "The baker"]
    verb = ["walked to", "looked at", "talked about", "painted", "cleaned", "visited", "remembered"]
    obj = ["the harbour", "a small garden", "the village square", "an empty barn", "the long road", "a wooden bridge"]
    tail = ["in the morning", "after the rain", "with great care", "before dinner", "without a word", "once again"]
    return [" ".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)} {rng.choice(tail)}." for _ in range(12))
            for _ in range(n_docs)]


def masks(a: argparse.Namespace, s: dict, teacher: Any) -> dict[str, HeadMask]:
    """OUT/masks/ARM.json (written once from the HydraHead mask and the model's geometry)."""
    import numpy as np

    from headscope.models import geometry_of

    d = Path(a.out) / "masks"
    want = [k for k, v in ARMS.items() if v]
    if all((d / f"{k}.json").exists() for k in want):
        return {k: HeadMask.from_json(d / f"{k}.json") for k in want}
    g = geometry_of(teacher.config)
    if s["hydra_mask"]:
        hydra: Any = HeadMask.from_json(ROOT / s["hydra_mask"] if not Path(s["hydra_mask"]).is_absolute() else s["hydra_mask"])
    else:  # --smoke: seeded scores stand in for a ranking
        hydra = np.random.default_rng(1).random((g.n_layers, g.n_heads))
    built = _conversion_module().build_masks(g.n_layers, g.n_heads, g.n_kv_heads, hydra, s["budget"], s["min_per_layer"], seed=0)
    out = {}
    for arm in want:
        out[arm] = built[ARMS[arm]]
        out[arm].to_json(d / f"{arm}.json")
    return out


# ---------------------------------------------------------------------------------------------- documents
def sample_docs(a: argparse.Namespace, s: dict, teacher: Any, tok: Any, folder: Path, n: int, base_seed: int,
                deadline: float) -> Optional[list[list[int]]]:
    """``n`` documents in batches of ``sample_batch`` saved as they finish (folder/docs_K.pt); None when
    ``deadline`` passed first (rerun to continue)."""
    from headscope.train import sample_teacher_text

    folder.mkdir(parents=True, exist_ok=True)
    docs: list[list[int]] = []
    k = 0
    while len(docs) < n:
        f = folder / f"docs_{k}.pt"
        if f.exists():
            docs += torch.load(f)
        else:
            if time.time() > deadline:
                return None
            if a.smoke or s["corpus"]:
                raise SystemExit("internal: corpus documents are not sampled")
            b = min(s["sample_batch"], n - len(docs))
            new = sample_teacher_text(teacher, tok, b, s["doc_len"], seed=base_seed + k, batch_size=b, progress=False,
                                      cache_implementation="static" if str(a.device).startswith("cuda") else None)
            torch.save(new, folder / f"docs_{k}.tmp")
            (folder / f"docs_{k}.tmp").replace(f)
            docs += new
            print(f"sampled {len(docs)}/{n} documents", flush=True)
        k += 1
    return docs[:n]


def corpus_docs(a: argparse.Namespace, s: dict, tok: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(training documents, haystack documents) of ``--corpus`` / ``--smoke``: the last ``suite_docs``
    documents are the haystack's, the rest are for training."""
    from headscope.train import corpus_documents

    if a.smoke:
        texts = smoke_corpus(s["docs"] + s["suite_docs"])
        docs = [list(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]
    else:
        docs = corpus_documents(s["corpus"], tok)
    if len(docs) <= s["suite_docs"]:
        raise SystemExit(f"corpus has {len(docs)} documents: need more than --suite-docs {s['suite_docs']}")
    return docs[: -s["suite_docs"]], docs[-s["suite_docs"]:]


def texts_of(tok: Any, docs: list[list[int]]) -> list[str]:
    return [tok.decode(d, skip_special_tokens=True) for d in docs]


def suite_filler(out: Path, tok: Any) -> Any:
    from headscope.tasks.formats import natural_filler

    docs = torch.load(out / "suite" / "docs.pt")
    return natural_filler(texts_of(tok, docs), "unseen", source=f"held-out haystack documents ({len(docs)})")


# ---------------------------------------------------------------------------------------------- pieces
def piece_suite(a: argparse.Namespace, s: dict, deadline: float) -> str:
    out = Path(a.out)
    d = out / "suite"
    if not (d / "docs.pt").exists():
        teacher, tok = load_teacher(a, for_sampling=True)
        if a.smoke or s["corpus"]:
            docs = corpus_docs(a, s, tok)[1]
        else:
            docs = sample_docs(a, s, teacher, tok, d / "shards", s["suite_docs"], SUITE_SAMPLE_SEED, deadline)
            if docs is None:
                return "partial: sampling stopped at the deadline; rerun"
        d.mkdir(parents=True, exist_ok=True)
        torch.save(docs, d / "docs.pt")
        record(out, a, "suite documents", 0.0, {"suite_docs_sha256": sha256_docs(docs), "suite_docs": len(docs)})
        if torch.cuda.is_available() and torch.cuda.is_initialized() and a.workers > 1:
            # the prompt sets are built by forked CPU workers: fork from a fresh process without a CUDA context
            del teacher
            left = max(1.0, deadline - time.time())
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--budget-s", str(left)])
            return "suite documents sampled; prompt sets " + ("built" if r.returncode == 0 else "failed: rerun")
    else:
        tok = load_teacher(a)[1] if a.smoke else _cpu_tokenizer(a)
    filler = suite_filler(out, tok)
    cfg = suite_config(s)
    cells = sorted(cfg.cells(), key=lambda c: -c[2])
    if a.workers > 1 and len(cells) > 1:
        import multiprocessing as mp

        global _POOL
        _POOL = (tok, cfg, filler, d / "pairs")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        with mp.get_context("fork").Pool(min(a.workers, len(cells))) as pool:
            for msg in pool.imap_unordered(_build_cell, cells):
                print(msg, flush=True)
    else:
        for c in cells:
            if time.time() > deadline:
                return "partial: prompt sets stopped at the deadline; rerun"
            suite_pairs(tok, cfg, *c, filler=filler, cache_dir=d / "pairs")
    return f"suite ready: {len(cells)} prompt sets, {len(filler.sentences)} haystack sentences"


_POOL: Any = None


def _build_cell(cell: tuple[str, str, int]) -> str:
    tok, cfg, filler, cache = _POOL
    t0 = time.time()
    suite_pairs(tok, cfg, *cell, filler=filler, cache_dir=cache)
    return f"{cell}: {time.time() - t0:.1f} s"


def piece_data(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """Training documents of seed ``a.seed`` (the same for every arm), held-out rows, stage rows."""
    out = Path(a.out)
    d = out / f"seed{a.seed}" / "data"
    if (d / "done").exists():
        return "data already built"
    teacher, tok = load_teacher(a, for_sampling=True)
    if a.smoke or s["corpus"]:
        docs = corpus_docs(a, s, tok)[0]
    else:
        docs = sample_docs(a, s, teacher, tok, d / "shards", s["docs"], 10_000 * a.seed, deadline)
        if docs is None:
            return "partial: sampling stopped at the deadline; rerun"
    rng = random.Random(a.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_held = min(s["heldout_docs"], len(docs) // 4)
    held, train = [docs[i] for i in order[:n_held]], [docs[i] for i in order[n_held:]]
    eos = tok.eos_token_id
    short = pack(train, s["seq_len"], eos)
    long_text = pack(train, s["long_len"], eos)
    n_ret = max(4, round(len(long_text) * s["retrieval_frac"] / (1 - s["retrieval_frac"])))
    L = s["long_len"]
    ret = format_rows(tok, n_ret, L, texts_of(tok, train), tasks=s["suite"]["tasks"], family="train", seed=10 * a.seed + 1,
                      lengths=[max(128, L // 4), max(128, L // 2), L])
    short.save(d / "short.pt")
    mix(long_text, ret, seed=a.seed).save(d / "long.pt")
    pack(held, s["seq_len"], eos).save(d / "heldout.pt")
    # haystack sentences of the suite that also occur in the training text (teacher text can repeat short sentences)
    shared = None
    if (out / "suite" / "docs.pt").exists():
        from headscope.tasks.filler import Filler

        train_sentences = set(Filler.from_texts(texts_of(tok, train), "train").sentences)
        shared = len(set(suite_filler(out, tok).sentences) & train_sentences)
    info = {"seed": a.seed, "docs": len(docs), "train_docs": len(train), "heldout_docs": len(held), "short_rows": len(short),
            "long_text_rows": len(long_text), "long_retrieval_rows": len(ret), "docs_sha256": sha256_docs(docs),
            "suite_sentences_in_training_text": shared}
    atomic_write_text(d / "info.json", json.dumps(info, indent=2))
    (d / "done").write_text("ok")
    record(out, a, "data", 0.0, {f"seed{a.seed}": info})
    return f"data built: {json.dumps(info)}"


def run_dir(a: argparse.Namespace) -> Path:
    return Path(a.out) / f"seed{a.seed}" / f"{a.arm}_t{parse_tokens(a.tokens)}"


def piece_train(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """The three stages of one arm; stops at ``deadline`` with a checkpoint (rerun to continue)."""
    from headscope.train.parallel import find_checkpoint

    if a.arm == "teacher":
        return "the teacher is not trained"
    out, rd = Path(a.out), run_dir(a)
    data = out / f"seed{a.seed}" / "data"
    if not (data / "done").exists():
        raise SystemExit(f"no {data}/done: run --piece data --seed {a.seed} first")
    if (rd / "stage3" / "done.json").exists():
        return "trained"
    teacher, tok = load_teacher(a)
    mask = masks(a, s, teacher)[a.arm]
    short, long_rows = TokenRows.load(data / "short.pt"), TokenRows.load(data / "long.pt")
    dev = next(teacher.parameters()).device
    opts = {"gdn_kernel": s["gdn_kernel"], **s["hybrid"]}
    budgets = stage_tokens(s, parse_tokens(a.tokens))
    student = None
    for stage in (1, 2, 3):
        sd = rd / f"stage{stage}"
        if (sd / "done.json").exists() and (sd / "student.pt").exists():
            continue
        if student is None:
            init = rd / f"stage{stage - 1}" / "student.pt" if stage > 1 else None
            student = load_student(teacher, mask, init=init, calibration_ids=short.ids[:8].to(dev) if init is None else None, **opts)
        bs = s["batch_long"] if stage == 3 else s["batch"]
        cfg = TrainConfig(stage=stage, tokens=budgets[stage - 1], batch_size=bs, lr=s["lrs"][stage - 1],
                          ckpt_every=s["ckpt_every"], ckpt_on_exit=True, save_student=True, seed=a.seed, progress=False)
        student, summ = convert_stage(teacher, tok, mask, stage, rd, config=cfg, student=student, hybrid_options=opts,
                                      deadline=deadline, rows=long_rows if stage == 3 else short,
                                      resume=find_checkpoint(sd / "checkpoint") is not None)
        print(a.arm, f"seed {a.seed}", json.dumps(summ), flush=True)
        if not summ["finished"]:
            return f"partial: stage {stage} at step {summ['steps']}/{summ['total_steps']}; rerun the same command"
    return "trained"


def piece_eval(a: argparse.Namespace, s: dict, deadline: float) -> str:
    out = Path(a.out)
    teacher, tok = load_teacher(a)
    if a.arm == "teacher":
        model, tokens = teacher, 0
    else:
        rd = run_dir(a)
        if not (rd / "stage3" / "done.json").exists():
            raise SystemExit(f"{a.arm} seed {a.seed} is not trained ({rd}/stage3/done.json missing): run --piece train")
        model = load_student(teacher, masks(a, s, teacher)[a.arm], init=rd / "stage3" / "student.pt",
                             gdn_kernel=s["gdn_kernel"], **s["hybrid"])
        tokens = parse_tokens(a.tokens)
    res = evaluate_suite(model, tok, a.arm, a.seed if a.arm != "teacher" else 0, tokens, suite_config(s), out / "cells",
                         filler=suite_filler(out, tok), cache_dir=out / "suite" / "pairs", deadline=deadline)
    return f"evaluated: {res['done']} cells stored" + (f", {res['left']} left; rerun" if res["left"] else "")


def piece_report(a: argparse.Namespace, s: dict, deadline: float) -> str:
    r = retention_table(Path(a.out) / "cells", Path(a.out))
    return f"report: {r['rows']} rows in retention.csv ({r['missing_teacher']} without a teacher cell)"


# ---------------------------------------------------------------------------------------------- anatomy (item 4)
ANATOMY_SEED = 555  # prompt seed of the ranking pairs (the suite's cells use 1234 / 4321: disjoint prompts)


def add_anatomy_args(p: argparse.ArgumentParser) -> None:
    """The options of ``--piece anatomy`` (not study settings: they name the piece's output folder)."""
    p.add_argument("--anatomy-pairs", type=int, default=6, help="anatomy: ranking pairs (clean / corrupted)")
    p.add_argument("--anatomy-len", type=int, default=4096, help="anatomy: prompt length of ranking and knockout, tokens")
    p.add_argument("--anatomy-task", default="niah_single", help="anatomy: the retrieval task ranked and knocked out")
    p.add_argument("--anatomy-formats", choices=["seen", "unseen"], default="unseen", help="anatomy: prompt family")
    p.add_argument("--anatomy-n", type=int, default=100, help="anatomy: knockout prompts (of the suite cell, evenly spaced)")
    p.add_argument("--anatomy-methods", nargs="+", choices=["zero", "mean"], default=["zero", "mean"],
                   help="anatomy: ablation methods (mean: over the ranking pairs' clean prompts)")
    p.add_argument("--anatomy-controls", type=int, default=3, help="anatomy: draws of random GDN heads (as many as FA heads)")
    p.add_argument("--anatomy-min-gap", type=float, default=0.1, help="anatomy: pairs with a smaller |m(x) - m(x')| are skipped")
    p.add_argument("--anatomy-k", type=int, default=10, help="anatomy: top-k of the teacher / student comparison")
    p.add_argument("--anatomy-batch", type=int, default=None, help="anatomy: patched rows per forward (default: by memory)")


def anatomy_key(a: argparse.Namespace) -> str:
    gap = "" if a.anatomy_min_gap == 0.1 else f"_gap{a.anatomy_min_gap:g}"
    return f"{a.anatomy_formats}_{a.anatomy_task}@{a.anatomy_len}_p{a.anatomy_pairs}{gap}"


def anatomy_pairs(a: argparse.Namespace, s: dict, tok: Any) -> tuple[list[Any], list[Any]]:
    """(ranking pairs, knockout prompts): ``--anatomy-pairs`` pairs of seed ANATOMY_SEED (needle depths 0.1..0.9;
    built once into OUT/anatomy/KEY/pairs.pt), and ``--anatomy-n`` prompts of the suite's cell of that task, family
    and length, evenly spaced over its needle depths (the cell's prompts: another seed than the ranking pairs)."""
    import numpy as np

    from headscope.runtime import atomic_torch_save
    from headscope.tasks import make_pairs
    from headscope.tasks.formats import format_pairs

    out = Path(a.out)
    fmt, task, L, n = a.anatomy_formats, a.anatomy_task, a.anatomy_len, a.anatomy_pairs
    if fmt == "unseen" and not (out / "suite" / "docs.pt").exists():
        raise SystemExit(f"no {out}/suite/docs.pt (the unseen haystack): run --piece suite first")
    filler = suite_filler(out, tok) if fmt == "unseen" else None
    f = out / "anatomy" / anatomy_key(a) / "pairs.pt"
    if f.exists():
        rank = torch.load(f, weights_only=False)  # our own file: a pickled list of Pair
    else:
        depths = list(np.linspace(0.1, 0.9, n)) if n > 1 else [0.5]
        rank = (format_pairs(tok, "unseen", task, filler, n_pairs=n, seq_len=L, depth=depths, seed=ANATOMY_SEED)
                if fmt == "unseen" else make_pairs(task, tok, n_pairs=n, seq_len=L, depth=depths, seed=ANATOMY_SEED))
        atomic_torch_save(f, rank)
    cell = suite_pairs(tok, suite_config(s), task, fmt, L, filler=filler, cache_dir=out / "suite" / "pairs")
    keep = sorted({int(i) for i in np.linspace(0, len(cell) - 1, min(a.anatomy_n, len(cell))).round()})
    return rank, [cell[i] for i in keep]


def _ranking_of(lm: Any, pairs: list[Any], a: argparse.Namespace, d: Path) -> tuple[Any, Optional[str]]:
    """The Ranking of ``lm`` on ``pairs`` stored in ``d/ranking`` (computed once; ``d/store`` resumes a partial
    sweep), or (None, why) when no pair has a usable gap."""
    from headscope.patching import GapError
    from headscope.readout import Readout
    from headscope.scores import Ranking
    from headscope.student_anatomy import rank_heads

    if (d / "ranking" / "ranking.json").exists():
        return Ranking.load(d / "ranking"), None
    if (d / "gap_error.txt").exists():
        return None, (d / "gap_error.txt").read_text()
    try:
        r = rank_heads(lm, pairs, Readout(min_gap=a.anatomy_min_gap), store_dir=str(d / "store"),
                       batch_size=a.anatomy_batch)
    except GapError as e:
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "gap_error.txt", str(e))
        return None, str(e)
    r.save(d / "ranking")
    return r, None


def _ranking_summary(r: Any) -> dict[str, Any]:
    from headscope.anatomy import critical_share, layer_gini

    m = r.matrix("score")
    try:
        g = layer_gini(m)
    except ValueError as e:  # every layer without positive IE
        g = {"error": str(e)}
    return {"critical": critical_share(m.ravel()), "layer_gini": g, "skipped_pairs": r.provenance.get("skipped", {}),
            "path": r.provenance.get("path"), "top10": [f"L{int(x.layer)}H{int(x.head)}" for x in r.top(10).itertuples()]}


def piece_anatomy(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """Anatomy after conversion (issue 40, item 4): the teacher's and the student's heads ranked on the same pairs
    (receiver IE, exact fp32, the student's FA and GDN heads alike at o_proj's input), their comparison, and
    retrieval accuracy with the student's FA heads knocked out (controls: as many random GDN heads; the student's
    top heads by IE; the teacher with the same heads, and with all the heads the student turned into GDN, knocked
    out). OUT/anatomy/KEY/seedS_ARM_tTOKENS/{anatomy.json, heads.csv,
    knockout.csv}; the teacher's ranking in OUT/anatomy/KEY/teacher/ (shared by the arms). Resumable."""
    import csv

    from headscope.knockout import mean_reference
    from headscope.models import wrap
    from headscope.student_anatomy import (compare_rankings, head_comparison, kind_summary, knockout_accuracy,
                                           random_gdn_heads)
    from headscope.patching.hybrid import head_kinds

    out = Path(a.out)
    base = out / "anatomy" / anatomy_key(a)
    rd = base / ("teacher" if a.arm == "teacher" else f"seed{a.seed}_{a.arm}_t{parse_tokens(a.tokens)}")
    res_f = rd / "anatomy.json"
    res = json.loads(res_f.read_text()) if res_f.exists() else {}
    if res.get("done"):
        return f"anatomy already done: {res_f}"
    rd.mkdir(parents=True, exist_ok=True)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 patching, as headscope rank
    try:
        teacher, tok = load_teacher(a)
        rank_pairs, ko_pairs = anatomy_pairs(a, s, tok)
        t_lm = wrap(teacher, tok, name="teacher")
        t_rank, t_err = _ranking_of(t_lm, rank_pairs, a, base / "teacher")
        res.update({"key": anatomy_key(a), "arm": a.arm, "seed": a.seed, "tokens": parse_tokens(a.tokens),
                    "ranking_pairs": len(rank_pairs), "ranking_seed": ANATOMY_SEED, "knockout_prompts": len(ko_pairs),
                    "length": a.anatomy_len, "task": a.anatomy_task, "formats": a.anatomy_formats,
                    "min_gap": a.anatomy_min_gap, "teacher": _ranking_summary(t_rank) if t_rank else {"error": t_err}})
        if a.arm == "teacher":
            res["done"] = True
            atomic_write_text(res_f, json.dumps(res, indent=1))
            return f"anatomy: teacher ranked ({base / 'teacher'})"
        if time.time() > deadline:
            atomic_write_text(res_f, json.dumps(res, indent=1))
            return "partial: teacher ranked; rerun for the student"
        rdir = run_dir(a)
        if not (rdir / "stage3" / "done.json").exists():
            raise SystemExit(f"{a.arm} seed {a.seed} is not trained ({rdir}/stage3/done.json missing): run --piece train")
        mask = masks(a, s, teacher)[a.arm]
        student = load_student(teacher, mask, init=rdir / "stage3" / "student.pt", gdn_kernel=s["gdn_kernel"], **s["hybrid"])
        s_lm = wrap(student, tok, name=a.arm)
        s_rank, s_err = _ranking_of(s_lm, rank_pairs, a, rd)
        if s_rank is not None:
            res["student"] = {**_ranking_summary(s_rank), "kinds": kind_summary(s_rank, ks=(5, 10, mask.n_fa))}
            if t_rank is not None:
                res["comparison"] = {f"top{k}": compare_rankings(t_rank, s_rank, k) for k in sorted({a.anatomy_k, mask.n_fa})}
                head_comparison(t_rank, s_rank).to_csv(rd / "heads.csv", index=False)
        else:
            res["student"] = {"error": s_err}
        atomic_write_text(res_f, json.dumps(res, indent=1))
        # ---- knockout: the student's FA heads, controls, the same heads of the teacher
        kinds = head_kinds(student)
        fa = mask.heads()
        sets: dict[str, list] = {"none": [], "fa": fa}
        for i in range(a.anatomy_controls):
            sets[f"gdn_random{i}"] = random_gdn_heads(kinds, min(len(fa), sum(k == "gdn" for ks in kinds for k in ks)), seed=i)
        if s_rank is not None:
            sets["student_top"] = [(int(x.layer), int(x.head)) for x in s_rank.top(len(fa)).itertuples()]
        gdn = [(lay, h) for lay, ks in enumerate(kinds) for h, k in enumerate(ks) if k == "gdn"]
        # the teacher with the student's FA heads knocked out, and with all its GDN heads (what the FA heads alone keep)
        conds = [("student", c, h) for c, h in sets.items()] + [("teacher", "none", []), ("teacher", "fa", fa),
                                                                ("teacher", "gdn", gdn)]
        ko = res.setdefault("knockout", {})
        refs: dict[str, Any] = {}
        left = 0
        for method in a.anatomy_methods:
            for model_name, cond, heads in conds:
                key = f"{model_name}/{method}/{cond}"
                if key in ko or (method != a.anatomy_methods[0] and cond == "none"):
                    continue
                if time.time() > deadline:
                    left += 1
                    continue
                lm = s_lm if model_name == "student" else t_lm
                ref = None
                if method == "mean" and heads:
                    if model_name not in refs:
                        refs[model_name] = mean_reference(lm, rank_pairs, range(lm.geometry.n_layers))
                    ref = refs[model_name]
                t0 = time.time()
                r = knockout_accuracy(lm, ko_pairs, heads, method, reference=ref)
                ko[key] = {**r, "seconds": round(time.time() - t0, 1)}
                print(f"anatomy knockout {key}: accuracy {r['accuracy']:.3f} ({r['n_heads']} heads)", flush=True)
                atomic_write_text(res_f, json.dumps(res, indent=1))
        rows = [{"model": k.split("/")[0], "method": k.split("/")[1], "condition": k.split("/")[2], "n_heads": v["n_heads"],
                 "n": v["n"], "hits": sum(v["correct"]), "accuracy": v["accuracy"]} for k, v in ko.items()]
        with open(rd / "knockout.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=["model", "method", "condition", "n_heads", "n", "hits", "accuracy"])
            w.writeheader()
            w.writerows(rows)
        res["done"] = left == 0
        atomic_write_text(res_f, json.dumps(res, indent=1))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if left:
        return f"partial: {left} knockout conditions left at the deadline; rerun"
    fa_acc = {m: ko.get(f"student/{m}/fa", {}).get("accuracy") for m in a.anatomy_methods}
    return f"anatomy done: baseline {ko['student/' + a.anatomy_methods[0] + '/none']['accuracy']:.3f}, FA knocked out {fa_acc} ({rd})"


PIECES = {"suite": piece_suite, "data": piece_data, "train": piece_train, "eval": piece_eval, "report": piece_report}
PIECES["anatomy"] = piece_anatomy


# ---------------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--piece", choices=list(PIECES))
    p.add_argument("--out", default="runs/conversion-generalization")
    p.add_argument("--model", default="smollm2-135m", help="the teacher (a .gguf path, HF directory or spec)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arm", choices=list(ARMS), default="hydra-7to1")
    p.add_argument("--tokens", default="50M", help="training tokens of the arm, all stages (50M, 200M, ...)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after this many seconds")
    p.add_argument("--corpus", default=None, help="a user text file (documents separated by blank lines) instead of teacher samples")
    p.add_argument("--hydra-mask", default="experiments/conversion-smollm2/masks/hydrahead.json")
    p.add_argument("--gdn-kernel", default="auto")
    p.add_argument("--docs", type=int, default=12288, help="training + held-out documents per seed")
    p.add_argument("--heldout-docs", type=int, default=256)
    p.add_argument("--suite-docs", type=int, default=1024, help="haystack documents of the unseen cells")
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--sample-batch", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batch-long", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=300)
    p.add_argument("--tasks", nargs="+", default=["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking"])
    p.add_argument("--formats", nargs="+", choices=["seen", "unseen"], default=["seen", "unseen"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--n", type=int, default=100, help="prompts per cell")
    p.add_argument("--gen-n", type=int, default=20, help="prompts per cell also scored by greedy generation")
    p.add_argument("--gen-max-len", type=int, default=4096)
    p.add_argument("--batch-tokens", type=int, default=32768, help="tokens per forward of the teacher-forced scoring")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="processes building prompt sets")
    p.add_argument("--tokenizer", default=None, help="--smoke: an HF tokenizer folder (default: the SmolLM2 GGUF's)")
    p.add_argument("--smoke", action="store_true", help="every piece on a tiny random model on the CPU (a temporary --out)")
    add_anatomy_args(p)
    return p


SMOKE = ["--docs", "16", "--heldout-docs", "2", "--suite-docs", "12", "--seq-len", "64", "--long-len", "256",
         "--batch", "4", "--batch-long", "2", "--lengths", "256", "--n", "2", "--gen-n", "1", "--gen-max-len", "256",
         "--tokens", "1", "--hydra-mask", "", "--gdn-kernel", "torch", "--device", "cpu", "--workers", "2", "--ckpt-every", "0"]


ANATOMY_SMOKE = ["--arm", "hydra-7to1", "--anatomy-len", "256", "--anatomy-pairs", "2", "--anatomy-n", "2",
                 "--anatomy-min-gap", "0", "--anatomy-controls", "1"]


def main(argv: Optional[list[str]] = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    if a.smoke:
        out = a.out if "--out" in argv else tempfile.mkdtemp(prefix="gen-smoke-")
        tok_args = ["--tokenizer", a.tokenizer] if a.tokenizer else []
        msgs = []
        for piece, extra in (("suite", []), ("data", []), ("train", ["--arm", "hydra-7to1"]), ("eval", ["--arm", "hydra-7to1"]),
                             ("eval", ["--arm", "teacher"]), ("report", []), ("anatomy", ANATOMY_SMOKE)):
            sub = parser().parse_args([*SMOKE, "--out", out, "--piece", piece, *extra, *tok_args])
            sub.smoke = True
            msgs.append(run_piece(sub))
        print(f"smoke run in {out}", flush=True)
        return "\n".join(msgs)
    if not a.piece:
        raise SystemExit("give --piece (suite, data, train, eval, report) or --smoke")
    return run_piece(a)


def run_piece(a: argparse.Namespace) -> str:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = True
    s = settings(a)
    msg = PIECES[a.piece](a, s, t0 + a.budget_s)
    record(Path(a.out), a, msg, time.time() - t0)
    print(f"{a.piece}: {msg} ({time.time() - t0:.0f} s)", flush=True)
    return msg


if __name__ == "__main__":
    main()
