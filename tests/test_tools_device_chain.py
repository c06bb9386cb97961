"""tools/device/chain.sh on the CPU (slow tier: tools outside the package): the detached chain runs its commands in
order, retries a failing one, waits for a file and stops where a command or a wait fails; poll returns OUT_DIR as
gzip tar parts without weights or checkpoints, and the Triton autotune results; caches returns the compile caches
in parts that a later start restores byte for byte."""
import io
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="bash script")]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "device" / "chain.sh"


def _env(tmp_path: Path, **extra: str) -> dict:
    return {**os.environ, "OUT_DIR": str(tmp_path / "out"), "SESSION_DIR": str(tmp_path / "sd"),
            "CODE_DIR": str(tmp_path / "code"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
            "COMPILE_CACHE": str(tmp_path / "no_cc"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "CHAIN_POLL_S": "1", "CHAIN_RETRY_S": "0", **extra}  # a waited file is looked for every second, no retry pause


def _wait_done(sd: Path, n: int = 1) -> list[str]:
    status = sd / "status"
    for _ in range(120):
        if status.exists() and status.read_text().count("chain done") >= n:
            break
        time.sleep(0.5)
    return [line.split(": ", 1)[1] for line in status.read_text().splitlines()]


def _wait_exit(sd: Path) -> None:
    pid = int((sd / "chain.pid").read_text())
    for _ in range(100):  # the chain exits just after writing "chain done"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def test_chain_retries_waits_stops_and_poll_returns_out_without_weights(tmp_path):
    calls = tmp_path / "calls.txt"
    out = tmp_path / "out"
    flaky = f"echo flaky >> {calls}; [ -f {tmp_path}/once ] || {{ touch {tmp_path}/once; exit 1; }}"
    write = (f"echo write >> {calls}; mkdir -p $OUT_DIR/m/stage1/checkpoint && echo 1 > $OUT_DIR/retention.csv && "
             "printf w > $OUT_DIR/m/model.safetensors && printf c > $OUT_DIR/m/stage1/checkpoint/opt.pt && "
             "echo '{}' > $OUT_DIR/m/record.json && pwd > $OUT_DIR/where.txt")
    # a carried autotune result is restored into the Triton cache before the commands run
    (tmp_path / "kc_src" / "abc123").mkdir(parents=True)
    (tmp_path / "kc_src" / "abc123" / "chunk_fwd_kernel.autotune.json").write_text("{}")
    subprocess.run(["tar", "-czf", str(tmp_path / "kc.tar.gz"), "-C", str(tmp_path / "kc_src"), "abc123"], check=True)
    env = _env(tmp_path, KERNEL_CACHE=str(tmp_path / "kc.tar.gz"), TRIES="2")
    cmds = [f"echo a >> {calls}", flaky, f"wait {tmp_path / 'go'}", write, f"echo bad >> {calls}; exit 3", f"echo never >> {calls}"]
    r = subprocess.run(["bash", str(SCRIPT), "start", *cmds], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "started 6 command(s)" in r.stdout and "autotune results restored: 1 kernel(s)" in r.stdout
    # a second start while the first runs (it waits for "go") is refused: it would delete the code the commands run from
    again = subprocess.run(["bash", str(SCRIPT), "start", "true"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 1 and "still running" in again.stderr
    (tmp_path / "triton" / "def456").mkdir(parents=True)  # a kernel tuned during the chain, beside its binary
    (tmp_path / "triton" / "def456" / "o_kernel.autotune.json").write_text("{}")
    (tmp_path / "triton" / "def456" / "o_kernel.cubin").write_bytes(b"\0" * 1000)
    (tmp_path / "go").touch()
    status = _wait_done(tmp_path / "sd")
    assert status == [f"echo a >> {calls}: rc=0 (try 1)", f"{flaky}: rc=1 (try 1)", f"{flaky}: rc=0 (try 2)",
                      f"wait {tmp_path / 'go'}: here", f"{write}: rc=0 (try 1)",
                      f"echo bad >> {calls}; exit 3: rc=3 (try 1)", f"echo bad >> {calls}; exit 3: rc=3 (try 2)",
                      f"chain stopped: echo bad >> {calls}; exit 3 did not finish; later commands not run", "chain done"]
    assert calls.read_text().split() == ["a", "flaky", "flaky", "write", "bad", "bad"]
    assert (out / "where.txt").read_text().strip() == str(tmp_path / "code")  # run from the private copy
    assert (tmp_path / "code" / "headscope" / "__init__.py").exists() and (tmp_path / "code" / "tools" / "device").is_dir()
    ret = tmp_path / "ret"
    r = subprocess.run(["bash", str(SCRIPT), "poll", str(ret), "10"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "chain done" in r.stdout and "OUT_DIR packed: 1 part(s)" in r.stdout
    data = b"".join(p.read_bytes() for p in sorted(ret.glob("out.tar.gz.part*")))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
        names = sorted(m.name.removeprefix("./") for m in t.getmembers() if m.isfile())
        assert t.extractfile("./retention.csv").read() == b"1\n"
    assert names == ["m/record.json", "retention.csv", "where.txt"]  # no weights, no checkpoint
    assert (ret / "status").read_text().endswith("chain done\n")
    listed = subprocess.run(["tar", "-tzf", str(ret / "autotune.tar.gz")], capture_output=True, text=True, check=True)
    assert sorted(listed.stdout.split()) == ["./abc123/chunk_fwd_kernel.autotune.json", "./def456/o_kernel.autotune.json"]


def test_chain_wait_that_times_out_stops_the_chain_and_two_chains_run_side_by_side(tmp_path):
    calls = tmp_path / "calls.txt"
    missing = tmp_path / "never_written"
    a = _env(tmp_path, CHAIN_WAIT_S="2")
    b = _env(tmp_path, SESSION_DIR=str(tmp_path / "sd2"), CODE_DIR=str(tmp_path / "code2"))
    r1 = subprocess.run(["bash", str(SCRIPT), "start", f"echo a >> {calls}", f"wait {missing}", f"echo b >> {calls}"],
                        env=a, capture_output=True, text=True, cwd=ROOT)
    r2 = subprocess.run(["bash", str(SCRIPT), "start", f"echo c >> {calls}"], env=b, capture_output=True, text=True, cwd=ROOT)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert _wait_done(tmp_path / "sd") == [f"echo a >> {calls}: rc=0 (try 1)", f"wait {missing}: not here after 2 s",
                                           f"chain stopped: {missing} did not come; later commands not run", "chain done"]
    assert _wait_done(tmp_path / "sd2") == [f"echo c >> {calls}: rc=0 (try 1)", "chain done"]
    assert sorted(calls.read_text().split()) == ["a", "c"]


def test_caches_return_in_parts_and_start_restores_them(tmp_path):
    """`caches` packs the TileLang, Inductor and Triton caches into <= 15 MiB parts, leaving out what would pass
    MAX_MIB; `start` on a fresh machine restores them byte for byte and refuses a changed part."""
    m = tmp_path / "m1"
    env = _env(tmp_path, TRITON_CACHE_DIR=str(m / "triton"), TORCHINDUCTOR_CACHE_DIR=str(m / "inductor"),
               TILELANG_CACHE_DIR=str(m / "tilelang"))
    rng = random.Random(0)
    files = {"tilelang/k/kernel.so": rng.randbytes(1000), "inductor/fxgraph/ab/graph": rng.randbytes(20 * 2**20),  # 2 parts
             "inductor/triton/0/x.cubin": b"cubin", "triton/big/blob.bin": rng.randbytes(30 * 2**20)}
    for rel, data in files.items():
        (m / rel).parent.mkdir(parents=True, exist_ok=True)
        (m / rel).write_bytes(data)
    ret = tmp_path / "ret"
    r = subprocess.run(["bash", str(SCRIPT), "caches", str(ret), "40"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "returned the tilelang cache" in r.stdout and "returned the inductor cache: 20 MiB" in r.stdout
    assert "left out the triton cache: 30 MiB" in r.stdout  # 20 + 30 would pass 40
    parts = sorted(f.name for f in (ret / "compile_cache").iterdir())
    assert parts == ["inductor.tar.gz.part00", "inductor.tar.gz.part01", "manifest.txt", "tilelang.tar.gz.part00"]
    assert all(f.stat().st_size <= 15 * 2**20 for f in (ret / "compile_cache").iterdir())
    cc = tmp_path / "cc"
    subprocess.run(["cp", "-r", str(ret / "compile_cache"), str(cc)], check=True)
    for d in ("tilelang", "inductor", "triton"):
        subprocess.run(["rm", "-rf", str(m / d)], check=True)
    r = subprocess.run(["bash", str(SCRIPT), "start", "true"], env={**env, "COMPILE_CACHE": str(cc)},
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "compile cache restored: tilelang" in r.stdout and "compile cache restored: inductor" in r.stdout
    for rel in ("tilelang/k/kernel.so", "inductor/fxgraph/ab/graph", "inductor/triton/0/x.cubin"):
        assert (m / rel).read_bytes() == files[rel]
    _wait_done(tmp_path / "sd")
    _wait_exit(tmp_path / "sd")
    (cc / "tilelang.tar.gz.part00").write_bytes(b"changed")
    subprocess.run(["rm", "-rf", str(m / "tilelang")], check=True)
    r = subprocess.run(["bash", str(SCRIPT), "start", "true"], env={**env, "COMPILE_CACHE": str(cc)},
                       capture_output=True, text=True, cwd=ROOT)
    assert "compile cache tilelang NOT restored" in r.stdout and not (m / "tilelang" / "k").exists()
    _wait_done(tmp_path / "sd", 2)
