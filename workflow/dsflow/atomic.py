"""Atomic, deterministic outputs: build in a temp path next to the target, rename when complete.

A stage killed midway leaves only a `.tmp-PID` sibling, never something that looks done; the next
run removes stale temps of the same target before it starts: those whose process is gone (a
concurrent run's temp is its own; the project lock, dsflow.lock, keeps two runs of one stage
apart anyway). Contents are fsynced before the
rename and the parent directory after it, so a power loss cannot leave a renamed but empty
output either. Replacing an existing output swaps the two in one `renameat2(RENAME_EXCHANGE)`
where the kernel has it, so the old output stays in place until the new one takes over.

Test hook: DSFLOW_FAULT_ATOMIC=<name> SIGKILLs the process right before the final rename of the
output called <name> (e.g. `raw`, `tokens`, `shards`): everything is written, nothing is done.
DSFLOW_FAULT_WRITE=<name>:<ERRNO> (e.g. `shards:EDQUOT`) fails the output <name> (a directory or
file) with that errno once its content is written, as a write the disk refuses does.

A write error (OSError) inside either names the output: a file object's write or flush reports
none, and a temp's path is given as the output's (dsflow.errors.disk_error makes it one line).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
from pathlib import Path


def _clear_stale(final: Path) -> None:
    """Remove the temps of `final` left by processes that are gone (killed midway)."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
            continue  # a concurrent run's temp
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(True)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (renames, new files); a no-op where not supported."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fault_before_rename(final: Path) -> None:
    if os.environ.get("DSFLOW_FAULT_ATOMIC") == final.name:
        os.kill(os.getpid(), signal.SIGKILL)


def _fault_write(final: Path) -> None:
    name, _, code = os.environ.get("DSFLOW_FAULT_WRITE", "").partition(":")
    if name == final.name:
        number = getattr(errno, code)
        raise OSError(number, os.strerror(number))  # as a file object's flush reports it


def _name_output(e: OSError, tmp: Path, final: Path) -> None:
    """Name the output in a write error: its temp's path as the output's, or the output when the
    error names no path."""
    if not e.filename:
        e.filename = str(final)
    elif str(e.filename).startswith(str(tmp)):
        e.filename = str(final) + str(e.filename)[len(str(tmp)) :]


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


@contextlib.contextmanager
def atomic_dir(final: str | Path):
    """Yield a fresh temp directory; on success it replaces `final` in one rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        _fault_write(final)
        _fsync_tree(tmp)
        _fault_before_rename(final)
        if final.exists():
            if _exchange(tmp, final):  # tmp now holds the old output
                fsync_dir(final.parent)
                shutil.rmtree(tmp)
            else:
                old = final.parent / f".{final.name}.tmp-old-{os.getpid()}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old)
        else:
            tmp.rename(final)
        fsync_dir(final.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _name_output(e, tmp, final)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(final: str | Path, mode: str = "w"):
    """Yield a file object; on success it replaces `final` in one rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            _fault_write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _name_output(e, tmp, final)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(path)


def write_json(path: str | Path, obj) -> None:
    """JSON with sorted keys and a trailing newline, so equal content is equal bytes; written
    atomically (a kill never leaves half a file)."""
    with atomic_file(path) as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
