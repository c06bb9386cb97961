"""Two gloo processes produce exactly the single-process table (CPU)."""

import pandas as pd
import pytest
import torch

import headscope
from headscope.distributed import spawn_rank


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tiny_dir, tmp_path):
    settings = dict(model=str(tiny_dir), tasks=("niah_single",), n_pairs=3, seq_len=64, seed=2, min_gap=0.0)
    torch.set_num_threads(1)  # the same intra-op threading as each rank, for bitwise-equal float sums
    try:
        single = headscope.rank(out_dir=tmp_path / "one", device="cpu", progress=False, **settings)
    finally:
        torch.set_num_threads(2)
    merged = spawn_rank(2, tmp_path / "two", device="cpu", **settings)
    cols = ["layer", "head", "kv_group", "ie_recv", "ie_recv_std", "score", "rank"]
    pd.testing.assert_frame_equal(single.scores[cols], merged.scores[cols], check_exact=True)
    # both ranks wrote items: 3 pairs x (base + 2 layers) = 9 items
    items = sorted(p.name for p in (tmp_path / "two" / "receivers").glob("pair*.json"))
    assert len(items) == 9


def test_shards_split_the_items(tiny, smol_tokenizer, tmp_path):
    import pytest

    from headscope.patching import receiver_patching
    from headscope.tasks import niah_single

    pairs = niah_single(smol_tokenizer, n_pairs=2, seq_len=64, seed=3)
    store = str(tmp_path / "s")
    # rank 1 of 2 alone: computes items 1 and 3 of (pair, layer) = (0,0),(0,1),(1,0),(1,1) and pair 1's
    # base, then cannot merge because rank 0's items are missing
    with pytest.raises(FileNotFoundError):
        receiver_patching(tiny, pairs, min_gap=0.0, progress=False, store_dir=store, shard=(1, 2))
    have = sorted(p.stem for p in (tmp_path / "s" / "receivers").glob("pair*.json"))
    assert have == ["pair00000_L001", "pair00001_L001", "pair00001_base"]
    merged = receiver_patching(tiny, pairs, min_gap=0.0, progress=False, store_dir=store, shard=(0, 2))
    single = receiver_patching(tiny, pairs, min_gap=0.0, progress=False)
    assert torch.equal(merged.patched, single.patched)
    with pytest.raises(ValueError, match="store_dir shared by all ranks"):
        receiver_patching(tiny, pairs, shard=(0, 2))


@pytest.mark.slow
def test_cli_devices_two_runs_the_config_on_two_ranks(tiny_dir, tmp_path):
    """`headscope rank --devices 2` hands its RankConfig to both ranks (runtime.launch): the saved ranking
    has the CLI's settings, its whole config, and the single-process numbers (to float rounding)."""
    from typer.testing import CliRunner

    from headscope.cli import app
    from headscope.rank_config import RankConfig

    res = CliRunner().invoke(app, ["rank", "--model", str(tiny_dir), "--pairs", "2", "--seq-len", "64", "--seed", "2",
                                   "--min-gap", "0", "--lambda", "0.8", "--budget", "2", "--devices", "2",
                                   "--device", "cpu", "--out", str(tmp_path / "two")])
    assert res.exit_code == 0, (res.output, res.exception)
    two = headscope.Ranking.load(tmp_path / "two")
    cfg = RankConfig.from_dict(two.provenance["config"])
    assert (cfg.n_pairs, cfg.seq_len, cfg.seed, cfg.readout.lam, cfg.readout.min_gap) == (2, 64, 2, 0.8, 0.0)
    one = headscope.rank(str(tiny_dir), n_pairs=2, seq_len=64, seed=2, min_gap=0.0, lam=0.8, device="cpu",
                         progress=False)
    assert torch.allclose(one.ie, two.ie, atol=1e-5, rtol=0)
