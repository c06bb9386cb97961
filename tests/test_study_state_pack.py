"""headscope.statepack (a run folder packed into parts and unpacked) and the conversion-generalization study's
--piece pack / unpack and its checks for student weights that did not travel (issue 40)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import math
import os
import random
import tarfile
from pathlib import Path

import pytest

from headscope.errors import HeadscopeInputError, InputFileExistsError, InputFileNotFoundError
from headscope.statepack import MANIFEST_NAME, CorruptPackError, PackTooLargeError, UnpackConflictError, matches, pack, unpack

ROOT = Path(__file__).resolve().parents[1]
LONG = "anatomy/unseen_niah_single@4096_p6/seed0_hydra-5to1+s2_retrieval=0.25+s3_wordings=6+fa_pos=rope_t50000000/ranking/scores.csv"


def _noise(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _make_run(root: Path) -> dict[str, bytes]:
    """A run folder like the study's: returns the files that must travel (path -> bytes); weights,
    checkpoints and temporary files are written beside them."""
    keep = {
        "settings.json": b'{"model": "smol"}',
        "manifest.json": b'{"commands": []}',
        "masks/hydra-7to1.json": b'{"fa_heads": [[0]]}',
        "cells/teacher__s0__t0/niah_single.unseen.1024.json": b'{"hits": 7}',
        "seed0/data/shards/docs_0.pt": _noise(3000, 1),
        "seed0/data/info.json": b'{"docs": 16}',
        "seed0/hydra-7to1_t1/arm.json": b'{"label": "hydra-7to1"}',
        "seed0/hydra-7to1_t1/stage3/done.json": b'{"finished": true}',
        "seed0/hydra-7to1_t1/stage3/log.csv": b"step,loss\n1,2.0\n",
        LONG: b"layer,head,score\n0,0,0.5\n",  # > 100 characters: a PAX name
        "suite/docs.pt": _noise(2000, 2),
    }
    weights = {
        "seed0/hydra-7to1_t1/stage3/student.pt": _noise(500, 3),
        "seed0/hydra-7to1_t1/stage3/checkpoint/__0_0.distcp": _noise(500, 4),
        "seed0/hydra-7to1_t1/stage3/checkpoint/trainer.pt": b"t",
        "seed0/hydra-7to1_t1/stage2/checkpoint.old/trainer.pt": b"o",
        "export/model.safetensors": b"s",
        "export/pytorch_model.bin": b"b",
        "seed0/data/shards/docs_1.tmp": b"half-written",
    }
    for rel, data in {**keep, **weights}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return keep


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _parts(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("state.part*"))}


# ---------------------------------------------------------------------------------------------- patterns
def test_patterns_by_hand():
    assert matches("seed0/data/short.pt", "seed*/data/*.pt")
    assert not matches("seed0/data/shards/docs_0.pt", "seed*/data/*.pt")  # * stays within one component
    assert matches("seed0/data/shards/docs_0.pt", "seed*/data/**/*.pt") and matches("seed0/data/short.pt", "seed*/data/**/*.pt")
    assert matches("a/b/checkpoint/x.distcp", "checkpoint") and not matches("a/b/checkpoints/x", "checkpoint")
    assert matches("cells/teacher__s0__t0/a.json", "cells") and matches("cells/teacher__s0__t0/a.json", "cells/")
    assert matches("x/y.json", "*.json") and not matches("x/y.jsonl", "*.json")
    assert matches("seed1/data/info.json", "./seed1") and not matches("seed10/data/info.json", "seed1")
    assert matches("stage3/done.json", "stage[13]/done.json") and not matches("stage2/done.json", "stage[!2]/done.json")
    for bad in ("", "/abs", "../up", "a/../b"):
        with pytest.raises(HeadscopeInputError, match="relative to the run folder"):
            matches("a", bad)


# ---------------------------------------------------------------------------------------------- round trip
def test_round_trip_keeps_bytes_and_leaves_weights_out(tmp_path):
    keep = _make_run(tmp_path / "run")
    m = pack(tmp_path / "run", tmp_path / "out")
    # the manifest: exactly the files that travel, with their size and SHA-256 computed here
    assert [e["path"] for e in m["files"]] == sorted(keep)
    for e in m["files"]:
        assert e["size"] == len(keep[e["path"]]) and e["sha256"] == hashlib.sha256(keep[e["path"]]).hexdigest()
    assert m["left_out"]["weights_or_checkpoints"] == {"files": 7, "bytes": 500 + 500 + 1 + 1 + 1 + 1 + 12}
    assert json.loads((tmp_path / "out" / MANIFEST_NAME).read_text()) == m
    # the parts are one gzip'd tar of those files in sorted order, with fixed owner, mode and time
    parts = _parts(tmp_path / "out")
    assert [p["name"] for p in m["parts"]] == list(parts) == ["state.part00"]
    assert m["parts"][0]["sha256"] == hashlib.sha256(parts["state.part00"]).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(parts["state.part00"]))) as tar:
        mem = tar.getmembers()
        assert [x.name for x in mem] == sorted(keep)
        assert {(x.mtime, x.uid, x.gid, x.uname, x.gname, x.mode) for x in mem} == {(0, 0, 0, "", "", 0o644)}
    r = unpack(tmp_path / "out", tmp_path / "back")
    assert r == {"files": len(keep), "written": len(keep), "updated": 0, "same": 0, "bytes": sum(map(len, keep.values()))}
    assert _tree(tmp_path / "back") == keep


def test_pack_is_deterministic(tmp_path):
    _make_run(tmp_path / "run")
    m1 = pack(tmp_path / "run", tmp_path / "a")
    for i, p in enumerate(sorted((tmp_path / "run").rglob("*.json"))):  # other times and modes: the same bytes
        os.utime(p, (1e9 + i, 1e9 + i))
        p.chmod(0o600)
    m2 = pack(tmp_path / "run", tmp_path / "b")
    assert m1 == m2 and _parts(tmp_path / "a") == _parts(tmp_path / "b")
    assert (tmp_path / "a" / MANIFEST_NAME).read_bytes() == (tmp_path / "b" / MANIFEST_NAME).read_bytes()
    (tmp_path / "run" / "settings.json").write_bytes(b'{"model": "other"}')
    assert _parts(tmp_path / "c") == {} and pack(tmp_path / "run", tmp_path / "c")["parts"] != m1["parts"]


def test_split_into_parts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    data = {f"seed0/data/shards/docs_{k}.pt": _noise(9000, 10 + k) for k in range(3)}  # incompressible
    for rel, b in data.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(b)
    m = pack(run, tmp_path / "out", max_part_bytes=4096, max_parts=20)
    parts = _parts(tmp_path / "out")
    n = math.ceil(m["archive_bytes"] / 4096)
    assert n >= 7 and len(parts) == len(m["parts"]) == n
    assert [len(b) for b in parts.values()] == [4096] * (n - 1) + [m["archive_bytes"] - 4096 * (n - 1)]
    assert [p["name"] for p in m["parts"]] == [f"state.part{k:02d}" for k in range(n)]
    assert unpack(tmp_path / "out", tmp_path / "back")["written"] == 3 and _tree(tmp_path / "back") == data
    # a later pack with fewer parts replaces the earlier parts
    pack(run, tmp_path / "out", include=["docs_0.pt"], max_part_bytes=4096, max_parts=20)
    assert len(_parts(tmp_path / "out")) == 3


def test_max_parts_refused_before_writing(tmp_path):
    run = tmp_path / "run"
    (run / "seed0").mkdir(parents=True)
    (run / "seed0" / "docs.pt").write_bytes(_noise(20_000, 5))
    with pytest.raises(PackTooLargeError, match=r"is \d+ bytes packed \(1 files, 20000 bytes\): 5 parts of at most 4096 "
                                                r"bytes, more than max_parts=2.*include=.*since=") as e:
        pack(run, tmp_path / "out", max_part_bytes=4096, max_parts=2)
    assert (e.value.parts, e.value.max_parts) == (5, 2) and 4 * 4096 < e.value.archive_bytes <= 5 * 4096
    assert list((tmp_path / "out").iterdir()) == []  # no part, no manifest, no temporary file
    for bad in ({"max_parts": 0}, {"max_part_bytes": 0}):
        with pytest.raises(HeadscopeInputError, match="at least 1"):
            pack(run, tmp_path / "out", **bad)
    with pytest.raises(InputFileNotFoundError, match="does not exist"):
        pack(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(HeadscopeInputError, match="is the run folder"):
        pack(run, run)


def test_out_dir_inside_the_run_is_not_packed(tmp_path):
    keep = _make_run(tmp_path / "run")
    pack(tmp_path / "run", tmp_path / "run" / "state")
    m = pack(tmp_path / "run", tmp_path / "run" / "state")  # a second pack does not take in the first's parts
    assert [e["path"] for e in m["files"]] == sorted(keep)


# ---------------------------------------------------------------------------------------------- filters
def test_include_exclude_filters(tmp_path):
    keep = _make_run(tmp_path / "run")
    got = [e["path"] for e in pack(tmp_path / "run", tmp_path / "o1", include=["cells", "*.json"])["files"]]
    assert [e["path"] for e in pack(tmp_path / "run", tmp_path / "o4", include="cells")["files"]] == [
        "cells/teacher__s0__t0/niah_single.unseen.1024.json"]  # one pattern as a string
    assert got == sorted(k for k in keep if k.startswith("cells/") or k.endswith(".json"))
    m = pack(tmp_path / "run", tmp_path / "o2", exclude=["seed*/data/shards", "suite/*.pt"])
    assert [e["path"] for e in m["files"]] == sorted(k for k in keep if k not in ("seed0/data/shards/docs_0.pt", "suite/docs.pt"))
    assert m["left_out"]["excluded"] == {"files": 2, "bytes": 5000}
    # include cannot bring weights back
    assert pack(tmp_path / "run", tmp_path / "o3", include=["seed0/hydra-7to1_t1/stage3"])["n_files"] == 2


def test_since_a_time(tmp_path):
    keep = _make_run(tmp_path / "run")
    for p in (tmp_path / "run").rglob("*"):
        os.utime(p, (1000, 1000))
    for rel in ("manifest.json", "cells/teacher__s0__t0/niah_single.unseen.1024.json"):
        os.utime(tmp_path / "run" / rel, (2000, 2000))
    m = pack(tmp_path / "run", tmp_path / "out", since=1500.0)
    assert [e["path"] for e in m["files"]] == ["cells/teacher__s0__t0/niah_single.unseen.1024.json", "manifest.json"]
    assert m["since"] == {"modified_after": 1500.0} and m["left_out"]["not_modified_since"]["files"] == len(keep) - 2


def test_since_a_manifest_and_incremental_unpack(tmp_path):
    run = tmp_path / "run"
    keep = _make_run(run)
    pack(run, tmp_path / "base")
    (run / "manifest.json").write_bytes(b'{"commands": ["eval"]}')
    (run / "cells" / "hydra-7to1__s0__t1").mkdir()
    (run / "cells" / "hydra-7to1__s0__t1" / "a.json").write_bytes(b'{"hits": 1}')
    for p in run.rglob("*"):  # content decides, not times (unpacked files all look new)
        os.utime(p, None)
    m = pack(run, tmp_path / "inc", since=[tmp_path / "base"])
    assert [(e["path"], e.get("previous_sha256")) for e in m["files"]] == [
        ("cells/hydra-7to1__s0__t1/a.json", None),
        ("manifest.json", hashlib.sha256(keep["manifest.json"]).hexdigest())]
    assert m["left_out"]["unchanged_since"]["files"] == len(keep) - 1
    # the next session: the base, then the increment, which updates manifest.json without overwrite
    unpack(tmp_path / "base", tmp_path / "back")
    r = unpack(tmp_path / "inc", tmp_path / "back")
    assert (r["written"], r["updated"], r["same"]) == (1, 1, 0)
    assert _tree(tmp_path / "back") == {**keep, "manifest.json": b'{"commands": ["eval"]}', "cells/hydra-7to1__s0__t1/a.json": b'{"hits": 1}'}
    # a file that holds neither the packed nor the previous content is a conflict
    (tmp_path / "back" / "manifest.json").write_bytes(b"{}")
    with pytest.raises(InputFileExistsError, match="manifest.json"):
        unpack(tmp_path / "inc", tmp_path / "back")
    with pytest.raises(InputFileNotFoundError, match="no state manifest"):
        pack(run, tmp_path / "x", since=[tmp_path / "nowhere"])


# ---------------------------------------------------------------------------------------------- unpack refuses
def test_corrupt_or_missing_part_detected(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "a.pt").write_bytes(_noise(12_000, 7))
    pack(run, tmp_path / "out", max_part_bytes=4096)
    p1 = tmp_path / "out" / "state.part01"
    good = p1.read_bytes()
    p1.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(CorruptPackError, match="state.part01 is corrupt"):
        unpack(tmp_path / "out", tmp_path / "back")
    assert not (tmp_path / "back" / "a.pt").exists()
    p1.write_bytes(good[:-1])
    with pytest.raises(CorruptPackError, match="state.part01 is corrupt"):
        unpack(tmp_path / "out", tmp_path / "back")
    p1.unlink()
    with pytest.raises(InputFileNotFoundError, match="state.part01 is missing"):
        unpack(tmp_path / "out", tmp_path / "back")
    p1.write_bytes(good)
    # a manifest whose file hash is wrong: the parts are fine, the content is not what it lists
    mf = tmp_path / "out" / MANIFEST_NAME
    m = json.loads(mf.read_text())
    m["files"][0]["sha256"] = "0" * 64
    mf.write_text(json.dumps(m))
    with pytest.raises(CorruptPackError, match="a.pt does not match the manifest"):
        unpack(tmp_path / "out", tmp_path / "back")
    assert not (tmp_path / "back" / "a.pt").exists()
    with pytest.raises(InputFileNotFoundError, match="no state.manifest.json"):
        unpack(tmp_path / "run", tmp_path / "back")


def _crafted(d: Path, members: list[tuple[tarfile.TarInfo, bytes]], listed: list[tuple[str, bytes]]) -> None:
    """A pack in ``d`` whose tar holds ``members`` and whose manifest lists ``listed`` (path, content)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    part = gzip.compress(buf.getvalue())
    d.mkdir(parents=True, exist_ok=True)
    (d / "state.part00").write_bytes(part)
    (d / MANIFEST_NAME).write_text(json.dumps({
        "format": "headscope-statepack/1", "archive": "tar.gz",
        "files": [{"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for p, b in listed],
        "parts": [{"name": "state.part00", "size": len(part), "sha256": hashlib.sha256(part).hexdigest()}]}))


def _reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def test_traversal_absolute_and_links_refused(tmp_path):
    (tmp_path / "run").mkdir()
    for name in ("../evil.txt", "/tmp/evil.txt", "a/../../evil.txt", "./a.txt", "a//b.txt"):
        d = tmp_path / f"pack{abs(hash(name))}"
        _crafted(d, [_reg(name, b"x")], [(name, b"x")])
        with pytest.raises(CorruptPackError, match="unsafe path"):
            unpack(d, tmp_path / "run")
    assert not (tmp_path / "evil.txt").exists() and not any((tmp_path / "run").iterdir())
    # a link (listed or not) and an entry the manifest does not list
    link = tarfile.TarInfo("cells/x.json")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    _crafted(tmp_path / "link", [(link, b"")], [("cells/x.json", b"")])
    with pytest.raises(CorruptPackError, match="not a regular file"):
        unpack(tmp_path / "link", tmp_path / "run")
    hard = tarfile.TarInfo("b.json")
    hard.type, hard.linkname = tarfile.LNKTYPE, "a.json"
    _crafted(tmp_path / "hard", [_reg("a.json", b"1"), (hard, b"")], [("a.json", b"1"), ("b.json", b"1")])
    with pytest.raises(CorruptPackError, match="not a regular file"):
        unpack(tmp_path / "hard", tmp_path / "run")
    _crafted(tmp_path / "extra", [_reg("a.json", b"1"), _reg("b.json", b"2")], [("a.json", b"1")])
    with pytest.raises(CorruptPackError, match="not in the manifest"):
        unpack(tmp_path / "extra", tmp_path / "run")
    assert not any((tmp_path / "run").iterdir())
    # a folder of the run that is a link to elsewhere is not written through
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run" / "cells").symlink_to(tmp_path / "elsewhere")
    _crafted(tmp_path / "through", [_reg("cells/x.json", b"1")], [("cells/x.json", b"1")])
    with pytest.raises(CorruptPackError, match="is a link"):
        unpack(tmp_path / "through", tmp_path / "run")
    assert not any((tmp_path / "elsewhere").iterdir())
    # pack side: links are not packed, only listed
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "a.json").write_text("1")
    (tmp_path / "r2" / "l.json").symlink_to(tmp_path / "r2" / "a.json")
    m = pack(tmp_path / "r2", tmp_path / "o2")
    assert [e["path"] for e in m["files"]] == ["a.json"] and m["links"] == ["l.json"]


def test_overwrite_refused_then_allowed_and_idempotent(tmp_path):
    keep = _make_run(tmp_path / "run")
    pack(tmp_path / "run", tmp_path / "out")
    back = tmp_path / "back"
    (back / "masks").mkdir(parents=True)
    (back / "masks" / "hydra-7to1.json").write_bytes(b"other")
    with pytest.raises(InputFileExistsError, match=r"1 file\(s\) .* differ .*masks/hydra-7to1.json.*overwrite=True") as e:
        unpack(tmp_path / "out", back)
    assert isinstance(e.value, UnpackConflictError) and e.value.conflicts == ["masks/hydra-7to1.json"]
    assert _tree(back) == {"masks/hydra-7to1.json": b"other"}  # nothing written
    r = unpack(tmp_path / "out", back, overwrite=True)
    assert (r["written"], r["updated"]) == (len(keep) - 1, 1) and _tree(back) == keep
    times = {p: p.stat().st_mtime_ns for p in back.rglob("*") if p.is_file()}
    r = unpack(tmp_path / "out", back)  # again: nothing to do
    assert (r["written"], r["updated"], r["same"], r["bytes"]) == (0, 0, len(keep), 0)
    assert {p: p.stat().st_mtime_ns for p in back.rglob("*") if p.is_file()} == times


# ---------------------------------------------------------------------------------------------- the study
def _study():
    spec = importlib.util.spec_from_file_location("gen_study_pack", ROOT / "experiments" / "conversion-generalization" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def study():
    return _study()


def _trained_arm(run, out: Path, *extra: str):
    """OUT with settings, data marker and rows, and an arm whose three stages are done but whose weights are gone."""
    a = run.parser().parse_args(["--out", str(out), "--tokens", "1", *extra])
    s = run.settings(a)
    data = out / "seed0" / "data"
    data.mkdir(parents=True, exist_ok=True)
    for f in ("done", *run.stage_rows_files(run.arm_levers(a)).values()):
        (data / f).write_text("x")
    rd = run.run_dir(a)
    run.check_arm(rd, run.arm_spec(a, s))
    for k in (1, 2, 3):
        (rd / f"stage{k}").mkdir(parents=True, exist_ok=True)
        (rd / f"stage{k}" / "done.json").write_text("{}")
        (rd / f"stage{k}" / "log.csv").write_text("step\n1\n")
    return a, s, rd


def test_study_pack_leaves_out_what_pieces_rebuild(study, tmp_path):
    out = tmp_path / "OUT"
    files = {"settings.json": "{}", "suite/docs.pt": "d", "suite/pairs/niah_single@1024_n100_s1234.pt": "p",
             "seed0/data/shards/docs_0.pt": "s", "seed0/data/info.json": "{}", "seed0/data/levers.json": "{}",
             "seed0/data/short.pt": "r", "seed0/data/long_w6.pt": "r", "seed0/data/done": "ok",
             "seed0/hydra-7to1_t1/stage3/done.json": "{}", "seed0/hydra-7to1_t1/stage3/student.pt": "w",
             ".state_restored": "Thu Dec  3 19:01:00 UTC 2026", ".manifest.lock": ""}  # one machine's, not state
    for rel, t in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(t)
    a = study.parser().parse_args(["--out", str(out), "--piece", "pack", "--pack-to", str(tmp_path / "state")])
    msg = study.run_piece(a)
    m = json.loads((tmp_path / "state" / MANIFEST_NAME).read_text())
    assert [e["path"] for e in m["files"]] == ["seed0/data/info.json", "seed0/data/levers.json", "seed0/data/shards/docs_0.pt",
                                               "seed0/hydra-7to1_t1/stage3/done.json", "settings.json", "suite/docs.pt"]
    assert "packed 6 files" in msg and "excluded 6 files" in msg and "weights_or_checkpoints 1 files" in msg
    assert not (out / "manifest.json").exists()  # pack and unpack record nothing in OUT
    a = study.parser().parse_args(["--out", str(tmp_path / "new"), "--piece", "unpack", "--unpack-from", str(tmp_path / "state")])
    msg = study.run_piece(a)
    assert "6 files (6 new" in msg and "--piece suite" in msg and "--piece data --seed 0" in msg
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["seed0", "settings.json", "suite"]
    # the refusal names the options that pack less
    (out / "big.pt").write_bytes(_noise(15 * 2**20 + 1, 9))
    a = study.parser().parse_args(["--out", str(out), "--piece", "pack", "--pack-to", str(tmp_path / "s2"), "--pack-max-parts", "1"])
    with pytest.raises(SystemExit, match=r"2 parts of 15 MiB, more than --pack-max-parts 1.*--pack-since.*--pack-include"):
        study.run_piece(a)
    (out / "manifest.json").write_text("{}")
    (tmp_path / "new" / "manifest.json").write_text('{"other": 1}')
    study.run_piece(study.parser().parse_args(["--out", str(out), "--piece", "pack", "--pack-to", str(tmp_path / "s3"),
                                               "--pack-include", "manifest.json"]))
    with pytest.raises(SystemExit, match=r"1 file\(s\) in .*new differ from those packed in .*s3 \(manifest.json\): nothing "
                                         "unpacked from it; --unpack-overwrite replaces them"):
        study.run_piece(study.parser().parse_args(["--out", str(tmp_path / "new"), "--piece", "unpack", "--unpack-from",
                                                   str(tmp_path / "s3")]))
    assert study.parse_since(["1700000000"]) == 1.7e9 and study.parse_since(["2023-11-14T22:13:20Z"]) == 1.7e9
    assert study.parse_since(["a", "b"]) == ["a", "b"] and study.parse_since(None) is None


def test_study_train_refuses_lost_weights_and_names_retrain(study, tmp_path, monkeypatch):
    a, s, rd = _trained_arm(study, tmp_path, "--fa-pos", "rope")
    assert study.lost_stages(rd) == [1, 2, 3]
    with pytest.raises(SystemExit, match=r"stage\(s\) 1, 2, 3 .* weights are not here") as e:
        study.piece_train(a, s, float("inf"))
    assert f"run.py --piece train --out {tmp_path} --arm hydra-7to1 --seed 0 --tokens 1 --fa-pos rope --retrain" in str(e.value)
    # --retrain sets the lost stages aside, then trains (here: the teacher's loading stands for the training)
    monkeypatch.setattr(study, "load_teacher", lambda *x, **k: (_ for _ in ()).throw(RuntimeError("training starts")))
    a.retrain = True
    cells = tmp_path / "cells" / "hydra-7to1+fa_pos=rope__s0__t1"  # scored with the lost student
    cells.mkdir(parents=True)
    (cells / "niah_single.unseen.1024.json").write_text("{}")
    with pytest.raises(RuntimeError, match="training starts"):
        study.piece_train(a, s, float("inf"))
    assert not (rd / "stage1").exists() and (rd / "earlier_training_1" / "stage3" / "done.json").exists()
    # its cells moved beside the earlier records: every cell of an arm comes from one student
    assert not cells.exists() and (rd / "earlier_training_1" / "cells" / "niah_single.unseen.1024.json").exists()
    assert study.lost_stages(rd) == [] and (rd / "arm.json").exists()
    # only the stages from the first lost one: stage 1 has its weights, stage 2 a log without checkpoint
    (rd / "stage1").mkdir()
    (rd / "stage1" / "done.json").write_text("{}")
    (rd / "stage1" / "student.pt").write_text("w")
    (rd / "stage2").mkdir()
    (rd / "stage2" / "log.csv").write_text("step\n")
    assert study.lost_stages(rd) == [2]
    with pytest.raises(RuntimeError, match="training starts"):
        study.piece_train(a, s, float("inf"))
    assert (rd / "stage1" / "student.pt").exists() and (rd / "earlier_training_2" / "stage2" / "log.csv").exists()
    # weights here: trained, nothing loaded
    (rd / "stage3").mkdir()
    (rd / "stage3" / "done.json").write_text("{}")
    (rd / "stage3" / "student.pt").write_text("w")
    assert study.piece_train(a, s, float("inf")) == "trained"


def test_study_eval_without_weights(study, tmp_path):
    from dataclasses import asdict

    a, s, rd = _trained_arm(study, tmp_path)
    cfg = study.suite_config(s)
    with pytest.raises(SystemExit, match=r"40 of its 40 cells are not stored yet\. Retrain it: run\.py --piece train "
                                         rf"--out {tmp_path} --arm hydra-7to1 --seed 0 --tokens 1 --retrain"):
        study.piece_eval(a, s, float("inf"))
    d = tmp_path / "cells" / "hydra-7to1__s0__t1"
    d.mkdir(parents=True)
    conf = json.loads(json.dumps(asdict(cfg)))
    for task, fmt, L in cfg.cells():
        (d / f"{task}.{fmt}.{L}.json").write_text(json.dumps({"config": conf}))
    assert study.piece_eval(a, s, float("inf")) == "evaluated: all 40 cells stored (the student weights, not here, are not needed)"
    (d / "niah_single.seen.1024.json").write_text(json.dumps({"config": {**conf, "n": 7}}))  # another suite: not stored
    assert study.cells_left(tmp_path, "hydra-7to1", 0, 1, cfg) == (1, 40)
    with pytest.raises(SystemExit, match="1 of its 40 cells"):
        study.piece_eval(a, s, float("inf"))


def test_resampled_documents_are_checked_against_the_record(study, tmp_path, monkeypatch):
    """A state pack carries data/info.json but not the shards: documents sampled again must be the recorded ones."""
    import headscope.train

    def fake_sampler(teacher, tok, n, length, seed, **kw):  # documents determined by the seed, as on one GPU
        return [[seed, i, 7] for i in range(n)]

    monkeypatch.setattr(headscope.train, "sample_teacher_text", fake_sampler)
    a = study.parser().parse_args(["--out", str(tmp_path), "--device", "cpu"])
    s = {"sample_batch": 2, "doc_len": 3, "corpus": None}
    docs = study.sample_docs(a, s, None, None, tmp_path / "first", 5, 100, float("inf"))
    assert docs == [[100, 0, 7], [100, 1, 7], [101, 0, 7], [101, 1, 7], [102, 0, 7]]
    hashes = study.shard_hashes(docs, 2)
    assert len(hashes) == 3 and hashes[2] == study.sha256_docs([[102, 0, 7]]) and len(set(hashes)) == 3
    # the same documents again: accepted
    assert study.sample_docs(a, s, None, None, tmp_path / "again", 5, 100, float("inf"), expected=hashes) == docs
    # other documents from shard 1 on: refused at that shard, kept aside, nothing reused on a rerun
    bad = [hashes[0], study.sha256_docs([[0]]), hashes[2]]
    with pytest.raises(SystemExit, match=r"shard 1: SHA-256 .* set aside as docs_1\.differs\.pt.*not reproducible"):
        study.sample_docs(a, s, None, None, tmp_path / "other", 5, 100, float("inf"), expected=bad)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["docs_0.pt", "docs_1.differs.pt"]
    # study_data: documents whose hash is not the one info.json recorded are refused before any row is built
    d = tmp_path / "seed0" / "data"
    d.mkdir(parents=True)
    (d / "info.json").write_text(json.dumps({"docs_sha256": "0" * 64}))
    monkeypatch.setattr(study, "load_teacher", lambda *x, **k: (None, None))
    monkeypatch.setattr(study, "sample_docs", lambda *x, **k: docs)
    a = study.parser().parse_args(["--out", str(tmp_path), "--device", "cpu", "--seed", "0"])
    with pytest.raises(SystemExit, match=r"seed 0's documents .* are not those recorded in its info\.json"):
        study.study_data(a, study.settings(a), float("inf"))
    assert sorted(p.name for p in d.iterdir()) == ["info.json"]


def test_rows_built_again_are_checked_against_the_record(study, tmp_path, monkeypatch):
    """Rows rebuilt from recorded documents (a new session) must be the bytes info.json / levers.json recorded."""
    import torch
    from types import SimpleNamespace

    from headscope.train import TokenRows

    docs = [[i % 50 + 1] * 40 for i in range(64)]
    rows = TokenRows(torch.arange(24).view(3, 8), torch.ones(3, 8, dtype=torch.bool))
    monkeypatch.setattr(study, "load_teacher", lambda *x, **k: (None, SimpleNamespace(eos_token_id=0)))
    monkeypatch.setattr(study, "_cpu_tokenizer", lambda a: SimpleNamespace(eos_token_id=0))
    monkeypatch.setattr(study, "sample_docs", lambda *x, **k: docs)
    monkeypatch.setattr(study, "stage3_rows", lambda *x, **k: (rows, rows, rows))
    a = study.parser().parse_args(["--out", str(tmp_path), "--device", "cpu", "--seed", "0", "--seq-len", "16"])
    s = study.settings(a)
    d = tmp_path / "seed0" / "data"
    assert study.study_data(a, s, float("inf")).startswith("data built")
    info = json.loads((d / "info.json").read_text())
    assert info["rows_sha256"]["long.pt"] == hashlib.sha256((d / "long.pt").read_bytes()).hexdigest()
    # a new session: the same documents, rows built again and equal -> accepted
    for f in ("done", "short.pt", "long.pt", "heldout.pt"):
        (d / f).unlink()
    assert study.study_data(a, s, float("inf")).startswith("data built")
    # rows that come out differently -> refused, nothing kept
    (d / "done").unlink()
    info["rows_sha256"]["short.pt"] = "0" * 64
    (d / "info.json").write_text(json.dumps(info))
    with pytest.raises(SystemExit, match=r"rows built again .* differ .* \(short\.pt\)"):
        study.study_data(a, s, float("inf"))
    assert sorted(p.name for p in d.iterdir()) == ["info.json"]
    # a lever's rows: checked against levers.json
    info["rows_sha256"]["short.pt"] = hashlib.sha256(b"").hexdigest()
    a = study.parser().parse_args(["--out", str(tmp_path), "--device", "cpu", "--seed", "0", "--seq-len", "16", "--s3-wordings", "6"])
    (d / "info.json").write_text(json.dumps({**info, "docs_sha256": study.sha256_docs(docs)}))
    (d / "levers.json").write_text(json.dumps({"long_w6.pt": {"sha256": "0" * 64}}))
    with pytest.raises(SystemExit, match=r"long_w6\.pt built again is not the file levers\.json recorded"):
        study.lever_data(a, s)
    assert not (d / "long_w6.pt").exists()
    (d / "levers.json").unlink()
    assert "long_w6.pt" in study.lever_data(a, s) and (d / "long_w6.pt").exists()



def test_suite_restore_prints_one_line_per_prompt_set(study, tmp_path, monkeypatch, capsys):
    """--piece suite after a restore (suite/docs.pt there) building the prompt sets in this process (--workers 1,
    e.g. a 2-core CPU machine) prints a line for each, as the forked workers' path does."""
    from types import SimpleNamespace

    built = []
    monkeypatch.setattr(study, "_cpu_tokenizer", lambda a: "tok")
    monkeypatch.setattr(study, "suite_filler", lambda out, tok: SimpleNamespace(sentences=["a.", "b.", "c."]))
    monkeypatch.setattr(study, "suite_pairs", lambda tok, cfg, *cell, **kw: built.append(cell))
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "docs.pt").write_bytes(b"")
    a = study.parser().parse_args(["--out", str(tmp_path), "--device", "cpu", "--workers", "1"])
    s = study.settings(a)
    cells = study.suite_config(s).cells()
    assert len(cells) == 40
    assert study.piece_suite(a, s, float("inf")) == "suite ready: 40 prompt sets, 3 haystack sentences"
    assert built == sorted(cells, key=lambda c: -c[2])  # longest first
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 40
    for i, (ln, (task, fmt, L)) in enumerate(zip(lines, built), 1):
        head, secs = ln.rsplit(": ", 1)
        assert head == f"[{i}/40] prompt set {task} {fmt} {L}" and secs.endswith(" s") and float(secs[:-2]) >= 0
    # past the deadline: nothing built, nothing printed
    assert study.piece_suite(a, s, 0.0) == "partial: prompt sets stopped at the deadline; rerun"
    assert capsys.readouterr().out == "" and len(built) == 40


def test_eval_cells_selects_formats_in_order_up_to_a_length(study):
    """--eval-formats unseen seen --eval-max-len 4096: the unseen cells up to 4K (shortest first), then the seen ones;
    no options: every cell, shortest first; a maximum below the shortest length is refused."""
    import argparse

    from headscope.evaluation.retention import SuiteConfig

    cfg = SuiteConfig()
    a = argparse.Namespace(eval_formats=None, eval_max_len=None)
    assert study.eval_cells(a, cfg) == cfg.cells() and len(cfg.cells()) == 40
    a = argparse.Namespace(eval_formats=["unseen", "seen"], eval_max_len=4096)
    got = study.eval_cells(a, cfg)
    tasks = list(cfg.tasks)
    assert got == [(t, f, L) for f in ("unseen", "seen") for L in (1024, 2048, 4096) for t in tasks]
    a = argparse.Namespace(eval_formats=["unseen"], eval_max_len=None)
    assert [c[2] for c in study.eval_cells(a, cfg)] == [L for L in (1024, 2048, 4096, 8192, 16384) for _ in tasks]
    with pytest.raises(SystemExit, match="below the suite's shortest length 1024"):
        study.eval_cells(argparse.Namespace(eval_formats=None, eval_max_len=512), cfg)
    # --eval-tasks-first: those tasks' cells first, each group in the order it had
    a = argparse.Namespace(eval_formats=["unseen"], eval_max_len=4096, eval_tasks_first=["niah_single"])
    got = study.eval_cells(a, cfg)
    assert got == ([("niah_single", "unseen", L) for L in (1024, 2048, 4096)]
                   + [(t, "unseen", L) for L in (1024, 2048, 4096) for t in tasks if t != "niah_single"])
    a = argparse.Namespace(eval_formats=None, eval_max_len=None, eval_tasks_first=["variable_tracking", "niah_multikey"])
    got = study.eval_cells(a, cfg)
    assert sorted(got) == sorted(cfg.cells()) and len(got) == 40
    assert [c[0] for c in got[:20]] == ["variable_tracking"] * 10 + ["niah_multikey"] * 10
    assert got[:10] == [c for c in cfg.cells() if c[0] == "variable_tracking"]
    with pytest.raises(SystemExit, match="--eval-tasks-first niah_double: not a task of the suite"):
        study.eval_cells(argparse.Namespace(eval_formats=None, eval_max_len=None, eval_tasks_first=["niah_double"]), cfg)
    # refused when the command line is parsed, before any piece writes OUT/settings.json
    with pytest.raises(SystemExit):
        study.parser().parse_args(["--out", "x", "--piece", "eval", "--eval-tasks-first", "niah_double"])
    assert study.parser().parse_args(["--out", "x", "--piece", "eval", "--eval-tasks-first", "niah_single"]).eval_tasks_first \
        == ["niah_single"]


def test_suite_builds_only_the_prompt_sets_eval_will_score(study, tmp_path, monkeypatch, capsys):
    """--piece suite --eval-formats unseen --eval-max-len 4096 builds the 12 unseen prompt sets up to 4K (longest
    first) and says that it built 12 of 40."""
    from types import SimpleNamespace

    built = []
    monkeypatch.setattr(study, "_cpu_tokenizer", lambda a: "tok")
    monkeypatch.setattr(study, "suite_filler", lambda out, tok: SimpleNamespace(sentences=["a."]))
    monkeypatch.setattr(study, "suite_pairs", lambda tok, cfg, *cell, **kw: built.append(cell))
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "docs.pt").write_bytes(b"")
    a = study.parser().parse_args(["--out", str(tmp_path), "--device", "cpu", "--workers", "1",
                                   "--eval-formats", "unseen", "--eval-max-len", "4096"])
    s = study.settings(a)
    msg = study.piece_suite(a, s, float("inf"))
    assert msg == "suite ready: 12 prompt sets of 40 (--eval-formats / --eval-max-len), 1 haystack sentences"
    tasks = study.suite_config(s).tasks
    assert built == [(t, "unseen", L) for L in (4096, 2048, 1024) for t in tasks]


