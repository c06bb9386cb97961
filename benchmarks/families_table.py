"""Issue 61's per-family table for docs/performance.md, from the result files of ``benchmarks/recipes/families.sh``.

    python benchmarks/families_table.py RESULTS_DIR [--prefix h100_] [--link-dir ../benchmarks/results/]

Reads, per family F of ``benchmarks/family_configs.py``, ``PREFIX + generate_F.json`` (``bench_generate.py``),
``train_F.json`` (``bench_train.py --family``), ``first_call_F.json`` (``bench_first_call.py``, optional) and, for the
families with a real checkpoint, ``greedy_smollm2.json`` / ``greedy_gemma3.json`` (``gpu_greedy_real.py``), and prints
one markdown row per family with each goal of the issue marked met or missed:

- ``generate`` with defaults: hybrid ÷ teacher ms per token ≤ 0.6 at B1·8K and at B16·32K;
- training step (stage 2): the hybrid's fast step ÷ the teacher's compiled dense step (tokens/s) ≥ 0.9;
- first call: the hybrid's first ``generate`` ≤ the teacher's + 2 s, at B1·8K (the process's first call) and B16·32K
  (the first call of a new shape in that process), from the generate file; where a first-call file is there, its
  second process with the compile caches kept ("cached") beside it;
- greedy tokens of the fast and reference paths equal on the real checkpoint (every prompt, dtype and setting).

A file that is not there reads "not measured"; a cell where the hybrid ran out of memory or failed says so (missed);
one where only the teacher did gives the hybrid's figure and counts for neither. Below the table: the devices the
files name (one expected) and how many measured rows met each goal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_configs import FAMILIES  # noqa: E402

GEN_GOAL, TRAIN_GOAL, FIRST_CALL_SLACK_S = 0.6, 0.9, 2.0
CELLS = ((1, 8192), (16, 32768))
NAMES = {"smollm2": "SmolLM2-135M", "qwen2": "Qwen2.5-0.5B config (biases)", "qwen3": "Qwen3-0.6B",
         "mistral": "Mistral-7B layer shape, 8 layers", "gemma3": "Gemma 3 270M", "gpt-neox": "Pythia-160M (GPT-NeoX)"}
REAL = {"smollm2": "greedy_smollm2", "gemma3": "greedy_gemma3"}  # families with a real checkpoint installed


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _ratio(x: float) -> str:
    return f"{x:.3f}" if x < 0.1 else f"{x:.2f}"


def _cell(gen: dict, B: int, T: int) -> Optional[dict]:
    return next((c for c in gen.get("cells", []) if c.get("setting", "default") == "default" and c["batch"] == B
                 and c["prompt"] == T), None)


def _kind(cell: dict) -> str:
    return "out of memory" if all("OutOfMemory" in v for v in cell["error"].values()) else "failed"


def _failed(cell: dict) -> str:
    return f"{_kind(cell)} ({', '.join(sorted(cell['error']))})"


def generate_ratio(gen: Optional[dict], B: int, T: int) -> tuple[str, Optional[bool]]:
    """(text, met) of the hybrid ÷ teacher ms per token at one cell; met None where not measured or where only the
    teacher failed (nothing to compare with), False where the hybrid failed."""
    c = _cell(gen, B, T) if gen else None
    if c is None:
        return "not measured", None
    if "error" in c:
        if "hybrid" in c["error"]:
            return f"{_failed(c)}: **missed**", False
        return f"teacher {_kind(c)}; hybrid {c['hybrid_ms_per_token']:.2f} ms", None
    r = c["hybrid_over_teacher"]
    return f"{_ratio(r)} ({c['hybrid_ms_per_token']:.2f} / {c['teacher_ms_per_token']:.2f} ms): {_mark(r <= GEN_GOAL)}", \
        r <= GEN_GOAL


def first_call(gen: Optional[dict], first: Optional[dict], B: int, T: int) -> tuple[str, Optional[bool]]:
    """(text, met): the hybrid's and the teacher's first call of the cell in seconds; the cached-caches process."""
    c = _cell(gen, B, T) if gen else None
    if c is None:
        return "not measured", None
    if "hybrid_first_call_ms" not in c:
        return f"{_failed(c)}: **missed**", False
    h = c["hybrid_first_call_ms"] / 1e3
    if "teacher_first_call_ms" not in c:
        return f"{h:.1f} s / teacher {_kind(c)}", None
    t = c["teacher_first_call_ms"] / 1e3
    ok = h <= t + FIRST_CALL_SLACK_S
    text = f"{h:.1f} / {t:.1f} s: {_mark(ok)}"
    fc = next((x for x in (first or {}).get("cells", []) if x["batch"] == B and x["prompt"] == T), None)
    if fc and "hybrid_first_cached_s" in fc:
        text += f" (caches kept: {fc['hybrid_first_cached_s']:.1f} s)"
    return text, ok


def train_ratio(train: Optional[dict]) -> tuple[str, Optional[bool]]:
    """(text, met) of the stage-2 fast hybrid step ÷ the teacher's compiled dense step, with the shape."""
    if not train:
        return "not measured", None
    acc = {k: v for k, v in train.get("acceptance", {}).items() if k.startswith("stage2_")}
    row = next((v for v in acc.values() if "ratio_vs_dense_compiled" in v), None)
    if row is None:
        errs = train.get("errors", {})
        why = "; ".join(f"{k.split('/')[-1]}: {v.split(':')[0]}" for k, v in errs.items()) or "no ratio in the file"
        return f"failed ({why}): **missed**", False
    shape = next(k for k, v in acc.items() if v is row).removeprefix("stage2_").replace("x", " × ")
    r = row["ratio_vs_dense_compiled"]
    step = "" if row.get("hybrid_fast_step", True) else ", plain step"
    return f"{_ratio(r)} ({row['hybrid_tok_s'] / 1e3:.1f}K / {row['dense_compiled_tok_s'] / 1e3:.1f}K tok/s, " \
           f"{shape}{step}): {_mark(r >= TRAIN_GOAL)}", r >= TRAIN_GOAL


