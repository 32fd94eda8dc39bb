"""Atomic writes: a file or a directory appears whole or not at all.

    write_text_atomic(run_dir / "meta.json", json.dumps(meta))
    tmp = staging_dir(target)          # .NAME.tmp-PID beside the target, stale ones removed
    ...fill tmp...
    publish_dir(tmp, target)           # replaces target; the old one is removed after

    check_target(out, kind="hf", sources=[run], force=force)   # before any work: what may be replaced

Everything ember writes for later use goes through here, so "no partial file where a good
one stood" (DESIGN rule 7) is enforced in one place. A staging file or folder left by a killed
process is recognised by its PID and removed by the next writer in the same folder.

``--force`` replaces only ember's own output of the same kind, in one rule (``check_target``):
a folder ember writes carries a ``.ember`` file naming its kind (older ones are known by files
only ember writes together, ``SIGNS``), a graph or GGUF file by its format. A foreign file, another
kind of output, or the source itself (or a folder holding it, or one inside it) is never
replaced: losing a run to a mistyped path is the one error that cannot be undone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import zipfile
from pathlib import Path

from ember.errors import EmberError

MARKER = ".ember"  # in each folder ember writes: the kind of output it is
SIGNS = {  # folders from before the marker: files that only ember writes together there (any group)
    "run": (("config.yaml", "env.json"), ("model/model_config.json",)),
    "data": (("manifest.json",),),
    "sweep": (("sweep.json",),),
    "comm": (("comm.json",),),
}


def _pt2(path: Path) -> bool:  # a PT2 archive (torch.export.save, AOTInductor packages)
    with zipfile.ZipFile(path) as z:
        return any(name.endswith("/archive_format") for name in z.namelist())


def _onnx(path: Path) -> bool:  # an ONNX ModelProto from torch: ir_version, then producer "pytorch"
    with open(path, "rb") as f:
        head = f.read(32)
    return head[:1] == b"\x08" and b"\x12\x07pytorch" in head


def _gguf(path: Path) -> bool:  # llama.cpp's GGUF: the magic, then a little-endian version
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


FILES = {"pt2": _pt2, "onnx": _onnx, "gguf": _gguf}  # single-file outputs, known by their format
LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<stage>tmp|old)-(?P<pid>\d+)")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temp file beside ``path``, fsync, then rename over ``path``. A folder that
    cannot be written (read-only, full, not ours) is an EmberError naming it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # (on a read-only folder this fails too: keep the first error)
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise EmberError(
                f"cannot write {path} ({e.strerror or e}); copy the run or output to a folder you can write"
            ) from None
        raise


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not os.path.isdir("/proc")  # (with /proc, a missing entry means gone)


def make_dirs(folder: str | os.PathLike) -> Path:
    """``folder`` and its parents, created; an OSError becomes an EmberError naming the path."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EmberError(
            f"cannot create the folder {folder} ({e.strerror or e}); choose a path in a folder you can write"
        ) from None
    return folder


def mark(folder: str | os.PathLike, kind: str) -> Path:
    """Create ``folder`` and mark it as ember's output of ``kind`` (what ``check_target`` reads)."""
    write_text_atomic(make_dirs(folder) / MARKER, kind + "\n")
    return Path(folder)


def output_kind(path: str | os.PathLike) -> str | None:
    """The kind of ember output at ``path``: its marker, a sign, or its file format; else None."""
    path = Path(path)
    if path.is_file():
        return next((kind for kind, known in FILES.items() if _safe(known, path)), None)
    if (path / MARKER).is_file():
        return (path / MARKER).read_text(encoding="utf-8", errors="replace").strip()
    signed = (k for k, groups in SIGNS.items() if any(all((path / f).exists() for f in g) for g in groups))
    return next(signed, None)


def _safe(test, path: Path) -> bool:
    try:
        return bool(test(path))
    except (OSError, zipfile.BadZipFile):
        return False


