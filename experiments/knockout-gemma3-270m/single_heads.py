"""Which single heads of the harmful random draws break retrieval? (gemma3-270m, niah_single, 256 tokens)

Zero-ablates each head of the random K=5 draws random0 and random2 of results.json alone, and
mean-ablates each head of random0 alone, on the first 20 of the 40 evaluation prompts (seed 1000)
with the mean reference (seed 2000, 8 prompts) of experiments/knockout.py; writes
single_heads.json beside this file.

    python experiments/knockout-gemma3-270m/single_heads.py   # ~10 min on this CPU
"""
import json
import time
from pathlib import Path

import headscope
from headscope.analysis.knockout import ablate, mean_reference, retrieval_correct
from headscope.tasks import make_pairs

here = Path(__file__).resolve().parent
res = json.loads((here / "results.json").read_text())
heads = sorted({tuple(h) for key in ("random0", "random2")
                for h in res["results"][f"niah_single/256/zero/5/{key}"]["heads"]})
ev, dep = res["evaluation"], res["evaluation"]["depths"]
lm = headscope.load_model("gemma3-270m", device="cpu")
pairs = make_pairs("niah_single", lm.tokenizer, n_pairs=ev["n_prompts"], seq_len=256, depth=dep, seed=ev["seed"])[:20]
refs = make_pairs("niah_single", lm.tokenizer, n_pairs=ev["n_ref"], seq_len=256, depth=dep, seed=ev["mean_reference_seed"])
mref = mean_reference(lm, refs, range(lm.geometry.n_layers))
out = {"heads": [list(h) for h in heads], "n_prompts": len(pairs), "length": 256, "results": {}}
random0 = {tuple(h) for h in res["results"]["niah_single/256/zero/5/random0"]["heads"]}
for method in ("zero", "mean"):
    for h in heads if method == "zero" else sorted(random0):
        t = time.time()
        with ablate(lm, [h], method, reference=mref if method == "mean" else None):
            c = retrieval_correct(lm, pairs, batch_size=8).tolist()
        out["results"][f"{method}/L{h[0]}H{h[1]}"] = sum(c) / len(c)
        print(f"{method} L{h[0]}H{h[1]}: acc={sum(c) / len(c):.3f} ({time.time() - t:.0f}s)", flush=True)
        (here / "single_heads.json").write_text(json.dumps(out, indent=1))
