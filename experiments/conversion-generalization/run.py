"""Does a converted model still retrieve in formats it never saw? (issue 40)

Arms (the same documents for every arm of a seed): hydra-7to1 (the HydraHead mask), layer-3to1 and
layer-7to1 (whole FA layers), random-7to1 (seeded random heads), teacher. Stage-3 retrieval rows come
from the ``train`` template family on the training documents (:func:`headscope.train.format_rows`);
the evaluation is :mod:`headscope.evaluation.retention`'s seen / unseen suite, the unseen haystack from
documents sampled apart from every seed's training text. Every piece is resumable and sized to fit a
10-minute command on one H200; a rerun skips what is stored:

    run.py --piece suite --out OUT --model M              # haystack documents + all prompt sets
    run.py --piece data  --out OUT --model M --seed 0     # training / held-out documents, stage rows
    run.py --piece train --out OUT --model M --seed 0 --arm hydra-7to1 --tokens 50M   (rerun until "trained")
    run.py --piece eval  --out OUT --model M --seed 0 --arm hydra-7to1 --tokens 50M   (teacher: --arm teacher)
    run.py --piece report --out OUT                       # retention.csv, retention_summary.csv, retention_seeds.csv
    run.py --smoke                                         # every piece on a tiny random model, CPU, < 1 min

The committed results (experiments/conversion-generalization/records/: every scored cell, the anatomy, the masks,
the arms' records and loss curves) restore into OUT with --piece report, which rebuilds the study's tables from them
(no model, no GPU):

    run.py --piece report --out OUT                        # OUT/retention*.csv, levers.*, comparison.md, ...

An arm whose weights did not travel is retrained with --piece train ... --retrain (train and eval refuse
without the weights and name that command).

Levers (issue 40 item 3; each an option of the data / train / eval pieces, recorded in the arm's
OUT/seedS/RUN/arm.json and in its name RUN = LABEL_tTOKENS, LABEL = the arm plus "+lever=value" for
every lever off the study's setting, e.g. hydra-7to1+fa_pos=rope; the baseline keeps its old name):

    --tokens 200M            training tokens (the stage shares stay 15 / 55 / 30 %)
    --s2-retrieval 0.25      share of stage-2 rows that are train-family retrieval rows (study: 0, text only)
    --s3-wordings 6          train-family wordings per task in the stage-3 retrieval rows (study: 3; 1..6)
    --fa-pos rope            FA heads with the teacher's RoPE (study: nope, NoPE with the log-scale)
    --arm hydra-5to1         the 5:1 budget (also layer-5to1, random-5to1; --budget 5:1 checks it)
    --arm ie-7to1            the selection: HydraHead's ranking without its focus factor (κ = 1, IE alone)

A lever's rows are built by --piece data with the same option (from the seed's stored documents);
--piece report also writes levers.csv / levers.md (unseen single-needle retention per arm and lever) and levers_paired.csv (each lever beside its reference on the same seeds and prompts, McNemar's exact p).

OUT/manifest.json records the commit, every command with its outcome and seconds, the hardware, the
seeds and the SHA-256 of every document set.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from headscope.masks import HeadMask  # noqa: E402
from headscope.runtime import atomic_write_text  # noqa: E402
from headscope.tasks.formats import FORMAT_TASKS  # noqa: E402  (the suite's tasks; --eval-tasks-first checked against them)
from headscope.train import TokenRows, TrainConfig, convert_stage, format_rows, load_student, mix, pack  # noqa: E402
from headscope.evaluation.retention import SuiteConfig, cell_dir, evaluate_suite, suite_pairs  # noqa: E402

def _tables() -> Any:
    """The study's tables module (tables.py beside this file), loaded by path: the name `tables` is PyTables' too."""
    spec = importlib.util.spec_from_file_location("conversion_study_tables", Path(__file__).resolve().parent / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


TABLES = _tables()
parse_tokens, parse_label, tokens_text = TABLES.parse_tokens, TABLES.parse_label, TABLES.tokens_text

ARMS = {"hydra-7to1": "hydrahead", "layer-3to1": "layerwise3", "layer-7to1": "layerwise", "random-7to1": "random", "teacher": None}
#: the budget lever's arms: the masks of the 7:1 arms at 5:1 (HydraHead re-selected from its ranking)
BUDGET_ARMS = {"hydra-5to1": "hydrahead", "layer-5to1": "layerwise", "random-5to1": "random"}
#: the selection lever's arms: HydraHead's fused ranking scored without its focus factor (κ = 1: IE alone, the
#: ranking `experiments/fused-smollm2/one`), selected at the same budget and min_per_layer. The teacher's top head on
#: the unseen single-needle pairs at 4K (L16H0, IE 0.54) has κ_focus = 0 and is not in the HydraHead mask.
SELECTION_ARMS = {"ie-7to1": "experiments/fused-smollm2/one"}
ARM_BUDGETS = {"hydra-7to1": "7:1", "layer-7to1": "7:1", "random-7to1": "7:1", "layer-3to1": "3:1",
               "hydra-5to1": "5:1", "layer-5to1": "5:1", "random-5to1": "5:1", "ie-7to1": "7:1"}
HYBRID = {"fa_pos": "nope", "gdn_rope": True, "fa_gate": True}
#: the study's value of each lever of the arm label, in label order (a lever at this value is no lever)
LEVERS = {"s2_retrieval": 0.0, "s3_wordings": 3, "fa_pos": HYBRID["fa_pos"]}
BASE_TOKENS = "50M"
S2_SEED, S3_SEED = 5, 1  # stage-2 / stage-3 retrieval rows of seed S use format_rows seeds 10·S + these (+ task index)
SHARES = (0.15, 0.55, 0.30)
LRS = (1e-3, 2e-4, 1e-4)
SUITE_SAMPLE_SEED = 999_000_000  # sampler seeds of the haystack documents; training seed S uses 10_000·S + batch


def _conversion_module() -> Any:
    spec = importlib.util.spec_from_file_location("conversion_experiment", ROOT / "experiments" / "conversion.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def recorded_data(out: Path) -> dict[str, Any]:
    """``data`` of OUT/manifest.json (what earlier commands recorded: document hashes, rows), {} without one."""
    f = out / "manifest.json"
    return json.loads(f.read_text()).get("data", {}) if f.exists() else {}


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


# ---------------------------------------------------------------------------------------------- arms and levers
def train_wordings() -> int:
    """Wordings per task of the ``train`` template family (the largest --s3-wordings)."""
    from headscope.tasks.formats import FAMILIES

    return min(len(FAMILIES["train"].wordings[t]) for t in FORMAT_TASKS)


def lever_values(a: argparse.Namespace) -> dict[str, Any]:
    """The value of every lever of :data:`LEVERS` for this command (an option not given = the study's),
    validated.

    Raises:
        SystemExit: --s2-retrieval outside [0, 0.9] or with more than two decimals; --s3-wordings
            outside 1..(train wordings per task).
    """
    v = {k: (d if getattr(a, k, None) is None else getattr(a, k)) for k, d in LEVERS.items()}
    f = float(v["s2_retrieval"])
    if not 0 <= f <= 0.9 or abs(round(f, 2) - f) > 1e-9:
        raise SystemExit(f"--s2-retrieval {f}: a share of stage-2 rows in [0, 0.9] in steps of 0.01")
    v["s2_retrieval"] = round(f, 2)
    if not 1 <= int(v["s3_wordings"]) <= train_wordings():
        raise SystemExit(f"--s3-wordings {v['s3_wordings']}: the train family has 1..{train_wordings()} wordings per task")
    return v


def arm_levers(a: argparse.Namespace) -> dict[str, Any]:
    """The levers of this command that differ from the study's settings, in label order (the budget
    and --tokens are not among them: the arm's name and the tokens carry those).

    Raises:
        SystemExit: an invalid lever (:func:`lever_values`); a lever or --budget with the teacher;
            --budget that is not the arm's (the arm's name states its budget).
    """
    v = lever_values(a)
    levers = {k: x for k, x in v.items() if x != LEVERS[k]}
    if a.arm == "teacher":
        if levers or a.budget is not None:
            raise SystemExit(f"the teacher has no levers (given: {levers or {'budget': a.budget}})")
        return {}
    if a.budget is not None and a.budget != ARM_BUDGETS[a.arm]:
        alt = a.arm.replace(ARM_BUDGETS[a.arm].replace(":", "to"), a.budget.replace(":", "to"))
        hint = f"; use --arm {alt}" if a.arm != "layer-3to1" and alt in ARM_BUDGETS else ""
        raise SystemExit(f"--budget {a.budget} with --arm {a.arm} ({ARM_BUDGETS[a.arm]}): the arm's name states its budget{hint}")
    return levers


def arm_label(a: argparse.Namespace) -> str:
    """The arm's model name (retention.csv's ``model``): the arm plus ``+lever=value`` per lever off the
    study's setting, e.g. ``hydra-7to1`` (the baseline), ``hydra-7to1+fa_pos=rope``, ``hydra-5to1``."""
    return a.arm + "".join(f"+{k}={v:g}" if isinstance(v, float) else f"+{k}={v}" for k, v in arm_levers(a).items())