def test_comparison_table_and_goal_lines(study, tmp_path):
    """comparison.md from a hand-made retention_seeds.csv: the unseen cells up to 4K per arm (mean, min–max over
    seeds), and the goal per tokens: met only with >= 2 seeds and every seed's single-needle retention >= 0.9, met on
    the mean when only the means over seeds reach 0.9; the
    cells (any length) where hydra-7to1 is below layer-3to1."""
    import pandas as pd

    rows = []

    def add(model, tokens, task, L, acc, n_seeds=1, lo=None, hi=None, ret=None, ret_min=None):
        rows.append(dict(model=model, tokens=tokens, task=task, formats="unseen", length=L, n_seeds=n_seeds,
                         accuracy_mean=acc, accuracy_sd=0.0, accuracy_min=lo if lo is not None else acc,
                         accuracy_max=hi if hi is not None else acc, retention_mean=ret, retention_sd=0.0,
                         retention_min=ret_min if ret_min is not None else ret, retention_max=ret))

    for L in (1024, 2048, 4096):
        add("teacher", 0, "niah_single", L, 1.0, ret=1.0)
        add("hydra-7to1", 50_000_000, "niah_single", L, 0.95, 2, 0.93, 0.97, ret=0.95, ret_min=0.93)
        add("layer-3to1", 50_000_000, "niah_single", L, 0.40, ret=0.40)
        two = L == 1024  # a second seed at 1K only: the row's seeds read 1–2, the goal still counts one
        add("hydra-7to1", 200_000_000, "niah_single", L, 0.97, 2 if two else 1, 0.96 if two else None,
            0.98 if two else None, ret=0.97)  # one seed at 2K and 4K: not met
        add("hydra-7to1", 100_000_000, "niah_single", L, 0.92, 3, 0.88, 0.95, ret=0.92, ret_min=0.88)  # mean only
    add("hydra-7to1", 50_000_000, "niah_multikey", 8192, 0.10, 2, 0.05, 0.15, ret=0.3)
    add("layer-3to1", 50_000_000, "niah_multikey", 8192, 0.20, ret=0.6)
    add("hydra-7to1+fa_pos=rope", 50_000_000, "niah_single", 1024, 0.5, ret=0.5)  # a lever arm: not in the table
    pd.DataFrame(rows).to_csv(tmp_path / "retention_seeds.csv", index=False)
    assert study.comparison_table(tmp_path, [1024, 2048, 4096]) == 5
    md = (tmp_path / "comparison.md").read_text().splitlines()
    table = [ln for ln in md if ln.startswith("| ") and not ln.startswith("| arm")]
    assert table == ["| teacher | – | 1 | 1.00 | 1.00 | 1.00 |",
                     "| hydra-7to1 | 50M | 2 | 0.95 (0.93–0.97) | 0.95 (0.93–0.97) | 0.95 (0.93–0.97) |",
                     "| hydra-7to1 | 100M | 3 | 0.92 (0.88–0.95) | 0.92 (0.88–0.95) | 0.92 (0.88–0.95) |",
                     "| hydra-7to1 | 200M | 1–2 | 0.97 (0.96–0.98) | 0.97 | 0.97 |",
                     "| layer-3to1 | 50M | 1 | 0.40 | 0.40 | 0.40 |"]
    goals = [ln for ln in md if ln.startswith("- ")]
    assert goals == [
        "- 50M tokens: single-needle retention 0.95, 0.95, 0.95 (lowest seed 0.93), 2 seed(s): met; below `layer-3to1` on "
        "multi-key 8K.",
        "- 100M tokens: single-needle retention 0.92, 0.92, 0.92 (lowest seed 0.88), 3 seed(s): met on the mean of seeds, "
        "not on every seed; `layer-3to1` not measured at these tokens.",
        "- 200M tokens: single-needle retention 0.97, 0.97, 0.97 (lowest seed 0.97), 1 seed(s): not met; `layer-3to1` not "
        "measured at these tokens."]