def check_target(target: str | os.PathLike, *, kind: str, sources=(), force: bool = False) -> Path:
    """Refuse, with nothing touched, to write ``kind`` at ``target`` unless it is absent, empty,
    or (with ``force``) ember's own ``kind`` output; never when it is, holds or sits inside one of
    ``sources``, nor where it cannot be created. Stale staging leftovers beside it are removed."""
    target = Path(target)
    where = target.resolve()
    for source in sources:
        s = Path(source).resolve()
        if where == s or where in s.parents or s in where.parents:
            relation = "is" if where == s else "contains" if where in s.parents else "is inside"
            raise EmberError(
                f"{target} {relation} the source {source}; writing there would destroy it: "
                "choose an output path outside it"
            )
    ancestor = next(p for p in (target, *target.parents) if os.path.lexists(p))
    if ancestor != target and not (ancestor.is_dir() and os.access(ancestor, os.W_OK | os.X_OK)):
        why = "is not a folder" if not ancestor.is_dir() else "is not writable"
        raise EmberError(f"cannot create {target}: {ancestor} {why}; choose another path")
    folder = kind not in FILES
    if ancestor == target and target.is_dir() != folder:
        want = "a folder" if folder else "one file"
        raise EmberError(
            f"{target} is {'a file' if folder else 'a folder'}; {kind} output is {want}: give another path"
        )
    empty = ancestor != target or (not any(target.iterdir()) if folder else target.stat().st_size == 0)
    if not empty:
        found = output_kind(target)
        if found != kind:
            names = sorted(p.name for p in target.iterdir())[:3] if folder else [target.name]
            held = f"ember's {found} output" if found else f"what ember did not write ({', '.join(names)})"
            raise EmberError(
                f"{target} is not an ember {kind} {'directory' if folder else 'file'}: it holds {held}, "
                "so it will not be replaced, even with --force; choose another path or move it away"
            )
        if not force:
            raise EmberError(
                f"{target} exists (ember's {kind} output); pass --force to replace it, or choose another path"
            )
    if target.parent.is_dir():
        sweep_leftovers(target.parent)
    return target


def output_dir(target: str | os.PathLike, *, kind: str, sources=(), force: bool = False) -> Path:
    """``check_target``, then the folder created and marked as ``kind``."""
    return mark(check_target(target, kind=kind, sources=sources, force=force), kind)


def sweep_leftovers(folder: str | os.PathLike, mine: str | None = None) -> None:
    """Remove the staging files and folders (``.NAME.tmp-PID``, ``.NAME.old-PID``) that dead
    processes left in ``folder``; an ``.old`` one whose NAME is missing (killed between the two
    renames of ``publish_dir``) is put back instead. This process's own count as dead only for
    the target named ``mine`` (an earlier attempt): another of its threads may write the rest."""
    for leftover in sorted(Path(folder).glob(".*-*")):
        m = LEFTOVER.fullmatch(leftover.name)
        if m is None or process_alive(int(m["pid"])) and (int(m["pid"]) != os.getpid() or m["name"] != mine):
            continue
        target = leftover.parent / m["name"]
        try:
            if m["stage"] == "old" and not os.path.lexists(target):
                os.replace(leftover, target)
            elif leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        except OSError:
            pass  # another writer got there first


def staging_dir(target: str | os.PathLike) -> Path:
    """A fresh, empty ``.NAME.tmp-PID`` folder beside ``target``, after ``sweep_leftovers``."""
    target = Path(target)
    make_dirs(target.parent)
    sweep_leftovers(target.parent, mine=target.name)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise EmberError(
            f"cannot write in {target.parent} ({e.strerror or e}); choose a path you can write"
        ) from None
    return tmp


def publish_dir(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move a complete staging folder into place, replacing ``target`` if it exists."""
    tmp, target = Path(tmp), Path(target)
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def build_dir(target: str | os.PathLike, fill, kind: str | None = None) -> Path:
    """Call ``fill(tmp)`` on a staging folder beside ``target``, mark it as ``kind`` and publish
    it there; a failure removes the staging folder and leaves ``target`` as it was."""
    tmp = staging_dir(target)
    try:
        fill(tmp)
        if kind:
            mark(tmp, kind)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, target)
    return Path(target)
