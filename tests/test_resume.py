"""A sweep killed with SIGKILL midway resumes from its store and recomputes only what is missing."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import headscope.patching.receivers as receivers
from headscope.models import load_model
from headscope.patching import receiver_patching
from headscope.tasks import niah_single

CHILD = textwrap.dedent(
    """
    import sys, time
    import headscope.patching.store as store
    from headscope.models import load_model
    from headscope.patching import receiver_patching
    from headscope.tasks import niah_single

    put = store.Store.put
    def slow_put(self, key, value):  # the test slows the sweep down so that it can kill it midway
        put(self, key, value)
        time.sleep(0.3)
    store.Store.put = slow_put
    model = load_model(sys.argv[1], device="cpu")
    pairs = niah_single(model.tokenizer, n_pairs=3, seq_len=64, depth=[0.2, 0.6, 0.9], seed=11)
    receiver_patching(model, pairs, min_gap=0.0, progress=False, store_dir=sys.argv[2])
    """
)


@pytest.mark.slow
def test_sigkill_then_resume(tiny_dir, tmp_path):
    model_dir = tiny_dir
    store_dir = tmp_path / "run"
    items = store_dir / "receivers"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(store_dir)])
    deadline = time.time() + 300
    while time.time() < deadline and len(list(items.glob("pair*.json"))) < 4:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stored = {p.stem for p in items.glob("pair*.json")}
    assert 4 <= len(stored) < 9  # 3 pairs x (base + 2 layers) = 9 items when complete

    model = load_model(str(model_dir), device="cpu")
    pairs = niah_single(model.tokenizer, n_pairs=3, seq_len=64, depth=[0.2, 0.6, 0.9], seed=11)
    calls = []
    orig = receivers.patch_rows
    heads_done = []

    def counting(engine, st, rows, lam, bs):
        heads_done.extend((st.pair.meta["index"], layer, h) for layer, h in rows)
        calls.extend(sorted({(st.pair.meta["index"], layer) for layer, _ in rows}))
        return orig(engine, st, rows, lam, bs)

    receivers.patch_rows = counting
    try:
        resumed = receiver_patching(model, pairs, min_gap=0.0, progress=False, store_dir=str(store_dir))
    finally:
        receivers.patch_rows = orig
    assert len(heads_done) == len(set(heads_done))  # no head computed twice
    missing = {(i, layer) for i in range(3) for layer in range(2)} - {
        (int(k[4:9]), int(k[-3:])) for k in stored if "_L" in k
    }
    assert set(calls) == missing and len(calls) == len(missing)
    fresh = receiver_patching(model, pairs, min_gap=0.0, progress=False)
    assert torch.equal(resumed.patched, fresh.patched)
    assert torch.equal(resumed.m_clean, fresh.m_clean)
