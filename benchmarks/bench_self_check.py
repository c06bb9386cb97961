"""What the engine's longer self-check costs: one ranking of SmolLM2-135M on ``niah_single`` pairs of 512 tokens
with the checks on (the default: the model's own forward on the first prompt of each new length, and one patched
row against a hooked forward) or off (``engine.checks.enabled = False`` after the build-time check), in separate
processes. ``bench_patching.py`` reports the checks' share of a screen in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_self_check.py on 1
    PYTHONPATH=. .venv/bin/python benchmarks/bench_self_check.py off 1

Run the two arms interleaved, several times each, on a quiet machine and compare the minima; the checks run once per
prompt length, so a ranking of N pairs of one length pays them once. Prints one line per run.
"""

from __future__ import annotations

import sys
import time

from headscope.models import load_model
from headscope.patching.engine import Engine
from headscope.patching.receivers import receiver_patching
from headscope.tasks import make_pairs


def main(arm: str, n_pairs: int) -> None:
    if arm not in ("on", "off"):
        raise SystemExit("usage: bench_self_check.py on|off N_PAIRS")
    if arm == "off":
        init = Engine.__init__

        def no_check(self, *a, **k):
            init(self, *a, **k)
            self.checks.enabled = False

        Engine.__init__ = no_check
    s0 = time.perf_counter()
    m = load_model("smollm2-135m")
    pairs = make_pairs("niah_single", m.tokenizer, n_pairs=n_pairs, seq_len=512, depth=0.5, seed=0)
    s = time.perf_counter()
    receiver_patching(m, pairs, progress=False)
    t = time.perf_counter() - s
    print(f"checks {arm}: pairs {n_pairs}, load {s - s0:.1f} s, ranking {t:.1f} s, total {time.perf_counter() - s0:.1f} s",
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "on", int(sys.argv[2]) if len(sys.argv) > 2 else 1)
