"""Issue 62, item 2 (teacher side): which of the teacher's multi-key heads the default mask leaves GDN, and whether the
teacher needs them. CPU, about 30 minutes on two cores.

    python experiments/conversion-generalization/multikey_anatomy.py OUT

1. ranks SmolLM2-135M-Instruct on the four tasks (``headscope rank``, 6 pairs of 512 tokens each, fused score with
   retrieval focus, the product's defaults; gpu_parts.sh's ``levers_rank`` runs the same command) into OUT/fused4,
   unless OUT/fused4/ranking.json is there;
2. writes OUT/gdn_left: the same scores, ranked by multi-key receiver IE among the heads that the study's default mask
   (records/masks/hydra-7to1.json) leaves GDN (its FA heads last);
3. knocks out (mean ablation, experiments/knockout.py) the top K of each ranking on ``niah_multikey`` at 1,024 tokens,
   50 prompts of a seed the rankings never saw, against K random heads (three draws): OUT/ko_fused4, OUT/ko_gdn_left;
4. prints per ranking the share of positive multi-key IE on the mask's FA heads and the knockout table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from headscope.masks import HeadMask

HERE = Path(__file__).resolve().parent
MASK = HERE / "records" / "masks" / "hydra-7to1.json"
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")


def gdn_left(fused: Path, out: Path, fa: set[tuple[int, int]]) -> pd.DataFrame:
    """A copy of the ranking ``fused`` whose ``rank`` orders the mask's GDN heads by multi-key receiver IE."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("ranking.json", "mask.json"):
        (out / name).write_text((fused / name).read_text())
    d = pd.read_csv(fused / "scores.csv")
    is_fa = pd.Series([(lay, h) in fa for lay, h in zip(d["layer"], d["head"])], index=d.index)
    key = d["ie_recv_niah_multikey"].where(~is_fa, float("-inf"))
    d["rank"] = key.rank(ascending=False, method="first").astype(int)
    d.to_csv(out / "scores.csv", index=False)
    return d


def main(out: Path) -> None:
    py = sys.executable
    fused = out / "fused4"
    if not (fused / "ranking.json").exists():
        tasks = [a for t in TASKS for a in ("--task", t)]
        subprocess.run([py, "-m", "headscope.cli", "rank", "--model", "smollm2-135m", *tasks, "--pairs", "6",
                        "--seq-len", "512", "--budget", "7:1", "--min-per-layer", "1", "--device", "cpu",
                        "--out", str(fused)], check=True)
    fa = set(HeadMask.from_json(MASK).heads())
    d = gdn_left(fused, out / "gdn_left", fa)
    pos = d["ie_recv_niah_multikey"].clip(lower=0)
    on_fa = sum(p for p, lay, h in zip(pos, d["layer"], d["head"]) if (lay, h) in fa)
    print(f"positive multi-key receiver IE on hydra-7to1's FA heads: {on_fa / pos.sum():.2f}")
    runs = {"fused4": (fused, "5,10,20,34", "top,random"), "gdn_left": (out / "gdn_left", "5,10,20", "top")}
    for name, (ranking, ks, sets) in runs.items():
        subprocess.run([py, str(HERE.parent / "knockout.py"), "--out", str(out / f"ko_{name}"), "--model",
                        "smollm2-135m", "--device", "cpu", "--ranking", str(ranking), "--tasks", "niah_multikey",
                        "--lengths", "1024", "--n-prompts", "50", "--ks", ks, "--sets", sets, "--random-seeds", "3",
                        "--methods", "mean", "--batch-size", "8"], check=True)
        table = json.loads((out / f"ko_{name}" / "results.json").read_text())["summary"]["table"]
        print(name, pd.DataFrame(table)[["k", "baseline", "top", "random_mean", "random_sd"]].to_string(index=False))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1].strip())
    main(Path(sys.argv[1]))