def greedy(real: Optional[dict], family: str) -> tuple[str, Optional[bool]]:
    """(text, met) of the real checkpoint's greedy-token comparison."""
    if family not in REAL:
        return "no checkpoint installed", None
    if not real or not real.get("runs"):
        return "not measured", None
    runs = real["runs"]
    dtypes = sorted({r["dtype"].removeprefix("torch.") for r in runs})
    n = f"{len({r['prompt'] for r in runs})} prompts × {runs[0]['steps']} tokens, {' + '.join(dtypes)}"
    bad = [r for r in runs if not r["equal"]]
    if not bad:
        return f"equal ({n}): met", True
    b = bad[0]
    return (f"differ in {len(bad)} of {len(runs)} ({b['dtype'].removeprefix('torch.')} prompt {b['prompt']} from step "
            f"{b['first_difference']}, reference margin {b['reference_margin_at_first_difference']}; {n}): **missed**",
            False)


def _read(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def rows(results: Path, prefix: str = "", link_dir: str = "../benchmarks/results/") -> tuple[list[list[str]], dict]:
    """The table's rows (one per family, cells as text) and a summary: met / measured per goal, the devices named."""
    out, met, devices = [], {}, set()
    for fam in FAMILIES:
        names = {"generate": f"generate_{fam}", "train": f"train_{fam}", "first call": f"first_call_{fam}"}
        if fam in REAL:
            names["greedy"] = REAL[fam]
        data = {k: _read(results / f"{prefix}{v}.json") for k, v in names.items()}
        for d in data.values():
            dev = d and (d.get("versions", {}).get("device") or d.get("device"))
            if dev:
                devices.add(dev)
        cells = {f"generate B{B}·{T // 1024}K": generate_ratio(data["generate"], B, T) for B, T in CELLS}
        cells["training step"] = train_ratio(data["train"])
        cells.update({f"first call B{B}·{T // 1024}K": first_call(data["generate"], data["first call"], B, T)
                      for B, T in CELLS})
        cells["greedy tokens"] = greedy(data.get("greedy"), fam)
        for goal, (_, ok) in cells.items():
            if ok is not None:
                m = met.setdefault(goal, [0, 0])
                m[0] += ok
                m[1] += 1
        links = " ".join(f"[{k}]({link_dir}{prefix}{names[k]}.json)" for k, d in data.items() if d is not None)
        out.append([NAMES[fam]] + [text for text, _ in cells.values()] + [links or "—"])
    return out, {"met": met, "devices": sorted(devices)}


HEADER = ["family (random weights of its config; real checkpoint for the greedy column)",
          "`generate` ÷ teacher, B1·8K (≤ 0.6)", "B16·32K (≤ 0.6)",
          "training step ÷ teacher's compiled dense step (≥ 0.9)",
          "first call hybrid / teacher, B1·8K (≤ teacher + 2 s)", "new shape B16·32K (≤ teacher + 2 s)",
          "greedy tokens, fast = reference", "files"]


def markdown(results: Path, prefix: str = "", link_dir: str = "../benchmarks/results/") -> str:
    """The markdown table and its summary lines."""
    table, summary = rows(results, prefix, link_dir)
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    lines.append("")
    devs = summary["devices"]
    lines.append(f"Devices: {', '.join(devs) if devs else 'none named'}"
                 + (" — **more than one: the ratios are not from one GPU type**" if len(devs) > 1 else "") + ".")
    order = [f"generate B{B}·{T // 1024}K" for B, T in CELLS] + ["training step"] + [
        f"first call B{B}·{T // 1024}K" for B, T in CELLS] + ["greedy tokens"]
    met = summary["met"]
    lines.append("Goals met: " + ("; ".join(f"{g} {met[g][0]} of {met[g][1]}" for g in order if g in met)
                                  or "none measured") + ".")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="folder with the families.sh result files")
    ap.add_argument("--prefix", default="", help="file-name prefix of the stored results, e.g. h100_")
    ap.add_argument("--link-dir", default="../benchmarks/results/", help="link target folder, as seen from docs/")
    a = ap.parse_args()
    if not Path(a.results).is_dir():
        ap.error(f"{a.results} is not a folder; pass the OUT_DIR of benchmarks/recipes/families.sh")
    print(markdown(Path(a.results), a.prefix, a.link_dir))


if __name__ == "__main__":
    main()
