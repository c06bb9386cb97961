"""Pack a run folder into parts small enough to travel, and unpack them again.

A study that runs on a machine that lives for one session (issue 40: a fresh GPU machine per session, state
carried in as a folder of at most 64 MiB, results carried out as files of at most 16 MiB) keeps its state in
its output folder. :func:`pack` writes the files of that folder that matter as one archive split into parts,
and :func:`unpack` verifies the parts and restores the files.

Layout written by :func:`pack` into ``out_dir``::

    state.part00, state.part01, ...   consecutive pieces of one gzip-compressed tar, each <= max_part_bytes
    state.manifest.json               every packed file (path, size, sha256), every part (name, size, sha256),
                                      the totals, what was left out and why

The archive is deterministic: members in sorted path order, regular files only, mtime 0, uid/gid 0, no
owner names, mode 0644, gzip header without name or time. The same files give the same parts, byte for
byte (with the same zlib). The manifest holds no time either.

Left out always (:data:`ALWAYS_LEFT_OUT`): model weights and training checkpoints (``student.pt``,
``*.safetensors``, ``*.bin``, ``*.ckpt``, ``checkpoint.pt``, the trainer's ``checkpoint/`` directories and
their ``.tmp`` / ``.old`` swaps) and unfinished atomic writes (``*.tmp``); symbolic links are never packed
(they are listed in the manifest). The caller adds its own rebuildable files with ``exclude``.

Patterns (``include``, ``exclude``): POSIX globs on paths relative to the run folder. A pattern without
``/`` matches any one path component (``*.bin`` any .bin file, ``checkpoint`` any folder of that name);
a pattern with ``/`` matches from the run folder's root, where ``*`` and ``?`` stay within one component
and ``**`` spans components (``seed*/data/*.pt``, ``cells/**``); a pattern that matches a folder matches
everything under it.

Incremental packs: ``since`` = a time (files modified after it) or earlier manifests (files whose path is
new or whose content differs from the last manifest that lists it). A file an incremental pack replaces
records the earlier content's ``previous_sha256``, so :func:`unpack` updates a file that still holds the
earlier content without ``overwrite``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import re
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Iterator, Optional, Sequence, Union

from .errors import HeadscopeInputError, InputFileExistsError, InputFileNotFoundError
from .runtime import atomic_write_text

FORMAT = "headscope-statepack/1"
MANIFEST_NAME = "state.manifest.json"
PART_PREFIX = "state.part"
#: model weights, checkpoints and unfinished writes: never packed
ALWAYS_LEFT_OUT = ("student.pt", "*.safetensors", "*.bin", "*.ckpt", "checkpoint.pt", "checkpoint", "checkpoint.tmp",
                   "checkpoint.old", "*.tmp")
_CHUNK = 1 << 20

PathLike = Union[str, "os.PathLike[str]"]
Since = Union[None, float, int, PathLike, Sequence[PathLike]]


class PackTooLargeError(HeadscopeInputError):
    """The selected files need more parts than allowed. ``.parts`` and ``.archive_bytes`` say how many / how large."""

    def __init__(self, msg: str, parts: int, archive_bytes: int, max_parts: int, max_part_bytes: int) -> None:
        super().__init__(msg)
        self.parts, self.archive_bytes, self.max_parts, self.max_part_bytes = parts, archive_bytes, max_parts, max_part_bytes


class UnpackConflictError(InputFileExistsError):
    """Files of the run folder differ from the packed ones (``.conflicts``: their relative paths)."""

    def __init__(self, msg: str, conflicts: list[str]) -> None:
        super().__init__(msg)
        self.conflicts = conflicts


class CorruptPackError(HeadscopeInputError):
    """A part or a packed file does not match the manifest (a copy went wrong), or the archive holds an
    entry that may not be unpacked (a link, an unsafe path, a file the manifest does not list)."""


# ---------------------------------------------------------------------------------------------- patterns
def _glob_regex(pattern: str) -> "re.Pattern[str]":
    out, i, n = [], 0, len(pattern)
    while i < n:
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            j = pattern.index("]", i + 2)
            body = pattern[i + 1:j]
            out.append("[" + ("^" + re.escape(body[1:]) if body.startswith("!") else re.escape(body)) + "]")
            i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _check_pattern(p: str) -> str:
    q = str(p).strip()
    while q.startswith("./"):
        q = q[2:]
    q = q.rstrip("/")
    if not q or q.startswith("/") or ".." in q.split("/"):
        raise HeadscopeInputError(f"pattern {p!r}: give a glob relative to the run folder (no leading '/', no '..'), "
                                  "e.g. 'cells/**' or 'seed1'")
    return q


def matches(path: str, pattern: str) -> bool:
    """Whether the relative POSIX ``path`` is selected by ``pattern`` (see the module docstring: a pattern
    without '/' matches any component; with '/' it matches from the root, a folder matching selects all below).

    Raises:
        HeadscopeInputError (a ValueError): an empty or absolute pattern, or one with '..'.
    """
    q = _check_pattern(pattern)
    rx = _glob_regex(q)
    parts = path.split("/")
    if "/" not in q:
        return any(rx.fullmatch(c) for c in parts)
    return any(rx.fullmatch("/".join(parts[:k])) for k in range(1, len(parts) + 1))


# ---------------------------------------------------------------------------------------------- pack
def _walk(root: Path, skip: Optional[Path]) -> tuple[list[str], list[str]]:
    """(regular files, symbolic links) under ``root`` as sorted relative POSIX paths; ``skip`` (a folder
    inside ``root``) is not entered."""
    files, links = [], []
    for d, dirs, names in os.walk(root, followlinks=False):
        dp = Path(d)
        keep = []
        for x in sorted(dirs):
            p = dp / x
            if p.is_symlink():
                links.append(p.relative_to(root).as_posix())
            elif skip is None or p.resolve() != skip:
                keep.append(x)
        dirs[:] = keep
        for x in names:
            p = dp / x
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                links.append(rel)
            elif p.is_file():
                files.append(rel)
    return sorted(files), sorted(links)


def _load_manifest(where: PathLike) -> dict[str, Any]:
    p = Path(where)
    f = p / MANIFEST_NAME if p.is_dir() else p
    if not f.is_file():
        raise InputFileNotFoundError(f"no state manifest at {f}: give the folder of an earlier pack (it holds {MANIFEST_NAME})")
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CorruptPackError(f"{f} is not a readable state manifest ({e})") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptPackError(f"{f} is not a {FORMAT} manifest (format {m.get('format') if isinstance(m, dict) else None!r})")
    return m


def _since_filter(since: Since) -> tuple[Optional[float], Optional[dict[str, str]], Optional[dict[str, Any]]]:
    """(mtime threshold, {path: sha256 of its last listing}, manifest record) of ``since``."""
    if since is None:
        return None, None, None
    if isinstance(since, (int, float)) and not isinstance(since, bool):
        if not math.isfinite(float(since)):
            raise HeadscopeInputError(f"since={since}: give a time in seconds since the epoch, or earlier manifests")
        return float(since), None, {"modified_after": float(since)}
    items = [since] if isinstance(since, (str, os.PathLike)) else list(since)
    if not items:
        raise HeadscopeInputError("since=[]: give a time in seconds since the epoch, or at least one earlier manifest")
    prev: dict[str, str] = {}
    shas = []
    for it in items:
        m = _load_manifest(it)
        shas.append(hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest())
        for e in m["files"]:
            prev[e["path"]] = e["sha256"]
    return None, prev, {"manifests_sha256": shas}


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 else f"{n} bytes"


def pack(run_dir: PathLike, out_dir: PathLike, *, include: Optional[Sequence[str]] = None, exclude: Sequence[str] = (),
         since: Since = None, max_part_bytes: int = 15 * 2**20, max_parts: int = 7, compress: bool = True) -> dict[str, Any]:
    """Pack the files of ``run_dir`` into ``out_dir``/state.partNN (each at most ``max_part_bytes`` bytes) and
    ``out_dir``/state.manifest.json (see the module docstring). Earlier ``state.part*`` files and manifest in
    ``out_dir`` are replaced; ``out_dir`` may lie inside ``run_dir`` (it is not packed).

    Args:
        run_dir: the folder to pack.
        out_dir: where the parts and the manifest go (created).
        include: glob patterns; when given, only files matching one of them are packed.
        exclude: glob patterns left out besides :data:`ALWAYS_LEFT_OUT` (rebuildable files).
        since: a time (seconds since the epoch: files modified after it), or one or more earlier manifests
            (a manifest file or the folder holding it: files new or changed since the last listing).
        max_part_bytes: bytes per part (default 15 MiB).
        max_parts: most parts allowed.
        compress: gzip the tar (level 6).

    Returns:
        The manifest (as written): ``files`` [{path, size, sha256[, previous_sha256]}], ``parts`` [{name, size,
        sha256}], ``archive_bytes``, ``files_bytes``, ``left_out`` {reason: {files, bytes}}, ``links``.

    Raises:
        InputFileNotFoundError: ``run_dir`` is not a folder; a ``since`` manifest is missing.
        HeadscopeInputError (a ValueError): ``max_part_bytes`` or ``max_parts`` below 1, a bad pattern or ``since``,
            ``out_dir`` that is ``run_dir``.
        PackTooLargeError: the archive needs more than ``max_parts`` parts (nothing is written): pack less at a
            time with ``include`` or ``since``, or allow more parts.
        CorruptPackError: a ``since`` manifest that is not one.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise InputFileNotFoundError(f"run folder {root} does not exist: give the --out folder of the run")
    if int(max_part_bytes) < 1 or int(max_parts) < 1:
        raise HeadscopeInputError(f"max_part_bytes={max_part_bytes}, max_parts={max_parts}: both must be at least 1")
    max_part_bytes, max_parts = int(max_part_bytes), int(max_parts)
    inc = [_check_pattern(p) for p in ([include] if isinstance(include, str) else include)] if include else None
    exc = [_check_pattern(p) for p in ([exclude] if isinstance(exclude, str) else exclude)]
    after, prev, since_rec = _since_filter(since)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    out_abs = out.resolve()
    if out_abs == root.resolve():
        raise HeadscopeInputError(f"out_dir {out} is the run folder: pack into another folder (a subfolder is fine)")
    inside = out_abs != root.resolve() and root.resolve() in out_abs.parents
    files, links = _walk(root, out_abs if inside else None)

    left: dict[str, dict[str, int]] = {}

    def leave(reason: str, size: int) -> None:
        r = left.setdefault(reason, {"files": 0, "bytes": 0})
        r["files"] += 1
        r["bytes"] += size

    entries: list[dict[str, Any]] = []
    tmp = out / f".state.archive.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as raw:
            gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) if compress else None
            with tarfile.open(fileobj=gz if gz is not None else raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for rel in files:
                    p = root / rel
                    size = p.stat().st_size
                    if any(matches(rel, q) for q in ALWAYS_LEFT_OUT):
                        leave("weights_or_checkpoints", size)
                        continue
                    if any(matches(rel, q) for q in exc):
                        leave("excluded", size)
                        continue
                    if inc is not None and not any(matches(rel, q) for q in inc):
                        leave("not_included", size)
                        continue
                    if after is not None and p.stat().st_mtime <= after:
                        leave("not_modified_since", size)
                        continue
                    data = p.read_bytes()
                    sha = hashlib.sha256(data).hexdigest()
                    e: dict[str, Any] = {"path": rel, "size": len(data), "sha256": sha}
                    if prev is not None:
                        if prev.get(rel) == sha:
                            leave("unchanged_since", len(data))
                            continue
                        if rel in prev:
                            e["previous_sha256"] = prev[rel]
                    ti = tarfile.TarInfo(rel)
                    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
                    tar.addfile(ti, io.BytesIO(data))
                    entries.append(e)
            if gz is not None:
                gz.close()
        total = tmp.stat().st_size
        n_parts = max(1, math.ceil(total / max_part_bytes))
        if n_parts > max_parts:
            raise PackTooLargeError(
                f"the state of {root} is {_size(total)} packed ({len(entries)} files, "
                f"{_size(sum(e['size'] for e in entries))}): {n_parts} parts of at most {max_part_bytes} bytes, "
                f"more than max_parts={max_parts}. Pack less at a time: include=[patterns] for one part of the folder "
                f"(e.g. 'seed0', 'cells'), or since=<the last manifest> for what changed since; or allow more parts",
                n_parts, total, max_parts, max_part_bytes)
        for old in out.glob(PART_PREFIX + "*"):
            old.unlink()
        if (out / MANIFEST_NAME).exists():
            (out / MANIFEST_NAME).unlink()
        parts = []
        with open(tmp, "rb") as f:
            for k in range(n_parts):
                chunk = f.read(max_part_bytes)
                name = f"{PART_PREFIX}{k:02d}"
                (out / name).write_bytes(chunk)
                parts.append({"name": name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    finally:
        if tmp.exists():
            tmp.unlink()
    manifest = {"format": FORMAT, "archive": "tar.gz" if compress else "tar", "archive_bytes": total,
                "files_bytes": sum(e["size"] for e in entries), "n_files": len(entries), "files": entries, "parts": parts,
                "max_part_bytes": max_part_bytes, "include": inc, "exclude": list(ALWAYS_LEFT_OUT) + exc, "since": since_rec,
                "left_out": dict(sorted(left.items())), "links": links}
    atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------- unpack
class _Parts(io.RawIOBase):
    """The parts read one after the other as one stream."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._paths, self._k, self._f = list(paths), 0, None

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self._k < len(self._paths):
            if self._f is None:
                self._f = open(self._paths[self._k], "rb")
            n = self._f.readinto(b)
            if n:
                return n
            self._f.close()
            self._f, self._k = None, self._k + 1
        return 0

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        super().close()


def _safe_rel(path: Any) -> PurePosixPath:
    s = path if isinstance(path, str) else ""
    p = PurePosixPath(s)
    if (not s or "\\" in s or "\x00" in s or p.is_absolute() or any(c in ("..", ".", "") for c in s.split("/"))):
        raise CorruptPackError(f"unsafe path {path!r} in the state pack (absolute, '..', empty or odd characters): refused")
    return p


def _listing(paths: Sequence[str]) -> str:
    return ", ".join(paths[:5]) + (", …" if len(paths) > 5 else "")


def _sha_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _members(parts: Sequence[Path], archive: str) -> Iterator[tuple[tarfile.TarInfo, Optional[BinaryIO]]]:
    stream = io.BufferedReader(_Parts(parts), buffer_size=_CHUNK)
    try:
        with tarfile.open(fileobj=stream, mode="r|gz" if archive == "tar.gz" else "r|") as tar:
            for m in tar:
                yield m, (tar.extractfile(m) if m.isreg() else None)
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as e:
        raise CorruptPackError(f"the state pack's archive cannot be read ({e}): copy the parts again") from e
    finally:
        stream.close()


def _check_dest(root: Path, rel: PurePosixPath) -> Path:
    """``root/rel`` after checking that no existing component below ``root`` is a link or a non-folder."""
    cur = root
    for c in rel.parts[:-1]:
        cur = cur / c
        if cur.is_symlink() or (cur.exists() and not cur.is_dir()):
            raise CorruptPackError(f"{cur} is a link or not a folder: refused to unpack {rel} through it")
    dest = root / rel
    if dest.is_symlink() or (dest.exists() and not dest.is_file()):
        raise CorruptPackError(f"{dest} is a link or a folder: refused to replace it with a packed file")
    return dest


def unpack(parts_dir: PathLike, run_dir: PathLike, *, overwrite: bool = False) -> dict[str, Any]:
    """Restore the files of a :func:`pack` in ``parts_dir`` into ``run_dir`` (created). Nothing is written
    unless every part and every file matches the manifest's size and SHA-256 and no file conflicts.

    A file already there with the packed content is left as it is (so unpacking twice changes nothing); one
    holding the ``previous_sha256`` of an incremental pack is updated; any other existing file is a conflict.

    Args:
        parts_dir: the folder with state.manifest.json and the parts.
        run_dir: the run folder to restore into.
        overwrite: replace conflicting files instead of refusing.

    Returns:
        {"files": packed files, "written": new files, "updated": files replaced, "same": files already
        identical, "bytes": bytes written}.

    Raises:
        InputFileNotFoundError: no manifest or a missing part.
        CorruptPackError: a part or file whose size or SHA-256 differs from the manifest; an absolute path, a
            path with '..', a link or any non-regular entry, or an entry the manifest does not list; a path
            that would go through or replace a link or a folder in ``run_dir``.
        UnpackConflictError (an InputFileExistsError): an existing file with other content and ``overwrite``
            False (nothing written).
    """
    src, root = Path(parts_dir), Path(run_dir)
    if not (src / MANIFEST_NAME).is_file():
        raise InputFileNotFoundError(f"no {MANIFEST_NAME} in {src}: give the folder holding the parts of a state pack")
    m = _load_manifest(src)
    want: dict[str, dict[str, Any]] = {}
    for e in m["files"]:
        rel = _safe_rel(e.get("path"))
        if str(rel) in want:
            raise CorruptPackError(f"{rel} is listed twice in {src / MANIFEST_NAME}")
        want[str(rel)] = e
    paths = []
    for part in m["parts"]:
        name = part.get("name", "")
        if not re.fullmatch(re.escape(PART_PREFIX) + r"\d{2,}", str(name)):
            raise CorruptPackError(f"part name {name!r} in {src / MANIFEST_NAME} is not a state part name")
        p = src / name
        if not p.is_file():
            raise InputFileNotFoundError(f"part {p} is missing ({len(m['parts'])} parts in the manifest): copy every part")
        size, sha = p.stat().st_size, _sha_file(p)
        if size != part["size"] or sha != part["sha256"]:
            raise CorruptPackError(f"part {p} is corrupt: {size} bytes, sha256 {sha[:16]}…; the manifest says {part['size']} "
                                   f"bytes, {part['sha256'][:16]}…: copy the parts again")
        paths.append(p)
    # what each file will do, before anything is read or written
    root.mkdir(parents=True, exist_ok=True)
    plan: dict[str, str] = {}
    conflicts = []
    for rel, e in want.items():
        dest = _check_dest(root, PurePosixPath(rel))
        if not dest.exists():
            plan[rel] = "write"
            continue
        have = _sha_file(dest)
        if have == e["sha256"]:
            plan[rel] = "same"
        elif have == e.get("previous_sha256") or overwrite:
            plan[rel] = "update"
        else:
            conflicts.append(rel)
            plan[rel] = "update"
    if conflicts:
        raise UnpackConflictError(
            f"{len(conflicts)} file(s) in {root} differ from the packed ones ({_listing(conflicts)}): nothing unpacked; "
            "pass overwrite=True to replace them, or unpack into another folder", conflicts)
    # pass 1: every entry is a listed regular file with the manifest's content
    seen = set()
    for mem, f in _members(paths, m.get("archive", "tar.gz")):
        if not mem.isreg() or f is None:
            raise CorruptPackError(f"entry {mem.name!r} of the state pack is not a regular file (a link, folder or device): refused")
        rel = str(_safe_rel(mem.name))
        if rel not in want or rel in seen:
            raise CorruptPackError(f"entry {rel!r} of the state pack is {'repeated' if rel in seen else 'not in the manifest'}: refused")
        seen.add(rel)
        h, n = hashlib.sha256(), 0
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
            n += len(chunk)
        if n != want[rel]["size"] or h.hexdigest() != want[rel]["sha256"]:
            raise CorruptPackError(f"packed file {rel} does not match the manifest ({n} bytes, sha256 {h.hexdigest()[:16]}…): "
                                   "copy the parts again")
    missing = sorted(set(want) - seen)
    if missing:
        raise CorruptPackError(f"{len(missing)} file(s) of the manifest are not in the archive ({', '.join(missing[:5])}): "
                               "copy the parts again")
    # pass 2: write
    counts = {"files": len(want), "written": 0, "updated": 0, "same": 0, "bytes": 0}
    for mem, f in _members(paths, m.get("archive", "tar.gz")):
        rel = str(_safe_rel(mem.name))
        action = plan[rel]
        if action == "same":
            counts["same"] += 1
            continue
        dest = _check_dest(root, PurePosixPath(rel))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.unpack")
        assert f is not None
        with open(tmp, "wb") as g:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                g.write(chunk)
        os.replace(tmp, dest)
        counts["written" if action == "write" else "updated"] += 1
        counts["bytes"] += want[rel]["size"]
    return counts


__all__ = ["ALWAYS_LEFT_OUT", "CorruptPackError", "MANIFEST_NAME", "PackTooLargeError", "UnpackConflictError", "matches", "pack",
           "unpack"]
