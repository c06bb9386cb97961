import json

from typer.testing import CliRunner

from headscope.cli import app


def test_cli_fused_rank(smol_tokenizer, tmp_path):
    from conftest import tiny_llama

    d = tmp_path / "tiny"
    tiny_llama(smol_tokenizer).save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    out = tmp_path / "out"
    args = ["rank", "--model", str(d), "--task", "niah_single", "--task", "niah_multikey", "--senders",
            "--budget", "3:1", "--pairs", "1", "--seq-len", "128", "--top-k", "2", "--min-gap", "0",
            "--device", "cpu", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "fused score S" in res.output and "s_niah_multikey" in res.output
    header = next(line for line in res.output.splitlines() if line.split()[:2] == ["rank", "layer"])
    assert "ie_send" in header.split()
    mask = json.loads((out / "mask.json").read_text())
    assert mask["summary"]["n_fa"] == 2 and all(len(v) >= 1 for v in mask["fa_heads"].values())
    assert mask["meta"]["tasks"] == ["niah_single", "niah_multikey"]
    bad = CliRunner().invoke(app, args[:-2] + ["--out", str(tmp_path / "o2"), "--weight", "0.7", "--weight", "0.7"])
    assert bad.exit_code == 2 and "sum to" in bad.output


def test_cli_fused_rank_without_senders_prints_no_sender_column(smol_tokenizer, tmp_path):
    from conftest import tiny_llama

    d = tmp_path / "tiny"
    tiny_llama(smol_tokenizer).save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    args = ["rank", "--model", str(d), "--task", "niah_single", "--task", "niah_multikey", "--budget", "3:1",
            "--pairs", "1", "--seq-len", "128", "--min-gap", "0", "--device", "cpu", "--out", str(tmp_path / "out")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines() if line.split()[:2] == ["rank", "layer"])
    assert "ie_send" not in header.split() and "kappa" in header.split() and "s_niah_multikey" in header.split()