def test_comparison_depth_section(study, tmp_path):
    """comparison.md's depth section from a hand-made retention_depth.csv: unseen single-needle hits per depth bin,
    summed over seeds, one row per arm / tokens / length, lever arms after the comparison's; seen cells and other
    tasks left out."""
    import pandas as pd

    rows = []
    for model, seed, tokens, hits in (("teacher", 0, 0, (2, 2)), ("hydra-7to1", 0, 50_000_000, (0, 2)),
                                      ("hydra-7to1", 1, 50_000_000, (1, 2)), ("hydra-7to1+fa_pos=rope", 0, 50_000_000, (2, 2))):
        for b, h in enumerate(hits):
            rows.append(dict(model=model, seed=seed, tokens=tokens, task="niah_single", formats="unseen", length=2048,
                             depth_lo=b / 2, depth_hi=(b + 1) / 2, distance_tokens=0, n=2, hits=h, accuracy=h / 2,
                             teacher_hits=2, teacher_accuracy=1.0))
    rows.append({**rows[-1], "model": "hydra-7to1", "formats": "seen"})
    rows.append({**rows[-1], "formats": "unseen", "task": "niah_multikey"})
    pd.DataFrame(rows).to_csv(tmp_path / "retention_depth.csv", index=False)
    lines = study.depth_lines(tmp_path, [1024, 2048])
    assert lines[3] == "| arm | tokens | length | depth 0.0–0.5 | depth 0.5–1.0 |"
    assert lines[5:] == ["| teacher | – | 2K | 2/2 | 2/2 |", "| hydra-7to1 | 50M | 2K | 1/4 | 4/4 |",
                         "| hydra-7to1+fa_pos=rope | 50M | 2K | 2/2 | 2/2 |"]
    assert study.depth_lines(tmp_path, [4096]) == []


def test_study_record_from_concurrent_processes_keeps_every_command(study, tmp_path):
    """Two chains of pieces may share OUT: 2 processes x 25 records each into one manifest.json, all 50 kept (the
    read-modify-write runs under a file lock; without it records are lost)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_record_many, args=(study, tmp_path, i)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(c["outcome"] for c in m["commands"]) == sorted(f"p{i} r{k}" for i in range(2) for k in range(25))


def _record_many(study, out, i):
    os.environ["HEADSCOPE_COMMIT"] = "test"  # no git call per record
    a = study.parser().parse_args(["--out", str(out), "--piece", "eval"])
    for k in range(25):
        study.record(out, a, f"p{i} r{k}", 0.0)
