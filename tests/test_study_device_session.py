"""experiments/conversion-generalization/device_session.sh on the CPU: the detached chain runs the pieces in order,
retries a failing one, waits for a file, and poll packs OUT's state without the documents and the suite."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "conversion-generalization" / "device_session.sh"


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_device_session_chain_retries_waits_and_packs(tmp_path):
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake_run.sh"  # stands in for run.py: records its arguments; "flaky" fails on its first try
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
if [ "$2" = flaky ] && [ ! -f {tmp_path}/flaky_once ]; then touch {tmp_path}/flaky_once; exit 1; fi
exit 0
""")
    fake.chmod(0o755)
    env = {**os.environ, "OUT_DIR": str(tmp_path / "out"), "SESSION_DIR": str(tmp_path / "sd"),
           "CODE_DIR": str(tmp_path / "code"), "RUN": str(fake), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "KERNEL_CACHE": str(tmp_path / "kc.tar.gz"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    # a carried autotune result is restored into the Triton cache before the pieces run
    src = tmp_path / "kc_src" / "abc123"
    src.mkdir(parents=True)
    (src / "chunk_fwd_kernel.autotune.json").write_text('{"key": [64], "configs_timings": []}')
    subprocess.run(["tar", "-czf", str(tmp_path / "kc.tar.gz"), "-C", str(tmp_path / "kc_src"), "abc123"], check=True)
    pieces = ["--piece a", "--piece flaky", f"wait {tmp_path / 'go'}", "--piece b"]
    r = subprocess.run(["bash", str(SCRIPT), "start", *pieces], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "started 4 piece(s)" in r.stdout and "autotune results restored: 1 kernel(s)" in r.stdout
    # a second start while the first runs (it waits for "go") is refused: it would delete the code the pieces import
    again = subprocess.run(["bash", str(SCRIPT), "start", "--piece c"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 1 and "still running" in again.stderr
    (tmp_path / "go").touch()
    assert (tmp_path / "triton" / "abc123" / "chunk_fwd_kernel.autotune.json").exists()
    (tmp_path / "triton" / "def456").mkdir()  # a kernel tuned during the session, with its compiled binary
    (tmp_path / "triton" / "def456" / "o_kernel.autotune.json").write_text("{}")
    (tmp_path / "triton" / "def456" / "o_kernel.cubin").write_bytes(b"\0" * 1000)
    status_file = tmp_path / "sd" / "status"
    for _ in range(60):
        if status_file.exists() and "session done" in status_file.read_text():
            break
        time.sleep(0.5)
    status = [line.split(": ", 1)[1] for line in (tmp_path / "sd" / "status").read_text().splitlines()]
    assert status == ["--piece a: rc=0 (try 1)", "--piece flaky: rc=1 (try 1)", "--piece flaky: rc=0 (try 2)",
                      f"wait {tmp_path / 'go'}: here", "--piece b: rc=0 (try 1)", "session done"]
    assert calls.read_text().splitlines() == ["--piece a", "--piece flaky", "--piece flaky", "--piece b"]
    # the committed state was restored into OUT and the code copied; poll packs OUT without shards and suite
    committed = ROOT / "experiments" / "conversion-generalization" / "state"
    assert json.loads((tmp_path / "out" / "settings.json").read_text()) == json.loads((committed / "settings.json").read_text())
    assert (tmp_path / "code" / "headscope" / "__init__.py").exists()
    ret = tmp_path / "ret"
    r = subprocess.run(["bash", str(SCRIPT), "poll", str(ret), "10"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "session done" in r.stdout and "pack: packed" in r.stdout
    manifest = json.loads((ret / "state" / "state.manifest.json").read_text())
    paths = {f["path"] for f in manifest["files"]}
    n_cells = sum(1 for _ in committed.glob("cells/*/*.json"))
    assert sum(p.startswith("cells/") for p in paths) == n_cells > 0
    assert not any(p.startswith("suite/") or "/shards/" in p for p in paths)
    assert (ret / "status").read_text().endswith("session done\n")
    # poll returns the tuning results, not the binaries
    listed = subprocess.run(["tar", "-tzf", str(ret / "autotune.tar.gz")], capture_output=True, text=True, check=True)
    assert sorted(listed.stdout.split()) == ["./abc123/chunk_fwd_kernel.autotune.json", "./def456/o_kernel.autotune.json"]
    assert "autotune results: 2 kernel(s)" in r.stdout


def _wait_done(status_file: Path, n: int = 1) -> list[str]:
    for _ in range(120):
        if status_file.exists() and status_file.read_text().count("session done") >= n:
            break
        time.sleep(0.5)
    return [line.split(": ", 1)[1] for line in status_file.read_text().splitlines()]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_device_session_resumes_partial_stops_at_failure_and_restores_once(tmp_path):
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake_run.sh"  # "slow" ends partial twice (its deadline), then finishes; "bad" always fails
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
if [ "$2" = slow ]; then
  n=$(grep -c slow {calls})
  if [ "$n" -lt 3 ]; then echo "train: partial: stage 3 at step $n/458; rerun the same command (603 s)"; exit 0; fi
  echo "train: trained (5 s)"; exit 0
fi
if [ "$2" = bad ]; then echo "arm is not trained: run --piece train" >&2; exit 1; fi
echo "$2: done"
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT_DIR": str(out), "SESSION_DIR": str(tmp_path / "sd"), "CODE_DIR": str(tmp_path / "code"),
           "RUN": str(fake), "TRITON_CACHE_DIR": str(tmp_path / "triton"), "KERNEL_CACHE": str(tmp_path / "none.tar.gz"),
           "TRIES": "2", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(SCRIPT), "start", "--piece slow", "--piece bad", "--piece never"], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "committed state restored" in r.stdout
    status = _wait_done(tmp_path / "sd" / "status")
    assert status == ["--piece slow: partial (resume 1)", "--piece slow: partial (resume 2)", "--piece slow: rc=0 (try 1)",
                      "--piece bad: rc=1 (try 1)", "--piece bad: rc=1 (try 2)",
                      "chain stopped: --piece bad did not finish; later pieces not run", "session done"]
    assert calls.read_text().splitlines() == ["--piece slow"] * 3 + ["--piece bad"] * 2  # "never" did not run
    # what a piece moved away (--retrain moves an arm's records) is not brought back by a second start
    committed_cells = sorted((out / "cells").glob("*/*.json"))
    assert committed_cells
    moved = committed_cells[0]
    moved.unlink()
    pid = int((tmp_path / "sd" / "chain.pid").read_text())
    for _ in range(100):  # the chain exits just after writing "session done"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    r = subprocess.run(["bash", str(SCRIPT), "start", "--piece c"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "not restored again" in r.stdout and "committed state restored" not in r.stdout
    status = _wait_done(tmp_path / "sd" / "status", 2)
    assert status[-2:] == ["--piece c: rc=0 (try 1)", "session done"]
    assert not moved.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_device_session_returns_and_restores_compile_caches(tmp_path):
    """`caches` packs the TileLang, Inductor and Triton caches into <= 15 MiB parts, smallest first, leaving out what
    would pass MAX_MIB; `start` on a fresh machine restores them byte for byte (and refuses changed parts)."""
    import random

    env = {**os.environ, "SESSION_DIR": str(tmp_path / "sd"), "CODE_DIR": str(tmp_path / "code"), "OUT_DIR": str(tmp_path / "out"),
           "RUN": "true", "KERNEL_CACHE": str(tmp_path / "none"), "TRITON_CACHE_DIR": str(tmp_path / "m1" / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "m1" / "inductor"), "TILELANG_CACHE_DIR": str(tmp_path / "m1" / "tilelang"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    rng = random.Random(0)
    files = {"tilelang/k/kernel.so": rng.randbytes(1000), "inductor/fxgraph/ab/graph": rng.randbytes(20 * 2**20),  # 2 parts
             "inductor/triton/0/x.cubin": b"cubin", "triton/abc/chunk.autotune.json": b"{}",
             "triton/big/blob.bin": rng.randbytes(30 * 2**20)}
    for rel, data in files.items():
        f = tmp_path / "m1" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    ret = tmp_path / "ret"
    r = subprocess.run(["bash", str(SCRIPT), "caches", str(ret), "40"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "returned the tilelang cache" in r.stdout and "returned the inductor cache: 20 MiB" in r.stdout
    assert "left out the triton cache: 30 MiB" in r.stdout  # 20 + 30 would pass 40
    parts = sorted(f.name for f in (ret / "compile_cache").iterdir())
    assert parts == ["inductor.tar.gz.part00", "inductor.tar.gz.part01", "manifest.txt", "tilelang.tar.gz.part00"]
    assert all(f.stat().st_size <= 15 * 2**20 for f in (ret / "compile_cache").iterdir())
    # the next machine: the caches' directories are empty; start restores what came back
    cc = tmp_path / "runs_state_compile_cache"
    subprocess.run(["cp", "-r", str(ret / "compile_cache"), str(cc)], check=True)
    for d in ("tilelang", "inductor", "triton"):
        subprocess.run(["rm", "-rf", str(tmp_path / "m1" / d)], check=True)
    r = subprocess.run(["bash", str(SCRIPT), "start", "--piece a"], env={**env, "COMPILE_CACHE": str(cc)},
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "compile cache restored: tilelang" in r.stdout and "compile cache restored: inductor" in r.stdout
    for rel in ("tilelang/k/kernel.so", "inductor/fxgraph/ab/graph", "inductor/triton/0/x.cubin"):
        assert (tmp_path / "m1" / rel).read_bytes() == files[rel]
    assert not (tmp_path / "m1" / "triton").exists()
    _wait_done(tmp_path / "sd" / "status")
    # a changed part is refused, not unpacked
    (cc / "tilelang.tar.gz.part00").write_bytes(b"changed")
    subprocess.run(["rm", "-rf", str(tmp_path / "m1" / "tilelang")], check=True)
    pid = int((tmp_path / "sd" / "chain.pid").read_text())
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    r = subprocess.run(["bash", str(SCRIPT), "start", "--piece a"], env={**env, "COMPILE_CACHE": str(cc)},
                       capture_output=True, text=True, cwd=ROOT)
    assert "compile cache tilelang NOT restored" in r.stdout and not (tmp_path / "m1" / "tilelang" / "k").exists()


def test_device_session_caches_keep_to_the_files_a_call_returns(tmp_path):
    """The device tool returns at most 8 files a call: after poll's 5 (state part and manifest, autotune, log,
    status), `caches` adds the manifest and the 1-part TileLang cache (7 files) and leaves out the 2-part Inductor
    cache (9), saying why, although it is under MAX_MIB."""
    import random

    rng = random.Random(1)
    env = {**os.environ, "SESSION_DIR": str(tmp_path / "sd"), "TRITON_CACHE_DIR": str(tmp_path / "none"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "m" / "inductor"), "TILELANG_CACHE_DIR": str(tmp_path / "m" / "tilelang")}
    for rel, n in (("tilelang/k.so", 1000), ("inductor/g", 20 * 2**20)):
        (tmp_path / "m" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "m" / rel).write_bytes(rng.randbytes(n))
    ret = tmp_path / "ret"
    (ret / "state").mkdir(parents=True)
    for rel in ("state/state.part00", "state/state.manifest.json", "autotune.tar.gz", "log", "status"):
        (ret / rel).write_text("x")
    r = subprocess.run(["bash", str(SCRIPT), "caches", str(ret), "45"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "returned the tilelang cache" in r.stdout
    assert "left out the inductor cache: its 2 part(s) would make 9 files" in r.stdout
    assert sum(1 for f in ret.rglob("*") if f.is_file()) == 7


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_device_session_two_chains_share_out(tmp_path):
    """Session 5's plan: a second chain beside the first on the same OUT (its own SESSION_DIR and CODE_DIR, caches
    left to the first) is not refused, finds OUT restored, waits for the first chain's data and then runs its pieces;
    each chain has its own status."""
    calls = tmp_path / "calls.txt"
    out = tmp_path / "out"
    fake = tmp_path / "fake_run.sh"  # run.py's stand-in: "data" writes OUT/seed0/data/done after a moment
    fake.write_text(f"""#!/usr/bin/env bash
echo "$2 $(date +%s%N)" >> {calls}
if [ "$2" = data ]; then sleep 1; mkdir -p {out}/seed0/data && echo ok > {out}/seed0/data/done; fi
exit 0
""")
    fake.chmod(0o755)
    kc_src = tmp_path / "kc_src" / "abc"
    kc_src.mkdir(parents=True)
    (kc_src / "k.autotune.json").write_text("{}")
    subprocess.run(["tar", "-czf", str(tmp_path / "kc.tar.gz"), "-C", str(tmp_path / "kc_src"), "abc"], check=True)
    base = {**os.environ, "OUT_DIR": str(out), "RUN": str(fake), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
            "COMPILE_CACHE": str(tmp_path / "none"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    a = {**base, "SESSION_DIR": str(tmp_path / "sd1"), "CODE_DIR": str(tmp_path / "code1"), "KERNEL_CACHE": str(tmp_path / "kc.tar.gz")}
    b = {**base, "SESSION_DIR": str(tmp_path / "sd2"), "CODE_DIR": str(tmp_path / "code2"), "KERNEL_CACHE": "/none"}
    r1 = subprocess.run(["bash", str(SCRIPT), "start", "--piece data", "--piece train"], env=a, capture_output=True,
                        text=True, cwd=ROOT)
    r2 = subprocess.run(["bash", str(SCRIPT), "start", f"wait {out}/seed0/data/done", "--piece train2"], env=b,
                        capture_output=True, text=True, cwd=ROOT)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert "committed state restored" in r1.stdout and "autotune results restored: 1 kernel(s)" in r1.stdout
    assert "already holds the committed state" in r2.stdout and "autotune" not in r2.stdout
    _wait_done(tmp_path / "sd1" / "status")
    _wait_done(tmp_path / "sd2" / "status")
    s2 = [ln.split(": ", 1)[1] for ln in (tmp_path / "sd2" / "status").read_text().splitlines()]
    assert s2 == [f"wait {out}/seed0/data/done: here", "--piece train2: rc=0 (try 1)", "session done"]
    t = {ln.split()[0]: int(ln.split()[1]) for ln in calls.read_text().splitlines()}
    assert set(t) == {"data", "train", "train2"} and t["train2"] > t["data"]
    assert (tmp_path / "code1" / "headscope").is_dir() and (tmp_path / "code2" / "headscope").is_dir()


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_device_session_wait_that_times_out_stops_the_chain(tmp_path):
    """A "wait FILE" whose file does not come within CHAIN_WAIT_S stops the chain: the pieces after it need the file."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake_run.sh"
    fake.write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {calls}\n")
    fake.chmod(0o755)
    env = {**os.environ, "OUT_DIR": str(tmp_path / "out"), "SESSION_DIR": str(tmp_path / "sd"),
           "CODE_DIR": str(tmp_path / "code"), "RUN": str(fake), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "KERNEL_CACHE": str(tmp_path / "none.tar.gz"), "CHAIN_WAIT_S": "5",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    missing = tmp_path / "seed4" / "data" / "long_w6.pt"
    r = subprocess.run(["bash", str(SCRIPT), "start", "--piece a", f"wait {missing}", "--piece b"], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    status = _wait_done(tmp_path / "sd" / "status")
    assert status == ["--piece a: rc=0 (try 1)", f"wait {missing}: not here after 5 s",
                      f"chain stopped: {missing} did not come; later pieces not run", "session done"]
    assert calls.read_text().splitlines() == ["--piece a"]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_device_session_returns_a_seeds_documents_and_exports_them_from_history(tmp_path):
    """return-docs packs a seed's shards and info.json (nothing else) as soon as data/done exists; the pack, committed
    to a git history and removed again, comes back through export-docs REF byte for byte, and `docs` unpacks it."""
    env = {**os.environ, "OUT_DIR": str(tmp_path / "out"), "SESSION_DIR": str(tmp_path / "sd"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    data = tmp_path / "out" / "seed4" / "data"
    (data / "shards").mkdir(parents=True)
    shard = bytes(range(256)) * 40
    (data / "shards" / "docs_0.pt").write_bytes(shard)
    (data / "info.json").write_text('{"seed": 4}')
    (data / "stage1.pt").write_bytes(b"rows")  # rebuilt from the shards: not returned
    (tmp_path / "out" / "seed4" / "hydra-7to1_t12500000").mkdir()
    (tmp_path / "out" / "seed4" / "hydra-7to1_t12500000" / "arm.json").write_text("{}")
    ret = tmp_path / "ret"

    def session(*args: str, cwd: Path = ROOT, script: Path = SCRIPT) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, cwd=cwd)

    early = session("return-docs", str(ret), "4")  # the data piece has not finished: refused, nothing packed
    assert early.returncode == 1 and "no seed4/data/done" in early.stderr and not ret.exists()
    assert session("return-docs", str(ret), "x4").returncode == 2
    (data / "done").touch()
    r = session("return-docs", str(ret), "4")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((ret / "seed4-docs" / "state.manifest.json").read_text())
    assert sorted(f["path"] for f in manifest["files"]) == ["seed4/data/info.json", "seed4/data/shards/docs_0.pt"]
    # kept in a history (a commit that adds the pack under state/, then one that removes it), exported by that commit
    repo = tmp_path / "repo"
    (repo / "experiments" / "conversion-generalization" / "state").mkdir(parents=True)
    script = repo / "experiments" / "conversion-generalization" / "device_session.sh"
    script.write_text(SCRIPT.read_text())
    subprocess.run(["cp", "-r", str(ret / "seed4-docs"), str(script.parent / "state")], check=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "seed 4's documents"], check=True)
    added = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([*git, "rm", "-rq", "experiments/conversion-generalization/state/seed4-docs"], check=True)
    subprocess.run([*git, "commit", "-qm", "out of the tree"], check=True)
    dest = tmp_path / "carried"
    missing = session("export-docs", str(dest), "4", "0" * 40, script=script, cwd=repo)
    assert missing.returncode == 1 and "no commit" in missing.stderr
    no_branch = session("export-docs", str(dest), "4", script=script, cwd=repo)
    assert no_branch.returncode == 1 and "no branch study-state" in no_branch.stderr
    r = session("export-docs", str(dest), "4", added, script=script, cwd=repo)
    assert r.returncode == 0, r.stderr
    for f in (ret / "seed4-docs").iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes()
    # on a fresh machine `docs` puts the shards and the record back into OUT, the rows are left to the data piece
    env["OUT_DIR"] = str(tmp_path / "fresh")
    r = session("docs", str(dest))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fresh" / "seed4" / "data" / "shards" / "docs_0.pt").read_bytes() == shard
    assert (tmp_path / "fresh" / "seed4" / "data" / "info.json").read_text() == '{"seed": 4}'
    assert not (tmp_path / "fresh" / "seed4" / "data" / "stage1.pt").exists()


LEVERS = ROOT / "experiments" / "conversion-generalization" / "lever_session.sh"


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
@pytest.mark.parametrize("gpu_mib", [81559, 143771])
def test_lever_session_chains_keep_their_order_and_memory_limit(tmp_path, gpu_mib):
    """lever_session.sh start: four chains on one OUT; the levers' rows after the documents, the s3 arm after its rows
    and the baseline, the 5:1 arm after the s2 arm on an 80 GiB GPU (two trainings at a time) but beside the baseline
    on a 140 GiB one; every training after the wheels; every arm's cells after its training; poll reports each chain."""
    # a seed that the committed state/ (which `start` restores into OUT) holds no arm of: seed 4's arms, committed
    # there since session 10, would let the chains' waits for the baseline pass at once
    seed = 97
    assert not (LEVERS.parent / "state" / f"seed{seed}").exists()
    calls = tmp_path / "calls.txt"
    out = tmp_path / "out"
    arm = out / f"seed{seed}"
    fake = tmp_path / "fake_run.sh"  # run.py's stand-in: writes the files that chains wait for; the baseline trains longest
    fake.write_text(f"""#!/usr/bin/env bash
sleep 0.3
case "$*" in
  "--piece data --seed {seed}") mkdir -p {arm}/data && echo '{{}}' > {arm}/data/info.json && touch {arm}/data/done ;;
  "--piece data --seed {seed} --s2-retrieval 0.25 --s3-wordings 6") touch {arm}/data/stage2_r0.25.pt {arm}/data/long_w6.pt ;;
  "--piece train --arm hydra-7to1 --seed {seed} --tokens 12.5M") sleep 2; mkdir -p {arm}/hydra-7to1_t12500000/stage3 && touch {arm}/hydra-7to1_t12500000/stage3/done.json ;;
  "--piece train --arm hydra-7to1 --seed {seed} --tokens 12.5M --s2-retrieval 0.25")
    d="{arm}/hydra-7to1+s2_retrieval=0.25_t12500000/stage3"; mkdir -p "$d" && touch "$d/done.json" ;;
esac
echo "$*" >> {calls}
""")
    fake.chmod(0o755)
    wheels = tmp_path / "wheels_done"
    env = {**os.environ, "OUT_DIR": str(out), "RUN": str(fake), "SESSION_DIR": str(tmp_path / "sd"),
           "CODE_DIR": str(tmp_path / "code"), "TRITON_CACHE_DIR": str(tmp_path / "triton"), "KERNEL_CACHE": "/none",
           "COMPILE_CACHE": "/none", "WHEELS_DONE": str(wheels), "GPU_MIB": str(gpu_mib), "SEED": str(seed),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(LEVERS), "start"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    time.sleep(1)
    assert not calls.exists() or "--piece train" not in calls.read_text()  # no training before the wheels are in
    wheels.touch()
    ret = tmp_path / "ret"
    p = subprocess.run(["bash", str(LEVERS), "poll", str(ret), "120"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    for s in ("sd", "sd2", "sd3", "sd4"):
        assert (tmp_path / s / "status").read_text().endswith("session done\n"), s
    e = "--eval-formats unseen --eval-max-len 4096 --eval-tasks-first niah_single"
    r4 = f"--seed {seed} --tokens 12.5M"
    order = calls.read_text().splitlines()
    assert sorted(order) == sorted([
        f"--piece data --seed {seed}", "--piece suite --eval-max-len 4096",
        f"--piece data --seed {seed} --s2-retrieval 0.25 --s3-wordings 6",
        *(f"--piece {piece} --arm {a} {r4}{lever}" + (f" {e}" if piece == "eval" else "")
          for piece in ("train", "eval") for a, lever in (("hydra-7to1", ""), ("hydra-7to1", " --s2-retrieval 0.25"),
                                                          ("hydra-7to1", " --s3-wordings 6"), ("hydra-5to1", "")))])
    at = {c: i for i, c in enumerate(order)}
    base, s2, s3, b5 = (f"--piece train --arm {a} {r4}{lv}" for a, lv in (("hydra-7to1", ""),
                        ("hydra-7to1", " --s2-retrieval 0.25"), ("hydra-7to1", " --s3-wordings 6"), ("hydra-5to1", "")))
    rows = f"--piece data --seed {seed} --s2-retrieval 0.25 --s3-wordings 6"
    assert at[f"--piece data --seed {seed}"] < at[rows] < at[s2] and at[rows] < at[s3] and at[base] < at[s3]
    assert all(at[t] < at[t.replace("--piece train", "--piece eval") + f" {e}"] for t in (base, s2, s3, b5))
    waits5 = (tmp_path / "sd4" / "status").read_text()
    if gpu_mib > 100000:
        assert f"wait {arm}/data/done: here" in waits5 and "s2_retrieval" not in waits5
    else:
        assert f"wait {arm}/hydra-7to1+s2_retrieval=0.25_t12500000/stage3/done.json: here" in waits5
        assert at[s2] < at[b5]
    chains = (ret / "chains.log").read_text()
    assert all(f"== chain {i}" in chains for i in (2, 3, 4)) and (ret / "status").exists()