def stage_rows_files(levers: dict[str, Any]) -> dict[str, str]:
    """Row files (in OUT/seedS/data/) of each stage: the study's short.pt / long.pt, or a lever's."""
    s2, s3 = levers.get("s2_retrieval"), levers.get("s3_wordings")
    return {"stage1": "short.pt", "stage2": f"stage2_r{s2:g}.pt" if s2 else "short.pt",
            "stage3": f"long_w{s3}.pt" if s3 else "long.pt"}


def arm_spec(a: argparse.Namespace, s: dict) -> dict[str, Any]:
    """Everything that makes the arm's run: written to RUN/arm.json by the first train command and
    compared by every later train / eval command of the same run (:func:`check_arm`)."""
    levers = arm_levers(a)
    v = lever_values(a)
    tokens = parse_tokens(a.tokens) if a.arm != "teacher" else 0
    kind = {**ARMS, **BUDGET_ARMS, **{k: "ie_kappa1" for k in SELECTION_ARMS}}[a.arm]
    spec = {"label": arm_label(a), "arm": a.arm, "mask": kind, "budget": ARM_BUDGETS.get(a.arm),
            "levers": levers, "tokens": tokens, "stage_tokens": stage_tokens(s, tokens) if tokens else None,
            "hybrid": {**s["hybrid"], "fa_pos": v["fa_pos"]}, "s2_retrieval": v["s2_retrieval"], "s3_wordings": v["s3_wordings"],
            "retrieval_frac": s["retrieval_frac"], "rows": stage_rows_files(levers), "seed": a.seed}
    if a.arm == "hydra-5to1":
        spec["hydra_ranking"] = a.hydra_ranking
    if a.arm in SELECTION_ARMS:
        spec["ranking"] = SELECTION_ARMS[a.arm]
    return json.loads(json.dumps(spec))


def check_arm(rd: Path, spec: dict, mask: Optional[HeadMask] = None) -> None:
    """Write ``rd``/arm.json, or refuse when the run there was made with other settings (a rerun with
    other lever values, a changed mask or study setting), so that arms never mix in one checkpoint.

    Raises:
        SystemExit: a stored value differs from this command's.
    """
    want = dict(spec)
    if mask is not None:
        want["fa_heads"] = [list(h) for h in mask.fa_heads]
    f = rd / "arm.json"
    old = json.loads(f.read_text()) if f.exists() else {}
    diff = {k: (old[k], v) for k, v in want.items() if k in old and old[k] != v}
    if diff:
        raise SystemExit(f"{rd} holds a run with other settings {diff} (stored, given); another lever value needs its own run")
    if any(k not in old for k in want):
        rd.mkdir(parents=True, exist_ok=True)
        atomic_write_text(f, json.dumps({**old, **want}, indent=2))


