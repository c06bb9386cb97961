"""Unablated greedy accuracy of gemma3-270m (20 prompts per task and length, seed 100) and the fast engine self-check.

    python experiments/knockout-gemma3-270m/accuracy.py niah_single 256,512   # log: accuracy.log
"""
import json, sys, time
import torch
import headscope
from headscope.analysis.knockout import retrieval_correct, generate_answers
from headscope.tasks import make_pairs
torch.set_num_threads(2)
t0 = time.time()
lm = headscope.load_model("gemma3-270m", device="cpu")
print(f"loaded in {time.time()-t0:.0f}s", lm.geometry, flush=True)
from headscope.patching.engine import Engine
t = time.time(); Engine(lm); print(f"engine self-check passed ({time.time()-t:.1f}s)", flush=True)
res = {}
for task, L in [(a, b) for a in sys.argv[1].split(",") for b in map(int, sys.argv[2].split(","))]:
    pairs = make_pairs(task, lm.tokenizer, n_pairs=20, seq_len=L, depth=[0.1, 0.3, 0.5, 0.7, 0.9], seed=100)
    t = time.time()
    c = retrieval_correct(lm, pairs, batch_size=4).tolist()
    gen = generate_answers(lm, pairs[:3])
    agree = [bool(torch.equal(g, p.answer)) == c[i] for i, (g, p) in enumerate(zip(gen, pairs[:3]))]
    res[f"{task}/{L}"] = sum(c) / len(c)
    print(f"{task} L={L}: accuracy {sum(c)}/{len(c)}; generate agrees with teacher-forced on 3: {agree}; "
          f"example answer {lm.tokenizer.decode(pairs[0].answer)!r} -> generated {lm.tokenizer.decode(gen[0])!r} "
          f"({time.time()-t:.0f}s)", flush=True)
print(json.dumps(res))
