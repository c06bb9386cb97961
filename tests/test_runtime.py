"""The runtime module: lazy imports, atomic writes, the scheduling of a sweep (issue 18)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from headscope.patching.schedule import Item, Schedule, heads_by_layer
from headscope.patching.store import Store
from headscope.runtime import atomic_torch_save, atomic_write_text, same_device


@pytest.mark.slow
def test_import_headscope_loads_no_training_distributed_or_hybrid_code():
    code = ("import sys, headscope; bad = [m for m in sys.modules if m.startswith(('torch', 'transformers', "
            "'headscope.train', 'headscope.hybrid', 'headscope.distributed'))]; print(len(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
    code = "import sys, headscope; headscope.rank; print('torch.distributed.fsdp' in sys.modules and 'headscope.train' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_lazy_names_resolve():
    import headscope

    assert headscope.Readout().lam == 0.9
    assert headscope.RankConfig().n_pairs == 6
    assert headscope.train.Trainer.__name__ == "Trainer"
    assert "rank" in dir(headscope)


def test_atomic_writes(tmp_path):
    atomic_write_text(tmp_path / "a" / "x.txt", "hello")
    assert (tmp_path / "a" / "x.txt").read_text() == "hello"
    atomic_torch_save(tmp_path / "t.pt", torch.arange(3))
    assert torch.equal(torch.load(tmp_path / "t.pt"), torch.arange(3))
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["x.txt"]  # no temporary file left
    assert same_device("cpu", torch.device("cpu")) and not same_device("cpu", "meta")


def test_schedule_shards_resumes_and_records(tmp_path):
    heads = heads_by_layer(2, 3, [(0, 0), (0, 2), (1, 1)])
    assert heads == {0: [0, 2], 1: [1]}
    store = Store(tmp_path, {"k": 1}, name="receivers")
    store.put(Item(0, 0).key, {0: 0.5})  # a partly finished item from an earlier run
    s = Schedule(2, heads, store, shard=(0, 2))
    s.load_bases(lambda i: {"m_clean": float(i), "m_corrupt": -1.0})
    assert sorted(s.bases) == [0] and store.has("pair00000_base") and not store.has("pair00001_base")
    work = s.pending()
    # items in pair-major order: (0,L0) idx 0 mine, (0,L1) idx 1 not, (1,L0) idx 2 mine, (1,L1) idx 3 not
    assert work == {0: [(0, 2)], 1: [(0, 0), (0, 2)]}
    s.record(0, 0, 2, 0.25)
    assert store.get("pair00000_L000") == {0: 0.5, 2: 0.25}
    s.record(1, 0, 0, 1.0)
    assert not store.has("pair00001_L000")  # stored only once the item is complete
    s.record(1, 0, 2, 2.0)
    assert store.get("pair00001_L000") == {0: 1.0, 2: 2.0}
    s.close()


def test_schedule_bar_leaves_the_base_passes_out_of_its_rate():
    """The bar's clock starts again after the pairs' base passes (0.3 s here): elapsed time and rate count patches."""
    import time

    s = Schedule(2, {0: [0, 1]}, progress=True)
    s.load_bases(lambda i: (time.sleep(0.15), {"m_clean": 1.0, "m_corrupt": 0.0})[1])
    assert time.time() - s.bar.start_t < 0.1  # without: >= 0.3
    s.close()


def test_config_diff_names_nested_settings():
    from headscope.runtime import config_diff

    old = {"lam": 0.9, "settings": {"seq_len": 512, "seed": 0}, "kind": "receivers"}
    new = {"lam": 0.5, "settings": {"seq_len": 256, "seed": 0}, "kind": "receivers"}
    assert config_diff(old, new) == ["lam", "settings.seq_len: 512 stored, 256 now"]
    assert config_diff(old, old) == []
    assert config_diff(old, new, keys=["kind"]) == []