# ---------------------------------------------------------------------------------------------- manifest
def record(out: Path, a: argparse.Namespace, outcome: str, seconds: float, extra: Optional[dict] = None) -> None:
    """Append a command and its outcome to OUT/manifest.json (and ``extra`` to its ``data``), under an exclusive
    lock on OUT/.manifest.lock: two chains of pieces may share OUT (two arms training at once on one GPU)."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".manifest.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _record(out, a, outcome, seconds, extra)


def _record(out: Path, a: argparse.Namespace, outcome: str, seconds: float, extra: Optional[dict]) -> None:
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
    """OUT/masks/ARM.json (written once from the HydraHead mask and the model's geometry): the arms of
    :data:`ARMS` at the study's budget (7:1) and layer-3to1; with a 5:1 arm (``a.arm``) also the arms
    of :data:`BUDGET_ARMS` (:func:`budget_masks`)."""
    import numpy as np

    from headscope.models import geometry_of

    d = Path(a.out) / "masks"
    want = [k for k, v in ARMS.items() if v]
    if all((d / f"{k}.json").exists() for k in want):
        out = {k: HeadMask.from_json(d / f"{k}.json") for k in want}
    else:
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
    if a.arm in BUDGET_ARMS:
        out.update(budget_masks(a, s, teacher, ARM_BUDGETS[a.arm], out["hydra-7to1"]))
    if a.arm in SELECTION_ARMS:
        out[a.arm] = selection_mask(a, s, teacher)
    return out


def selection_mask(a: argparse.Namespace, s: dict, teacher: Any, arm: Optional[str] = None) -> HeadMask:
    """OUT/masks/ARM.json of a :data:`SELECTION_ARMS` arm (``arm``, default ``a.arm``; written once): its ranking's
    fused score selected at the arm's budget with the study's ``min_per_layer`` (``HeadMask.select``, as HydraHead's
    mask was); ``teacher`` None: the geometry from the ranking file. ``--smoke``: seeded scores (another seed than
    the study's arms)."""
    import numpy as np

    from headscope.models import geometry_of
    from headscope.scores import Ranking

    arm = arm or a.arm
    f = Path(a.out) / "masks" / f"{arm}.json"
    if f.exists():
        return HeadMask.from_json(f)
    if s["hydra_mask"]:
        r = Ranking.load(ROOT / SELECTION_ARMS[arm])
        scores, src, n_kv = r.matrix("score"), SELECTION_ARMS[arm], int(r.geometry["n_kv_heads"])
        if teacher is not None and geometry_of(teacher.config).n_kv_heads != n_kv:
            raise SystemExit(f"{src} ranks a model with {n_kv} KV heads per layer, not the teacher's")
    else:  # --smoke
        g = geometry_of(teacher.config)
        scores, src, n_kv = np.random.default_rng(2).random((g.n_layers, g.n_heads)), "seeded scores (--smoke)", g.n_kv_heads
    m = HeadMask.select(scores, ARM_BUDGETS[arm], n_kv, min_per_layer=s["min_per_layer"])
    m.meta["ranking"] = src
    f.parent.mkdir(parents=True, exist_ok=True)
    m.to_json(f)
    return m


def budget_masks(a: argparse.Namespace, s: dict, teacher: Any, budget: str, hydra_study: HeadMask) -> dict[str, HeadMask]:
    """OUT/masks/ARM.json of the arms of :data:`BUDGET_ARMS` at ``budget`` (written once), built as the
    study's arms are (``build_masks``: ≥ ``min_per_layer`` FA heads per layer; random = the same seeded
    scores, so random-5to1 holds random-7to1's heads; layer-wise = the nearest number of whole layers),
    HydraHead re-selected from the ranking ``--hydra-ranking`` (``--smoke``: the seeded scores).

    Raises:
        SystemExit: the ranking does not select the study's HydraHead mask at the study's budget (the
            arms of both budgets must come from one ranking).
    """
    import numpy as np

    from headscope.models import geometry_of

    d = Path(a.out) / "masks"
    names = [k for k in BUDGET_ARMS if ARM_BUDGETS[k] == budget]
    if all((d / f"{k}.json").exists() for k in names):
        return {k: HeadMask.from_json(d / f"{k}.json") for k in names}
    g = geometry_of(teacher.config)
    if s["hydra_mask"]:
        from headscope.scores import Ranking

        src = Path(a.hydra_ranking) if Path(a.hydra_ranking).is_absolute() else ROOT / a.hydra_ranking
        scores = Ranking.load(src).matrix("score")
        again = HeadMask.select(scores, s["budget"], g.n_kv_heads, min_per_layer=s["min_per_layer"])
        if again != hydra_study:
            raise SystemExit(f"--hydra-ranking {a.hydra_ranking} does not select the study's HydraHead mask at {s['budget']} "
                             f"({s['hydra_mask']}); give the ranking that made it")
    else:  # --smoke: the seeded scores of masks()
        scores = np.random.default_rng(1).random((g.n_layers, g.n_heads))
    built = _conversion_module().build_masks(g.n_layers, g.n_heads, g.n_kv_heads, scores, budget, s["min_per_layer"], seed=0)
    out = {}
    for arm in names:
        out[arm] = built[BUDGET_ARMS[arm]]
        if BUDGET_ARMS[arm] == "hydrahead":
            out[arm].meta["ranking"] = a.hydra_ranking or "seeded scores (--smoke)"
        out[arm].to_json(d / f"{arm}.json")
    return out


# ---------------------------------------------------------------------------------------------- documents
def shard_hashes(docs: list[list[int]], batch: int) -> list[str]:
    """SHA-256 (:func:`sha256_docs`) of each shard of ``batch`` documents, in sampling order."""
    return [sha256_docs(docs[i : i + batch]) for i in range(0, len(docs), batch)]


def sample_docs(a: argparse.Namespace, s: dict, teacher: Any, tok: Any, folder: Path, n: int, base_seed: int,
                deadline: float, expected: Optional[Sequence[str]] = None) -> Optional[list[list[int]]]:
    """``n`` documents in batches of ``sample_batch`` saved as they finish (folder/docs_K.pt); None when
    ``deadline`` passed first (rerun to continue).

    ``expected``: the shard hashes (:func:`shard_hashes`) an earlier session recorded for these documents
    (``data/info.json``, kept without the shards). A newly sampled shard that differs is
    set aside as ``docs_K.differs.pt`` and the command refuses: the arms of a seed must train on the same
    documents, and sampling is only reproducible on the same GPU and software.
    """
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
            if expected is not None and k < len(expected) and sha256_docs(new) != expected[k]:
                torch.save(new, folder / f"docs_{k}.differs.pt")
                raise SystemExit(
                    f"the documents sampled again for {folder} differ from those an earlier session recorded (shard {k}: "
                    f"SHA-256 {sha256_docs(new)[:12]}… against {expected[k][:12]}…; set aside as docs_{k}.differs.pt): "
                    "teacher sampling is not reproducible on this machine or software. Carry the earlier documents in "
                    "(copy their shards/ folder into OUT/seedS/data/), or train this seed's arms "
                    "on new documents: delete the folder's info.json and every run and cell of the seed, or use another --seed")
            torch.save(new, folder / f"docs_{k}.tmp")
            (folder / f"docs_{k}.tmp").replace(f)
            docs += new
            print(f"sampled {len(docs)}/{n} documents" + (" (the recorded ones)" if expected else ""), flush=True)
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
            recorded = recorded_data(out).get("suite_docs_sha256")  # an earlier session's haystack (cells were scored on it)
            docs = sample_docs(a, s, teacher, tok, d / "shards", s["suite_docs"], SUITE_SAMPLE_SEED, deadline)
            if docs is None:
                return "partial: sampling stopped at the deadline; rerun"
            if recorded and sha256_docs(docs) != recorded:
                raise SystemExit(f"the haystack documents sampled again in {d} are not those recorded in {out}/manifest.json, "
                                 "on which stored cells were scored: copy them into OUT/suite/docs.pt (git show "
                                 "e91faf4:experiments/conversion-generalization/state/suite/docs.pt)")
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
    cells = sorted(eval_cells(a, cfg), key=lambda c: -c[2])  # --eval-formats / --eval-max-len: only what eval will score
    if a.workers > 1 and len(cells) > 1:
        import multiprocessing as mp

        global _POOL
        _POOL = (tok, cfg, filler, d / "pairs")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        with mp.get_context("fork").Pool(min(a.workers, len(cells))) as pool:
            for i, msg in enumerate(pool.imap_unordered(_build_cell, cells), 1):
                print(f"[{i}/{len(cells)}] {msg}", flush=True)
    else:
        for i, c in enumerate(cells, 1):
            if time.time() > deadline:
                return "partial: prompt sets stopped at the deadline; rerun"
            t0 = time.time()
            suite_pairs(tok, cfg, *c, filler=filler, cache_dir=d / "pairs")
            print(f"[{i}/{len(cells)}] {cell_line(c, time.time() - t0)}", flush=True)
    of = "" if len(cells) == len(cfg.cells()) else f" of {len(cfg.cells())} (--eval-formats / --eval-max-len)"
    return f"suite ready: {len(cells)} prompt sets{of}, {len(filler.sentences)} haystack sentences"


_POOL: Any = None


def cell_line(cell: tuple[str, str, int], seconds: float) -> str:
    """The progress line of one prompt set built (or loaded from suite/pairs/) by --piece suite."""
    task, formats, length = cell
    return f"prompt set {task} {formats} {length}: {seconds:.1f} s"


def _build_cell(cell: tuple[str, str, int]) -> str:
    tok, cfg, filler, cache = _POOL
    t0 = time.time()
    suite_pairs(tok, cfg, *cell, filler=filler, cache_dir=cache)
    return cell_line(cell, time.time() - t0)


def piece_data(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """Training documents of seed ``a.seed`` (the same for every arm), held-out rows, the study's stage
    rows (:func:`study_data`), then the rows of the data levers given (:func:`lever_data`)."""
    lever_values(a)  # refuse invalid lever values before any work
    msg = study_data(a, s, deadline)
    return msg if msg.startswith("partial") else msg + lever_data(a, s)


def split_docs(seed: int, s: dict, docs: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """(held-out, training) documents of a seed: a seeded shuffle, the first ``heldout_docs`` (at most a
    quarter) held out."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_held = min(s["heldout_docs"], len(docs) // 4)
    return [docs[i] for i in order[:n_held]], [docs[i] for i in order[n_held:]]


def stage3_rows(tok: Any, s: dict, seed: int, train: list[list[int]], n_wordings: int,
                n_ret: Optional[int] = None) -> tuple[TokenRows, TokenRows, TokenRows]:
    """(long text rows, retrieval rows, both mixed) of stage 3: ``train`` packed at ``long_len`` and
    ``n_ret`` train-family retrieval rows (default: ``retrieval_frac`` of the rows) from the first
    ``n_wordings`` wordings per task, at long_len / 4, / 2 and long_len tokens."""
    long_text = pack(train, s["long_len"], tok.eos_token_id)
    if n_ret is None:
        n_ret = max(4, round(len(long_text) * s["retrieval_frac"] / (1 - s["retrieval_frac"])))
    L = s["long_len"]
    ret = format_rows(tok, n_ret, L, texts_of(tok, train), tasks=s["suite"]["tasks"], family="train", seed=10 * seed + S3_SEED,
                      lengths=[max(128, L // 4), max(128, L // 2), L], n_wordings=n_wordings)
    return long_text, ret, mix(long_text, ret, seed=seed)


def study_data(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """Training documents of seed ``a.seed``, held-out rows and the study's rows of every stage."""
    out = Path(a.out)
    d = out / f"seed{a.seed}" / "data"
    if (d / "done").exists():
        return "data already built"
    # an earlier session's record of these documents (info.json is kept, the rows are not)
    earlier = json.loads((d / "info.json").read_text()) if (d / "info.json").exists() else {}
    teacher, tok = load_teacher(a, for_sampling=True)
    if a.smoke or s["corpus"]:
        docs = corpus_docs(a, s, tok)[0]
    else:
        docs = sample_docs(a, s, teacher, tok, d / "shards", s["docs"], 10_000 * a.seed, deadline,
                           expected=earlier.get("shard_sha256"))
        if docs is None:
            return "partial: sampling stopped at the deadline; rerun"
    if earlier.get("docs_sha256") not in (None, sha256_docs(docs)):
        raise SystemExit(f"seed {a.seed}'s documents in {d} (SHA-256 {sha256_docs(docs)[:12]}…) are not those recorded in its "
                         f"info.json ({earlier['docs_sha256'][:12]}…), on which earlier arms of the seed trained: carry those "
                         "documents in, or delete info.json and every run and cell of the seed to start it anew")
    held, train = split_docs(a.seed, s, docs)
    eos = tok.eos_token_id
    short = pack(train, s["seq_len"], eos)
    long_text, ret, long_rows = stage3_rows(tok, s, a.seed, train, LEVERS["s3_wordings"])
    short.save(d / "short.pt")
    long_rows.save(d / "long.pt")
    pack(held, s["seq_len"], eos).save(d / "heldout.pt")
    rows_sha = {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in ("short.pt", "long.pt", "heldout.pt")}
    differ = [f for f, h in earlier.get("rows_sha256", {}).items() if rows_sha.get(f) != h]
    if differ:
        for f in rows_sha:
            (d / f).unlink()
        raise SystemExit(f"seed {a.seed}'s rows built again from its recorded documents differ from those info.json "
                         f"recorded ({', '.join(differ)}): row building is not reproducible here; nothing kept")
    # haystack sentences of the suite that also occur in the training text (teacher text can repeat short sentences)
    shared = None
    if (out / "suite" / "docs.pt").exists():
        from headscope.tasks.filler import Filler

        train_sentences = set(Filler.from_texts(texts_of(tok, train), "train").sentences)
        shared = len(set(suite_filler(out, tok).sentences) & train_sentences)
    info = {"seed": a.seed, "docs": len(docs), "train_docs": len(train), "heldout_docs": len(held), "short_rows": len(short),
            "long_text_rows": len(long_text), "long_retrieval_rows": len(ret), "docs_sha256": sha256_docs(docs),
            "shard_sha256": shard_hashes(docs, s["sample_batch"]), "rows_sha256": rows_sha,
            "suite_sentences_in_training_text": shared}
    atomic_write_text(d / "info.json", json.dumps(info, indent=2))
    (d / "done").write_text("ok")
    record(out, a, "data", 0.0, {f"seed{a.seed}": info})
    return f"data built: {json.dumps({k: v for k, v in info.items() if not k.endswith('sha256') or k == 'docs_sha256'})}"


def lever_data(a: argparse.Namespace, s: dict) -> str:
    """The rows of the data levers of this command, each built once from the seed's stored documents
    (the study's split, checked against data/info.json's hash) into OUT/seedS/data/:

    * ``--s2-retrieval F``: stage2_rF.pt = short.pt's text rows mixed with round(rows · F / (1 − F))
      train-family retrieval rows of ``seq_len`` tokens (prompt seq_len − 8, the study's 3 wordings,
      format_rows seeds 10·S + 5 + task), so that F of the stage-2 rows are retrieval rows;
    * ``--s3-wordings K``: long_wK.pt = stage 3's rows with the same text rows, count of retrieval rows,
      seeds and lengths as long.pt, the retrieval rows drawn from the first K train wordings per task.

    data/levers.json records each file's rows and hash. Returns "" when there is nothing to build.
    """
    out = Path(a.out)
    d = out / f"seed{a.seed}" / "data"
    v = lever_values(a)
    files = stage_rows_files({k: x for k, x in v.items() if x != LEVERS[k]})
    todo = [f for f in (files["stage2"], files["stage3"]) if f not in ("short.pt", "long.pt") and not (d / f).exists()]
    if not todo:
        return ""
    tok = load_teacher(a)[1] if a.smoke else _cpu_tokenizer(a)
    if a.smoke or s["corpus"]:
        docs = corpus_docs(a, s, tok)[0]
    else:
        docs = sample_docs(a, s, None, tok, d / "shards", s["docs"], 10_000 * a.seed, float("inf"))
    info = json.loads((d / "info.json").read_text())
    if sha256_docs(docs) != info["docs_sha256"]:
        raise SystemExit(f"the documents of seed {a.seed} are not those its data/info.json hashed; rebuild the seed's data")
    train = split_docs(a.seed, s, docs)[1]
    f_lev = d / "levers.json"
    lev = json.loads(f_lev.read_text()) if f_lev.exists() else {}
    for f in todo:
        if f.startswith("stage2_r"):
            short = TokenRows.load(d / "short.pt")
            n = max(len(s["suite"]["tasks"]), round(len(short) * v["s2_retrieval"] / (1 - v["s2_retrieval"])))
            ret = format_rows(tok, n, s["seq_len"], texts_of(tok, train), tasks=s["suite"]["tasks"], family="train",
                              seed=10 * a.seed + S2_SEED, lengths=[s["seq_len"]], n_wordings=LEVERS["s3_wordings"])
            rows = mix(short, ret, seed=a.seed)
            rec = {"lever": "s2_retrieval", "value": v["s2_retrieval"], "text_rows": len(short), "retrieval_rows": len(ret)}
        else:
            _, ret, rows = stage3_rows(tok, s, a.seed, train, v["s3_wordings"], n_ret=info["long_retrieval_rows"])
            rec = {"lever": "s3_wordings", "value": v["s3_wordings"], "text_rows": info["long_text_rows"], "retrieval_rows": len(ret)}
        rows.save(d / f)
        rec["sha256"] = hashlib.sha256((d / f).read_bytes()).hexdigest()
        if lev.get(f, {}).get("sha256") not in (None, rec["sha256"]):
            (d / f).unlink()
            raise SystemExit(f"{d / f} built again is not the file levers.json recorded ({rec['sha256'][:12]}… against "
                             f"{lev[f]['sha256'][:12]}…): the rows would differ from those earlier arms trained on")
        lev[f] = rec
        atomic_write_text(f_lev, json.dumps(lev, indent=2))
        record(out, a, f"lever rows {f}", 0.0, {f"seed{a.seed}_levers": lev})
    return "; lever rows built: " + ", ".join(f"{f} ({lev[f]['retrieval_rows']} retrieval + {lev[f]['text_rows']} text rows)" for f in todo)


def run_dir(a: argparse.Namespace) -> Path:
    """OUT/seedS/LABEL_tTOKENS (:func:`arm_label`; the baseline arm: ARM_tTOKENS)."""
    return Path(a.out) / f"seed{a.seed}" / f"{arm_label(a)}_t{parse_tokens(a.tokens)}"


def arm_options(a: argparse.Namespace) -> str:
    """The options that name this command's arm run: --arm, --seed, --tokens and each lever off the study's value."""
    levers = arm_levers(a)
    flags = "".join(f" --{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f" --{k.replace('_', '-')} {v}"
                    for k, v in levers.items())
    return f"--arm {a.arm} --seed {a.seed} --tokens {a.tokens}{flags}"


def lost_stages(rd: Path) -> list[int]:
    """Stages of the run ``rd`` whose training is recorded here but whose weights are not: done.json without
    student.pt, or a started stage (log.csv) with neither done.json nor a checkpoint (the committed records keep
    done.json but no weights or checkpoints)."""
    from headscope.train.parallel import find_checkpoint

    lost = []
    for k in (1, 2, 3):
        sd = rd / f"stage{k}"
        if (sd / "done.json").exists():
            if not (sd / "student.pt").exists():
                lost.append(k)
        elif (sd / "log.csv").exists() and find_checkpoint(sd / "checkpoint") is None:
            lost.append(k)
    return lost


def set_aside(rd: Path, first: int) -> Path:
    """Move rd/stageK for every stage K >= ``first`` into rd/earlier_training_N/ (a new N): the records of a
    training whose weights are lost, kept for reference; the stages are then trained again."""
    n = 1
    while (rd / f"earlier_training_{n}").exists():
        n += 1
    dest = rd / f"earlier_training_{n}"
    dest.mkdir(parents=True)
    for k in range(first, 4):
        if (rd / f"stage{k}").exists():
            (rd / f"stage{k}").rename(dest / f"stage{k}")
    return dest


def eval_cells(a: argparse.Namespace, cfg: SuiteConfig) -> list[tuple[str, str, int]]:
    """The cells --piece eval scores, in order: those of ``--eval-formats`` (in that order, each shortest first)
    up to ``--eval-max-len`` tokens; by default every cell of the suite, shortest first. With
    ``--eval-tasks-first``, the cells of those tasks come first (in that task order, the rest of the order kept),
    so that an evaluation cut off by the end of a GPU session has measured them (e.g. the goal's niah_single).

    Raises:
        SystemExit: ``--eval-max-len`` below the suite's shortest length (no cell would be scored);
            ``--eval-tasks-first`` naming a task the suite does not have.
    """
    first = list(getattr(a, "eval_tasks_first", None) or [])
    unknown = [t for t in first if t not in cfg.tasks]
    if unknown:
        raise SystemExit(f"--eval-tasks-first {' '.join(unknown)}: not a task of the suite ({', '.join(cfg.tasks)})")
    if a.eval_max_len is not None and a.eval_max_len < min(cfg.lengths):
        raise SystemExit(f"--eval-max-len {a.eval_max_len} is below the suite's shortest length {min(cfg.lengths)}")
    if a.eval_formats is None and a.eval_max_len is None:
        cells = cfg.cells()
    else:
        formats = a.eval_formats or list(cfg.formats)
        cells = [c for fmt in formats for c in cfg.cells() if c[1] == fmt and (a.eval_max_len is None or c[2] <= a.eval_max_len)]
    rank = {t: i for i, t in enumerate(first)}
    return sorted(cells, key=lambda c: rank.get(c[0], len(first)))  # stable: the order within each group is kept


def cells_left(out: Path, label: str, seed: int, tokens: int, cfg: SuiteConfig,
               cells: Optional[list[tuple[str, str, int]]] = None) -> tuple[int, int]:
    """(cells of ``cells`` — default every cell of ``cfg`` — not stored yet for this model, cells in all), as
    :func:`evaluate_suite` decides."""
    from dataclasses import asdict

    d = cell_dir(out / "cells", label, seed, tokens)
    conf = json.loads(json.dumps(asdict(cfg)))
    cells = cfg.cells() if cells is None else cells
    left = 0
    for task, fmt, L in cells:
        f = d / f"{task}.{fmt}.{L}.json"
        if not (f.exists() and json.loads(f.read_text()).get("config") == conf):
            left += 1
    return left, len(cells)


def no_weights(a: argparse.Namespace, rd: Path, what: str) -> str:
    """The message when the student weights of a trained arm are not here: what to rerun."""
    return (f"{arm_label(a)} seed {a.seed} was trained ({rd}/stage3/done.json) but its student weights "
            f"{rd}/stage3/student.pt are not here (the records keep done.json, not weights), and {what}. "
            f"Retrain it: run.py --piece train --out {a.out} {arm_options(a)} --retrain (rerun until 'trained'), "
            "then rerun this command")


def piece_train(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """The three stages of one arm (its levers: :func:`arm_spec`); stops at ``deadline`` with a
    checkpoint (rerun to continue)."""
    from headscope.train.parallel import find_checkpoint

    if a.arm == "teacher":
        arm_levers(a)
        return "the teacher is not trained"
    out, rd = Path(a.out), run_dir(a)
    spec = arm_spec(a, s)
    data = out / f"seed{a.seed}" / "data"
    if not (data / "done").exists():
        raise SystemExit(f"no {data}/done: run --piece data --seed {a.seed} first")
    lever_flags = " ".join(f"--{k.replace('_', '-')} {spec[k]}" for k in ("s2_retrieval", "s3_wordings") if k in spec["levers"])
    for f in sorted(set(spec["rows"].values())):
        if not (data / f).exists():
            raise SystemExit(f"no {data / f}: run --piece data --seed {a.seed} {lever_flags} first")
    check_arm(rd, spec)
    if (rd / "stage3" / "done.json").exists() and (rd / "stage3" / "student.pt").exists():
        return "trained"
    lost = lost_stages(rd)
    if lost:
        cells = cell_dir(out / "cells", spec["label"], a.seed, parse_tokens(a.tokens))
        note = (f"; the cells already stored in {cells} were scored with the earlier student and move with its records "
                "(every cell of an arm comes from one student)") if cells.exists() else ""
        if not a.retrain:
            raise SystemExit(
                f"{spec['label']} seed {a.seed}: stage(s) {', '.join(map(str, lost))} were trained (done.json or log.csv in "
                f"{rd}/stageK) but their weights are not here (student.pt, checkpoint/: the records keep neither). "
                f"Retrain: run.py --piece train --out {a.out} {arm_options(a)} --retrain (rerun until 'trained'; the "
                f"earlier records move to {rd}/earlier_training_N/){note}")
        moved = set_aside(rd, lost[0])
        if cells.exists():  # scored with the student being replaced: kept beside its records, out of the report
            cells.rename(moved / "cells")
            note = f"; its cells, scored with the earlier student, moved to {moved}/cells"
        print(f"--retrain: stages {lost[0]}..3 of {spec['label']} seed {a.seed} train again; earlier records in {moved}{note}",
              flush=True)
    teacher, tok = load_teacher(a)
    mask = masks(a, s, teacher)[a.arm]
    check_arm(rd, spec, mask)
    short, long_rows = TokenRows.load(data / spec["rows"]["stage1"]), TokenRows.load(data / spec["rows"]["stage3"])
    mid = short if spec["rows"]["stage2"] == spec["rows"]["stage1"] else TokenRows.load(data / spec["rows"]["stage2"])
    dev = next(teacher.parameters()).device
    opts = {"gdn_kernel": s["gdn_kernel"], **spec["hybrid"]}
    budgets = spec["stage_tokens"]
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
                                      deadline=deadline, rows={1: short, 2: mid, 3: long_rows}[stage],
                                      resume=find_checkpoint(sd / "checkpoint") is not None)
        print(spec["label"], f"seed {a.seed}", json.dumps(summ), flush=True)
        if not summ["finished"]:
            return f"partial: stage {stage} at step {summ['steps']}/{summ['total_steps']}; rerun the same command"
    return "trained"


def trained_student(a: argparse.Namespace, s: dict, teacher: Any, spec: dict) -> tuple[HeadMask, Any]:
    """(mask, student) of the arm's trained run (RUN/stage3/student.pt), built with the arm's own hybrid settings
    (``spec["hybrid"]``: its levers, e.g. ``fa_pos=rope``) after :func:`check_arm` has compared the run's arm.json;
    what every piece that loads a trained student (eval, anatomy) builds it with.

    Raises:
        SystemExit: the run was made with other settings (:func:`check_arm`).
    """
    rd = run_dir(a)
    mask = masks(a, s, teacher)[a.arm]
    check_arm(rd, spec, mask)
    return mask, load_student(teacher, mask, init=rd / "stage3" / "student.pt", gdn_kernel=s["gdn_kernel"], **spec["hybrid"])


def piece_eval(a: argparse.Namespace, s: dict, deadline: float) -> str:
    out = Path(a.out)
    spec = arm_spec(a, s)
    cfg = suite_config(s)
    chosen = eval_cells(a, cfg)
    if a.arm != "teacher":
        rd = run_dir(a)
        if not (rd / "stage3" / "done.json").exists():
            raise SystemExit(f"{spec['label']} seed {a.seed} is not trained ({rd}/stage3/done.json missing): run --piece train")
        check_arm(rd, spec)
        if not (rd / "stage3" / "student.pt").exists():
            left, n = cells_left(out, spec["label"], a.seed, parse_tokens(a.tokens), cfg, chosen)
            if not left:
                return f"evaluated: all {n} cells stored (the student weights, not here, are not needed)"
            raise SystemExit(no_weights(a, rd, f"{left} of its {n} cells are not stored yet"))
    teacher, tok = load_teacher(a)
    if a.arm == "teacher":
        model, tokens = teacher, 0
    else:
        model = trained_student(a, s, teacher, spec)[1]
        tokens = parse_tokens(a.tokens)
    res = evaluate_suite(model, tok, spec["label"], a.seed if a.arm != "teacher" else 0, tokens, cfg, out / "cells",
                         filler=suite_filler(out, tok), cache_dir=out / "suite" / "pairs", deadline=deadline, cells=chosen)
    rest = cells_left(out, spec["label"], a.seed if a.arm != "teacher" else 0, tokens, cfg)[0] - res["left"]
    return (f"evaluated: {res['done']} cells stored" + (f", {res['left']} left; rerun" if res["left"] else "")
            + (f" ({rest} other cells of the suite not chosen by --eval-formats / --eval-max-len)" if rest else ""))


def piece_report(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """The study's tables into OUT (tables.py), from the cells there (run_piece restored the committed records first)."""
    return TABLES.report(Path(a.out), None)


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
    p.add_argument("--anatomy-singles", type=int, default=3,
                   help="anatomy: knock out each of the student's and the teacher's top heads alone (mean ablation), this many of each")
    p.add_argument("--anatomy-batch", type=int, default=None, help="anatomy: patched rows per forward (default: by memory)")


def anatomy_key(a: argparse.Namespace) -> str:
    gap = "" if a.anatomy_min_gap == 0.1 else f"_gap{a.anatomy_min_gap:g}"
    return f"{a.anatomy_formats}_{a.anatomy_task}@{a.anatomy_len}_p{a.anatomy_pairs}{gap}"


def anatomy_pairs(a: argparse.Namespace, s: dict, tok: Any) -> tuple[list[Any], list[Any], list[int]]:
    """(ranking pairs, knockout prompts, their indices in the cell): ``--anatomy-pairs`` pairs of seed ANATOMY_SEED
    (needle depths 0.1..0.9; built once into OUT/anatomy/KEY/pairs.pt), and ``--anatomy-n`` prompts of the suite's
    cell of that task, family and length, evenly spaced over its needle depths (the cell's prompts: another seed
    than the ranking pairs)."""
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
    return rank, [cell[i] for i in keep], keep


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


#: the share of prompts on which the anatomy's unablated model must score as its eval cell did (session 4: 99 of
#: 100 for the student and for the teacher; fp32 there, bf16 autocast in the eval)
EVAL_AGREEMENT_MIN = 0.9


def eval_agreement(out: Path, model: str, seed: int, tokens: int, a: argparse.Namespace, correct: Sequence[int],
                   index: Sequence[int]) -> Optional[dict[str, Any]]:
    """How the anatomy's unablated ``model`` (per-prompt ``correct`` on the cell's prompts ``index``) agrees with its
    stored eval cell of the same task, family and length: {n, agree, accuracy, eval_accuracy}; None without a stored
    cell. A check that the piece built the model the eval scored (its mask, its levers' settings, its weights).

    Raises:
        SystemExit: fewer than :data:`EVAL_AGREEMENT_MIN` of the prompts agree (another model than the eval's).
    """
    f = cell_dir(out / "cells", model, seed, tokens) / f"{a.anatomy_task}.{a.anatomy_formats}.{a.anatomy_len}.json"
    if not f.exists():
        return None
    cell = json.loads(f.read_text())["correct"]
    ev = [int(cell[i]) for i in index]
    agree = sum(int(x) == y for x, y in zip(correct, ev))
    rec = {"n": len(ev), "agree": agree, "accuracy": sum(correct) / len(ev), "eval_accuracy": sum(ev) / len(ev)}
    if agree < EVAL_AGREEMENT_MIN * len(ev):
        raise SystemExit(f"anatomy: the unablated {model} scores {rec['accuracy']:.2f} on {len(ev)} prompts of {f.name}, "
                         f"its eval cell {rec['eval_accuracy']:.2f}, agreeing on {agree}: not the model the eval scored "
                         f"(its mask, lever settings or weights differ); check {f.parent} against the arm's run folder")
    return rec


def piece_anatomy(a: argparse.Namespace, s: dict, deadline: float) -> str:
    """Anatomy after conversion (issue 40, item 4): the teacher's and the student's heads ranked on the same pairs
    (receiver IE, exact fp32, the student's FA and GDN heads alike at o_proj's input), their comparison, and
    retrieval accuracy with the student's FA heads knocked out (controls: as many random GDN heads; the student's
    top heads by IE; the teacher with the same heads, and with all the heads the student turned into GDN, knocked
    out; every GDN head of the student, what its FA heads alone keep; and, by mean ablation, each of the student's
    and the teacher's ``--anatomy-singles`` best heads alone). OUT/anatomy/KEY/seedS_ARM_tTOKENS/{anatomy.json, heads.csv,
    knockout.csv}; the teacher's ranking in OUT/anatomy/KEY/teacher/ (shared by the arms). Resumable."""
    import csv

    from headscope.knockout import mean_reference
    from headscope.models import wrap
    from headscope.student_anatomy import (compare_rankings, head_comparison, kind_summary, knockout_accuracy,
                                           random_gdn_heads)
    from headscope.patching.hybrid_engine import head_kinds

    out = Path(a.out)
    base = out / "anatomy" / anatomy_key(a)
    spec = arm_spec(a, s)
    rd = base / ("teacher" if a.arm == "teacher" else f"seed{a.seed}_{spec['label']}_t{parse_tokens(a.tokens)}")
    res_f = rd / "anatomy.json"
    res = json.loads(res_f.read_text()) if res_f.exists() else {}
    if res.get("done"):
        return f"anatomy already done: {res_f}"
    rd.mkdir(parents=True, exist_ok=True)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 patching, as headscope rank
    try:
        teacher, tok = load_teacher(a)
        rank_pairs, ko_pairs, ko_index = anatomy_pairs(a, s, tok)
        t_lm = wrap(teacher, tok, name="teacher")
        t_rank, t_err = _ranking_of(t_lm, rank_pairs, a, base / "teacher")
        res.update({"key": anatomy_key(a), "arm": spec["label"], "seed": a.seed, "tokens": parse_tokens(a.tokens),
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
            raise SystemExit(f"{spec['label']} seed {a.seed} is not trained ({rdir}/stage3/done.json missing): run --piece train")
        if not (rdir / "stage3" / "student.pt").exists():
            raise SystemExit(no_weights(a, rdir, "the anatomy piece ranks and knocks out the student's heads"))
        mask, student = trained_student(a, s, teacher, spec)
        res["hybrid"] = spec["hybrid"]
        s_lm = wrap(student, tok, name=spec["label"])
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
        # one head at a time (mean ablation only): the student's and the teacher's best heads on these pairs
        singles = [(int(x.layer), int(x.head)) for r in (s_rank, t_rank) if r is not None for x in r.top(a.anatomy_singles).itertuples()]
        for lay, h in dict.fromkeys(singles):
            sets[f"single_L{lay}H{h}"] = [(lay, h)]
        gdn = [(lay, h) for lay, ks in enumerate(kinds) for h, k in enumerate(ks) if k == "gdn"]
        sets["gdn"] = gdn  # every GDN head: what the student's FA heads alone keep
        # the teacher with the student's FA heads knocked out, and with all its GDN heads (what the FA heads alone keep)
        conds = [("student", c, h) for c, h in sets.items()] + [("teacher", "none", []), ("teacher", "fa", fa),
                                                                ("teacher", "gdn", gdn)]
        ko = res.setdefault("knockout", {})
        refs: dict[str, Any] = {}
        left = 0
        for method in a.anatomy_methods:
            for model_name, cond, heads in conds:
                key = f"{model_name}/{method}/{cond}"
                if key in ko or (method != a.anatomy_methods[0] and cond == "none") or (method != "mean" and cond.startswith("single_")):
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
                if cond == "none":  # the unablated model against its own eval cell on the same prompts
                    res.setdefault("eval_agreement", {})[model_name] = eval_agreement(
                        out, spec["label"] if model_name == "student" else "teacher", a.seed if model_name == "student" else 0,
                        parse_tokens(a.tokens) if model_name == "student" else 0, a, r["correct"], ko_index)
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
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The module docstring as written, and every option's default in its help."""

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Fmt)
    p.add_argument("--piece", choices=list(PIECES))
    p.add_argument("--out", default="runs/conversion-generalization")
    p.add_argument("--model", default="smollm2-135m", help="the teacher (a .gguf path, HF directory or spec)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arm", choices=[*ARMS, *BUDGET_ARMS, *SELECTION_ARMS], default="hydra-7to1",
                   help="the mask (its name states its budget; the 5:1 arms are the budget lever)")
    p.add_argument("--tokens", default=BASE_TOKENS, help="training tokens of the arm, all stages (50M, 200M, ...): a lever")
    p.add_argument("--budget", choices=["7:1", "5:1"], default=None,
                   help="lever: the FA budget; must be the arm's (hydra-5to1, layer-5to1, random-5to1 are the 5:1 arms)")
    p.add_argument("--s2-retrieval", type=float, default=None,
                   help="lever: share of stage-2 rows that are train-family retrieval rows, 0..0.9 (study: 0)")
    p.add_argument("--s3-wordings", type=int, default=None,
                   help="lever: train-family wordings per task in the stage-3 retrieval rows, 1..6 (study: 3)")
    p.add_argument("--fa-pos", choices=["rope", "nope"], default=None,
                   help="lever: FA heads with the teacher's RoPE, or NoPE with the log-scale (study: nope)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after this many seconds")
    p.add_argument("--corpus", default=None, help="a user text file (documents separated by blank lines) instead of teacher samples")
    p.add_argument("--hydra-mask", default="experiments/conversion-smollm2-50m/masks/hydrahead.json",
                   help="the HydraHead mask of the study's budget (the 50M-token study's)")
    p.add_argument("--hydra-ranking", default="experiments/fused-smollm2/focus",
                   help="the ranking that selected --hydra-mask: the HydraHead mask of the 5:1 arms is selected from it")
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
    p.add_argument("--tasks", nargs="+", default=list(FORMAT_TASKS))
    p.add_argument("--formats", nargs="+", choices=["seen", "unseen"], default=["seen", "unseen"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--n", type=int, default=100, help="prompts per cell")
    p.add_argument("--gen-n", type=int, default=20, help="prompts per cell also scored by greedy generation")
    p.add_argument("--gen-max-len", type=int, default=4096)
    p.add_argument("--batch-tokens", type=int, default=32768, help="tokens per forward of the teacher-forced scoring")
    p.add_argument("--eval-formats", nargs="+", choices=["seen", "unseen"], default=None,
                   help="eval: score only these formats' cells, in this order (e.g. unseen first in a short session); "
                        "suite: build only their prompt sets")
    p.add_argument("--eval-max-len", type=int, default=None,
                   help="eval: score only cells of at most this many tokens; suite: build only their prompt sets")
    p.add_argument("--eval-tasks-first", nargs="+", default=None, metavar="TASK", choices=FORMAT_TASKS,
                   help="eval: score these tasks' cells first (e.g. niah_single, the goal's task, in a short session); "
                        f"one or more of {', '.join(FORMAT_TASKS)}")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="processes building prompt sets")
    p.add_argument("--tokenizer", default=None, help="--smoke: an HF tokenizer folder (default: the SmolLM2 GGUF's)")
    p.add_argument("--smoke", action="store_true", help="every piece on a tiny random model on the CPU (a temporary --out)")
    p.add_argument("--retrain", action="store_true",
                   help="train: train again the stages whose weights are lost (e.g. not kept in the records)")
    add_anatomy_args(p)
    return p


SMOKE = ["--docs", "16", "--heldout-docs", "2", "--suite-docs", "12", "--seq-len", "128", "--long-len", "256",
         "--batch", "4", "--batch-long", "2", "--lengths", "256", "--n", "2", "--gen-n", "1", "--gen-max-len", "256",
         "--tokens", "1", "--hydra-mask", "", "--hydra-ranking", "", "--gdn-kernel", "torch", "--device", "cpu", "--workers", "2",
         "--ckpt-every", "0"]
#: the smoke run's lever arm: every lever at once (the budget, both data levers, the FA positions)
SMOKE_LEVERS = ["--arm", "hydra-5to1", "--budget", "5:1", "--s2-retrieval", "0.25", "--s3-wordings", "6", "--fa-pos", "rope"]


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
                             ("eval", ["--arm", "teacher"]), ("data", SMOKE_LEVERS), ("train", SMOKE_LEVERS), ("eval", SMOKE_LEVERS), ("report", []),
                             ("anatomy", ANATOMY_SMOKE), ("anatomy", [*ANATOMY_SMOKE, *SMOKE_LEVERS])):
            sub = parser().parse_args([*SMOKE, "--out", out, "--piece", piece, *extra, *tok_args])
            sub.smoke = True
            msgs.append(run_piece(sub))
        if "--out" in argv:
            print(f"smoke run in {out}", flush=True)
        else:  # temporary folders (~0.5 GB): removed; pass --out DIR to keep the run
            shutil.rmtree(out, ignore_errors=True)
            print("smoke run passed (temporary folders removed; --out DIR keeps them)", flush=True)
        return "\n".join(msgs)
    if not a.piece:
        raise SystemExit("give --piece (suite, data, train, eval, report, anatomy) or --smoke")
    return run_piece(a)


def run_piece(a: argparse.Namespace) -> str:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = True
    if a.piece == "report" and not a.smoke:  # the committed results first (settings.json among them)
        TABLES.restore_records(Path(a.out))
    s = settings(a)
    msg = PIECES[a.piece](a, s, t0 + a.budget_s)
    record(Path(a.out), a, msg, time.time() - t0)
    print(f"{a.piece}: {msg} ({time.time() - t0:.0f} s)", flush=True)
    return msg


if __name__ == "__main__":
    main()
