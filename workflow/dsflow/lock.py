"""One writer per project folder: the lock every stage holds while it runs.

Each path a stage reads or writes (`paths.STAGE_IO`) has a lock file under `.locks/` (ignored by
git and DVC). A stage holds a shared flock on each path it reads and an exclusive one on each path
it writes, for its whole run, whichever front-end (or hand) started it; they are taken in sorted
path order, so two stages never wait on each other in a cycle. A stage that conflicts is refused
at once, in one line naming the holder (stage, PID, since when). It does not wait: the front-end
that started it (DVC, Snakemake) has already deleted the outputs it is about to write, and a
waiting stage would hold up its pipeline for as long as the other run lasts (a training: hours).
flock dies with the process, so a killed stage never leaves a stale lock; the lock files stay
(removing one while another process opens it would let two processes lock two files).

Each holder names itself in `.locks/<host>-<pid>.json` (removed at exit; a dead PID's is ignored
and cleaned up). At exit the stage checks that its inputs are still the files it started with
(same inode and mtime): DVC and Snakemake delete a stage's outputs before running its command,
before its lock can refuse, so another front-end's rerun of a data stage can delete or rebuild the
data under a running stage. The stage then fails in one line instead of letting its outputs be
recorded as made from data that no longer exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dsflow import launch
from dsflow.atomic import pid_alive
from dsflow.errors import UsageError
from dsflow.paths import LOCKS, STAGE_IO

# How long a refused stage looks for the holder's name (written right after its locks).
HOLDER_WAIT_S = 1.0


class Busy(UsageError):
    """A path another stage holds: one line naming the holder."""

    def __init__(self, line: str, holders: list[dict]):
        super().__init__(line)
        self.holders = holders


def stage_paths(stage: str, params: dict) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """The paths `stage` reads and writes. Of a multi-node training only the stage that prepares
    checkpoints/ (node 0, or the one that starts every node under SLURM) holds the outputs; the
    other nodes' stages hold the inputs only."""
    reads, writes = STAGE_IO.get(stage, ((), ()))
    if stage == "train" and not _holds_train_outputs(params["train"]):
        return reads, ()
    return reads, writes


def _holds_train_outputs(train: dict) -> bool:
    if launch.slurm_fanout(train):
        return True
    if os.environ.get(launch.NODE_TASK_ENV):
        return False
    return launch.node_rank(train) in (None, 0)


def lock_file(path: Path) -> Path:
    return LOCKS / f"{path}.lock"


@contextlib.contextmanager
def hold(stage: str, params: dict) -> Iterator[None]:
    """Hold the stage's locks while the block runs; Busy if another stage holds one of them.
    UsageError at exit if an input was deleted or replaced meanwhile."""
    reads, writes = stage_paths(stage, params)
    paths = sorted(set(reads) | set(writes), key=str)
    if not paths:
        yield
        return
    LOCKS.mkdir(exist_ok=True)
    _forget_dead()
    fds, record = [], LOCKS / f"{socket.gethostname()}-{os.getpid()}.json"
    try:
        for path in paths:
            fds.append(_lock(stage, path, exclusive=path in writes))
        _write_record(record, stage, reads, writes)
        before = {p: _identity(p) for p in reads}
        yield
        changed = [p for p in reads if _identity(p) != before[p]]
        if changed:
            raise UsageError(_changed_line(stage, changed[0]))
    finally:
        record.unlink(missing_ok=True)
        for fd in fds:
            os.close(fd)


def _lock(stage: str, path: Path, exclusive: bool) -> int:
    file = lock_file(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holders = _holders(path, exclusive)
        raise Busy(_busy_line(stage, path, exclusive, holders), holders) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _busy_line(stage: str, path: Path, exclusive: bool, holders: list[dict]) -> str:
    named = "; ".join(
        f"the {h['stage']} stage (PID {h['pid']}{_host(h)}, since {h['since']}) "
        f"{'writes' if str(path) in h['writes'] else 'reads'} it"
        for h in holders
    )
    return (
        f"{path}: in use: {named or 'another dsflow stage holds its lock'}; the {stage} stage "
        f"{'writes' if exclusive else 'reads'} it: let that run finish (or stop it), then rerun "
        f"(locks in {LOCKS}/)"
    )


def _host(holder: dict) -> str:
    return "" if holder["host"] == socket.gethostname() else f" on {holder['host']}"


def _holders(path: Path, exclusive: bool) -> list[dict]:
    """The live stages whose record names `path` in a way that conflicts. A holder writes its
    record right after taking its locks: wait a moment for it."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        found = [
            r
            for r in _records()
            if str(path) in r["writes"] or (exclusive and str(path) in r["reads"])
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _records() -> list[dict]:
    records = []
    for file in sorted(LOCKS.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(file.read_text())
            if record["pid"] != os.getpid() and _alive(record):
                records.append(record)
    return records


def _alive(record: dict) -> bool:
    """Whether a record's process still runs (one on another host: assumed so)."""
    if record["host"] != socket.gethostname():
        return True
    return pid_alive(record["pid"])


def _forget_dead() -> None:
    """Remove the records of stages on this host that were killed (a record is only a name)."""
    for file in LOCKS.glob(f"{socket.gethostname()}-*.json"):
        pid = file.stem.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            file.unlink(missing_ok=True)


def _write_record(record: Path, stage: str, reads, writes) -> None:
    body = {
        "stage": stage,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "reads": [str(p) for p in reads],
        "writes": [str(p) for p in writes],
    }
    tmp = record.with_name(f".{record.name}.tmp")
    tmp.write_text(json.dumps(body, sort_keys=True) + "\n")
    os.replace(tmp, record)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when a path is deleted, replaced (an atomic rebuild, a checkout) or edited."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _changed_line(stage: str, path: Path) -> str:
    what = "deleted" if _identity(path) is None else "replaced"
    return (
        f"{path}: {what} while the {stage} stage ran (by another run, or a front-end that deletes "
        f"a stage's outputs before running it), so what this stage wrote may not match it: rerun "
        f"once that run has finished"
    )
