"""Atomic writes: a file or a directory appears whole or not at all.

    write_text_atomic(run_dir / "meta.json", json.dumps(meta))
    tmp = staging_dir(target)          # .NAME.tmp-PID beside the target, stale ones removed
    ...fill tmp...
    publish_dir(tmp, target)           # replaces target; the old one is removed after

Everything ember writes for later use goes through here, so "no partial file where a good
one stood" (DESIGN rule 7) is enforced in one place. A staging folder left by a killed
process is recognised by its PID and removed by the next writer of the same target.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temp file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def _leftover_owner_alive(pid: int) -> bool:
    """Whether the process that named a staging folder still runs (our own pid: an earlier
    attempt in this process, so its leftovers are ours to remove)."""
    return pid != os.getpid() and process_alive(pid)


def staging_dir(target: str | os.PathLike) -> Path:
    """A fresh, empty ``.NAME.tmp-PID`` folder beside ``target``; staging folders of dead
    processes for the same target are removed first, and an ``.old-PID`` folder left between
    the two renames of ``publish_dir`` is restored if the target itself is missing."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for leftover in sorted(target.parent.glob(f".{target.name}.*-*")):
        kind, _, pid = leftover.name[len(target.name) + 2 :].partition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or _leftover_owner_alive(int(pid)):
            continue
        if kind == "old" and not target.exists():
            os.replace(leftover, target)
        else:
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move a complete staging folder into place, replacing ``target`` if it exists."""
    tmp, target = Path(tmp), Path(target)
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def build_dir(target: str | os.PathLike, fill) -> Path:
    """Call ``fill(tmp)`` on a staging folder beside ``target``, then publish it there; a
    failure removes the staging folder and leaves ``target`` as it was."""
    tmp = staging_dir(target)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, target)
    return Path(target)
