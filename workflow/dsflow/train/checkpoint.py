"""Checkpoints in checkpoints/: DeepSpeed's own format, one tag per saved step, `latest` marker.

A checkpoint is only resumed when the run it came from trained the same thing: `fingerprint`
hashes every param that changes the math (model, data, global batch, optimizer, schedule shape),
but not the budget, so raising max_steps continues a run while changing lr starts a new one. The
number of ranks is not part of it either: a run resumes on another world size with the same
global batch (elastic resume): `to_universal` converts the checkpoint to DeepSpeed's universal
format, which every world size can load.

Saving is atomic (see docs/reliability.md). DeepSpeed's `save_checkpoint(dir, tag)` writes the tag
directory rank by rank and then `latest`, with no barrier in between: a kill at the wrong moment
leaves `latest` naming a torn tag. dsflow saves into a temporary tag (`.tmp-stepNNNNNNNN`), and
only after every rank has finished does rank 0 write a manifest (`dsflow_checkpoint.json`: every
file, its size and its xxh3-128 content hash, which the ranks' checkpoint engine took while
writing: dsflow.train.ckptengine), fsync, rename the temp tag to its final name and atomically
replace `latest`. So a `stepNNNNNNNN` directory is complete by construction; resume still
validates it (`validate_tag`; the train stage checks the content hashes too) and falls back to
the newest intact tag when the one `latest` names is not.

The files are data, never code: the ranks load them weights-only (dsflow.safeload). A tag they
cannot load anyway (pickled code, damage in a file without a hash, another model's shapes) ends
the run in one line and is marked (`UNLOADABLE`), so that the next run resumes from the one
before instead of failing the same way.

The ranks save with `save` and resume with `resume`; the rest of this module is what the train
stage needs to pick, check and convert a tag.

`checkpoints/.lock` (flock) is held by the train stage for its whole run: two runs never write
the same checkpoints. `checkpoints/.stop` asks the ranks to checkpoint and stop at the next step
boundary (what the train stage does on SIGTERM / SIGINT).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dsflow import launch, safeload
from dsflow.atomic import atomic_file, fsync_dir
from dsflow.errors import UsageError
from dsflow.params import fp8_on
from dsflow.paths import CHECKPOINTS
from dsflow.train.health import EXIT_FATAL, report_fatal

TAG_PREFIX = "step"
TEMP_PREFIX = ".tmp-"
MANIFEST = "dsflow_checkpoint.json"
HASHES = safeload.HASH  # the manifest's key for every file's content hash
# Written into a tag that the ranks failed to load: it is never picked again.
UNLOADABLE = "dsflow_unloadable.txt"
MODEL_FILE = "mp_rank_00_model_states.pt"
# ZeRO-3 saves one model-states file per rank instead of MODEL_FILE.
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
UNIVERSAL = "universal"  # a tag's universal-format copy, for resuming on another world size
LOCK_FILE = ".lock"
STOP_FILE = ".stop"
ZERO_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")

# Params that may change between a run and its resumption.
RESUMABLE_KEYS = {
    "max_steps",
    "max_tokens",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    "async_checkpoints",
    "log_every",
    "peak_tflops",
    "launcher",
    "master_port",
    "force",
    "max_bad_steps",
    "keep_previous_runs",
    "collective_timeout_s",  # when a hang is declared, not what the ranks compute
    "perf",  # fast paths change speed, not the math (but train.perf.fp8: see fingerprint)
    # where the ranks run, not what they compute
    "nodes",
    "node_rank",
    "master_addr",
    "rdzv_id",
    "hostfile",
    "threads_per_rank",
    # How the global batch is split over ranks does not change the math (the fingerprint
    # holds the global batch itself): these may change for an elastic resume.
    "gpus",
    "device",
    "micro_batch",
    "grad_accum",
    "global_batch",
}


def fingerprint(params: dict, global_batch: int, data_sha: str) -> str:
    train = {k: v for k, v in params["train"].items() if k not in RESUMABLE_KEYS}
    # Bucket sizes, overlap and ZeRO-3 prefetch knobs, pinned memory and the NVMe path change
    # speed, not the math; the ZeRO stage and what is offloaded stay (checkpoint layout).
    train.pop("zero", None)
    if isinstance(train.get("offload"), dict):
        train["offload"] = {k: train["offload"].get(k) for k in ("optimizer", "param")}
    # FP8 matmuls round differently from bf16 ones: a run resumes in the precision it trained
    # in. Only when on, so that every run without it keeps its fingerprint.
    perf = params["train"].get("perf") or {}
    for key, _ in fp8_on(perf):
        train[key] = perf[key]
    blob = json.dumps(
        {
            "seed": params["seed"],
            "model": params["model"],
            "train": train,
            "global_batch": global_batch,
            "data": data_sha,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def step_of(tag: str) -> int:
    return int(tag[len(TAG_PREFIX) :])


def temp_tag(tag: str) -> str:
    """Where a checkpoint is written before it is complete (never picked up by resume)."""
    return f"{TEMP_PREFIX}{tag}"


def tags(root: Path = CHECKPOINTS) -> list[str]:
    found = root.glob(f"{TAG_PREFIX}*")
    return sorted(p.name for p in found if p.is_dir() and p.name[len(TAG_PREFIX) :].isdigit())


def latest_tag(root: Path = CHECKPOINTS) -> str | None:
    """The tag `latest` names, if that directory exists (not validated: see `resume_tag`)."""
    marker = root / "latest"
    try:
        tag = marker.read_text().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    return tag if tag and (root / tag).is_dir() else None


def _structure_problem(names: set[str], world: int | None, zero: bool | None) -> str | None:
    model_ranks = {int(m.group(1)) for n in names if (m := ZERO3_MODEL_FILE.match(n))}
    if MODEL_FILE not in names and not model_ranks:
        return f"{MODEL_FILE} missing"
    if model_ranks and world is not None:
        missing = sorted(set(range(world)) - model_ranks)
        if missing:
            return f"model states of rank(s) {', '.join(map(str, missing))} missing"
    ranks = {int(m.group(1)) for n in names if (m := ZERO_FILE.match(n))}
    if world is not None and (ranks or zero):
        missing = sorted(set(range(world)) - ranks)
        if missing:
            return f"optimizer state of rank(s) {', '.join(map(str, missing))} missing"
    return None


def validate_tag(
    root: Path,
    tag: str,
    world: int | None = None,
    zero: bool | None = None,
    elastic: bool = False,
    content: bool = False,
) -> str | None:
    """None when `root/tag` is a complete checkpoint, else what is wrong with it.

    Complete: its manifest lists files that all exist with their recorded sizes (`content`: and
    their content hashes, which reads every file; a manifest of an older dsflow has none), it
    was not marked unloadable by a run that tried (UNLOADABLE), and the layout
    is DeepSpeed's (mp_rank_00_model_states.pt, or ZeRO-3's zero_pp_rank_R_..._model_states.pt
    per rank R, plus one zero_pp_rank_R_..._optim_states.pt per rank R when the optimizer is
    partitioned, `zero`). A tag without a manifest (saved by an older dsflow, or by DeepSpeed
    directly) is judged by the layout alone. `elastic`: a tag saved by another number of ranks
    than `world` is fine (judged against its own), as long as its manifest says how many.
    """
    path = root / tag
    if not path.is_dir():
        return "no such directory"
    if (path / UNLOADABLE).exists():
        return f"a run could not load it before (see {tag}/{UNLOADABLE})"
    manifest = path / MANIFEST
    if manifest.exists():
        try:
            info = json.loads(manifest.read_text())
            files = dict(info["files"])
        except (OSError, ValueError, KeyError, TypeError):
            return f"{MANIFEST} unreadable"
        for name, size in sorted(files.items()):
            try:
                actual = (path / name).stat().st_size
            except OSError:
                return f"{name} missing"
            if actual != size:
                return f"{name} is {actual} bytes, the manifest says {size} (truncated)"
        if content:
            problem = _content_problem(path, info.get(HASHES))
            if problem:
                return problem
        if elastic and isinstance(info.get("world"), int):
            world = info["world"]
        if world is not None and info.get("world", world) != world:
            return f"saved by {info.get('world')} rank(s), this run has {world}"
        return _structure_problem(set(files), world, info.get("zero", zero))
    try:
        names = {p.name for p in path.iterdir() if p.is_file() and p.stat().st_size > 0}
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return _structure_problem(names, world, zero)


def _content_problem(path: Path, hashes: Any) -> str | None:
    """The first file of tag `path` whose content hash differs from the manifest's (`hashes`,
    None for a manifest without them), or None."""
    if not isinstance(hashes, dict):
        return None
    for name, digest in sorted(hashes.items()):
        try:
            actual = safeload.file_hash(path / name)
        except OSError as e:
            return f"{name} unreadable ({e.strerror})"
        if actual != digest:
            return f"{name} is corrupted (its content hash differs from the manifest's)"
    return None


def resume_tag(
    root: Path = CHECKPOINTS,
    world: int | None = None,
    zero: bool | None = None,
    note: Callable[[str], None] = lambda msg: None,
    content: bool = False,
) -> str | None:
    """The checkpoint to resume from: the newest complete tag, normally the one `latest` names.

    `note` receives one line whenever the choice differs from `latest` (a torn, damaged or
    missing tag, or a newer complete tag that `latest` was not moved to because the save was
    interrupted between the rename and the `latest` update). `content`: the newest complete
    tags' content hashes are checked too, newest first, until one is intact (what the train
    stage does before launch); `note` names each damaged one.
    """
    named = None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        named = (root / "latest").read_text().strip() or None
    problems, complete = {}, []
    damaged = {tag for tag in tags(root) if (root / tag / UNLOADABLE).exists()}
    for tag in tags(root):
        problem = validate_tag(root, tag, world, zero, elastic=True)
        if problem:
            problems[tag] = problem
        else:
            complete.append(tag)
    while content and complete:
        problem = validate_tag(root, complete[-1], world, zero, elastic=True, content=True)
        if not problem:
            break
        tag = complete.pop()
        problems[tag] = problem
        damaged.add(tag)
        if tag != named:
            note(f"checkpoint {tag} is damaged ({problem}): not resuming from it")
    best = complete[-1] if complete else None
    if named is None:
        if best:
            note(
                f"checkpoints/latest is missing; resuming from {best}, the newest complete checkpoint"
            )
        return best
    if named == best:
        return best
    if named in problems:
        state = "damaged" if named in damaged else "incomplete"
        why = f"{named}, which is {state} ({problems[named]})"
    elif named in complete:
        why = f"{named}, but the newer {best} is complete (a save stopped before moving latest)"
    else:
        why = f"{named}, which does not exist"
    if best:
        note(f"checkpoints/latest names {why}: resuming from {best}")
    else:
        note(f"checkpoints/latest names {why}, and no other checkpoint is complete: starting fresh")
    return best


def saved_world(root: Path, tag: str) -> int | None:
    """The number of ranks that saved `tag` (from its manifest; None when unknown)."""
    try:
        world = json.loads((root / tag / MANIFEST).read_text()).get("world")
    except (OSError, ValueError, AttributeError):
        return None
    return world if isinstance(world, int) else None


def to_universal(root: Path, tag: str) -> str:
    """Convert `tag` to DeepSpeed's universal checkpoint format (every parameter's fp32 weights
    and Adam moments, whole, one folder each) in `tag/universal`, loadable on any world size
    with `checkpoint.load_universal`. Returns the tag to load ("stepNNNNNNNN/universal").
    Atomic (written to a temporary folder, renamed); done once per tag."""
    out = root / tag / UNIVERSAL
    if not (out / "zero").is_dir():
        tmp = root / tag / f"{TEMP_PREFIX}{UNIVERSAL}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dsflow.safeload",  # which runs it with every torch.load weights-only
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(root / tag),
                "--output_folder",
                str(tmp),
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
                "--inject_missing_state",  # tags saved before dsflow marked them (engine._universal)
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")},
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            shutil.rmtree(tmp, ignore_errors=True)
            if proc.returncode == safeload.EXIT_REFUSED:  # a file no run can load
                path, _, reason = last.removeprefix("error: ").partition(": ")
                refused = safeload.CheckpointError(path, reason)
                line = unloadable_line(refused, tag, previous_tag(root, tag, None, None))
                mark_unloadable(root, tag, line)
                raise UsageError(line)
            raise UsageError(
                f"cannot convert checkpoint {tag} to a universal checkpoint for a resume on "
                f"another number of ranks (deepspeed.checkpoint.ds_to_universal: {last}); "
                "resume with the number of ranks that saved it"
            )
        os.rename(tmp, out)
        fsync_dir(root / tag)
    return f"{tag}/{UNIVERSAL}"


def set_latest(root: Path, tag: str) -> None:
    """Point `latest` at `tag` atomically (temp file + fsync + rename + fsync of the directory)."""
    with atomic_file(root / "latest") as f:
        f.write(tag)
    fsync_dir(root)


def write_manifest(
    root: Path, tmp: str, step: int, world: int, zero: bool, hashes: dict | None = None
) -> None:
    """Record every file of the (temporary) tag with its size and content hash, after fsyncing
    each. `hashes` ({name: [size, hash]}) are what the ranks' checkpoint engine hashed while
    writing (dsflow.train.ckptengine); a file it did not write (another checkpoint engine chosen
    in a user's ds_config) is read once more here to be hashed."""
    path = root / tmp
    hashes = hashes or {}
    files, digests = {}, {}
    for file in sorted(path.iterdir()):
        if file.is_file() and file.name != MANIFEST:
            with open(file, "rb") as f:
                os.fsync(f.fileno())
            files[file.name] = file.stat().st_size
            written = hashes.get(file.name)
            if written and written[0] == files[file.name]:
                digests[file.name] = written[1]
            else:
                digests[file.name] = safeload.file_hash(file)
    info = {"step": step, "world": world, "zero": zero, "files": files, HASHES: digests}
    with atomic_file(path / MANIFEST) as f:
        json.dump(info, f, indent=1)
    fsync_dir(path)


def commit(root: Path, tmp: str, tag: str) -> None:
    """Make a fully written temporary tag the checkpoint `tag`: rename, then move `latest`."""
    final = root / tag
    if final.exists():  # the same step saved before (e.g. a resumed run re-saving its last step)
        shutil.rmtree(final)
    os.rename(root / tmp, final)
    fsync_dir(root)
    set_latest(root, tag)


def remove_temp_tags(root: Path = CHECKPOINTS) -> list[str]:
    """Delete temporary tags left by interrupted saves; returns their names."""
    removed = []
    for p in sorted(root.glob(f"{TEMP_PREFIX}{TAG_PREFIX}*")):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed


def prune(root: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` tags (never the one `latest` names)."""
    current = latest_tag(root)
    removed = []
    for tag in tags(root)[:-keep]:
        if tag != current:
            shutil.rmtree(root / tag, ignore_errors=True)
            removed.append(tag)
    return removed


def clear(root: Path = CHECKPOINTS) -> None:
    """Remove the checkpoints of the run in `root` (train.keep_previous_runs: 0, where they
    cannot be moved aside: see `move_aside`)."""
    for tag in tags(root):
        shutil.rmtree(root / tag, ignore_errors=True)
    remove_temp_tags(root)
    (root / "latest").unlink(missing_ok=True)


def tag_bytes(root: Path, tag: str | None) -> int:
    if not tag or not (root / tag).is_dir():
        return 0
    return sum(p.stat().st_size for p in (root / tag).iterdir() if p.is_file())


class RunLock:
    """`checkpoints/.lock`, an exclusive flock held for the whole train stage.

    The file holds the holder's PID (and its launcher's, once started), so a second run can say
    who holds it. The lock dies with the process (and the launcher, which inherits the
    descriptor), so a killed run never leaves a stale lock behind; the file is removed at exit.
    """

    def __init__(self, root: Path = CHECKPOINTS):
        self.path = root / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise UsageError(self._held(holder)) from None
        self.fd = fd
        self.write_holder(str(os.getpid()))
        return self

    def _held(self, holder: str) -> str:
        return (
            f"{self.path} is held by another train run in this directory (PID {holder}); "
            "wait for it to finish or stop it (kill -TERM <pid>), then rerun"
        )

    def holder_line(self) -> str | None:
        """The line `acquire` would refuse with while a live process holds the lock, else None.
        Reads only: probing with a lock of its own could refuse the real holder instead."""
        try:
            holder = self.path.read_text(errors="replace").strip()
            pid = int(holder.split(",")[0])
            os.kill(pid, 0)
        except PermissionError:  # alive, another user's
            pass
        except (OSError, ValueError):  # no file, no PID in it, or the process is gone
            return None
        return self._held(holder)

    def write_holder(self, text: str) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (text + "\n").encode(), 0)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------- the ranks' side
# torch is imported where it is used: the train stage and the command line import this module
# to pick and check tags, and need not load torch for that.


def rng_state() -> dict:
    import torch

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_failure(exc: BaseException, tag: str, previous: str | None, rank: int) -> str | None:
    """The one-line reason a checkpoint write failed, or None when `exc` is not about storage."""
    root = CHECKPOINTS
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    need = max(tag_bytes(root, previous), 16 << 20)
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    no_space = (
        getattr(exc, "errno", None) == errno.ENOSPC
        or "No space left" in reason
        # torch.save reports a full disk as a bare RuntimeError from its zip writer
        or (free is not None and free < need)
    )
    if not no_space and not isinstance(exc, OSError):
        return None
    rerun = f"rerun to resume from {previous}" if previous else "rerun (it starts from step 0)"
    kept = (
        f"the previous checkpoint {previous} is intact"
        if previous
        else "there is no earlier checkpoint"
    )
    if no_space:
        where = f"; {free / 1e6:.0f} MB free in {root}/" if free is not None else ""
        return (
            f"no space left on device while saving checkpoint {tag} (rank {rank}: {reason}{where}); "
            f"{kept}: free space (or lower train.keep_checkpoints) and {rerun}"
        )
    return f"cannot save checkpoint {tag} (rank {rank}: {reason}); {kept}: fix it and {rerun}"


def save(run: Any, spec: Any, step: int, health: dict, faults: Any, last_good: str | None) -> str:
    """Save step `step` on every rank; returns its tag, now the newest complete checkpoint (with
    train.async_checkpoints: the newest one saved, complete once its writer is done: `written`).

    Atomic: every rank writes into a temporary tag; once all are done rank 0 records the
    manifest, renames it to its final name and moves `latest` (`commit`). A write that fails
    for lack of space (or any OSError) ends the run with one line saying what is kept."""
    import torch.distributed as dist

    started = time.perf_counter()  # the pause counts any wait for the save before
    written(run)  # one save in flight at most: the one before is complete first
    tag = tag_for(step)
    tmp = temp_tag(tag)
    # DeepSpeed stores client state from rank 0 only: gather every rank's RNG into it.
    states: list = [None] * spec.world
    dist.all_gather_object(states, rng_state())
    client = {
        "step": step,
        "rng": states,
        "fingerprint": spec.fingerprint,
        "health": health,
        "expert_bias": run.balancer.bias_state(),
    }
    engine = run.engine
    behind = getattr(engine.checkpoint_engine, "write_behind", None)
    faults.disk_full(engine, step)
    try:
        # LoRA: the frozen base comes from model.pretrained again on resume, so a checkpoint
        # holds the adapters (and their optimizer states) alone.
        engine.save_checkpoint(
            str(CHECKPOINTS),
            tag=tmp,
            client_state=client,
            save_latest=False,
            exclude_frozen_parameters=spec.lora_on,
        )
        if behind is not None:
            engine.checkpoint_engine.in_flight = (tag, last_good)
            behind(lambda hashes: _publish(run, spec, step, hashes, faults, started))
            _log_save(run, tag, started, "training paused", "; writing in the background")
            return tag
        faults.in_save(step)
        # Every rank's files are written once this returns (it replaces a barrier): rank 0
        # records the hashes each rank took while writing.
        hashes: list = [None] * spec.world
        dist.all_gather_object(hashes, getattr(engine.checkpoint_engine, "take_hashes", dict)())
        if run.rank == 0:
            _commit_step(run, spec, step, {k: v for part in hashes for k, v in part.items()})
    except (OSError, RuntimeError) as e:
        _end_if_storage(e, tag, last_good, run.rank)
    dist.barrier()
    _log_save(run, tag, started, "saved in")
    return tag


def _commit_step(run: Any, spec: Any, step: int, hashes: dict) -> None:
    """Rank 0, once every rank's files of `step` are written: manifest, commit, prune."""
    tmp, tag = temp_tag(tag_for(step)), tag_for(step)
    zero = bool(run.engine.save_zero_checkpoint)
    write_manifest(CHECKPOINTS, tmp, step, spec.world, zero, hashes)
    commit(CHECKPOINTS, tmp, tag)
    prune(CHECKPOINTS, spec.keep_checkpoints)


def _log_save(run: Any, tag: str, started: float, what: str, then: str = "") -> None:
    if run.rank == 0:
        took = time.perf_counter() - started
        print(f"[dsflow train] checkpoint {tag}: {what} {took:.2f} s{then}", file=sys.stderr)


def _end_if_storage(
    e: BaseException, tag: str, previous: str | None, rank: int, why: str | None = None
) -> None:
    """A write that failed for lack of space (or any OSError) ends the run in one line (`why`:
    the reason it was ending anyway, kept in the line); other errors go on up."""
    message = save_failure(e, tag, previous, rank)
    if message is None:
        raise e
    if why:
        message = f"{message} (the run was stopping: {why})"
    # The other ranks wait in a barrier (or for this rank's files) for this one: leave now, so
    # that they fail fast (their peer is gone) and the launcher stops them.
    report_fatal(message)
    sys.stderr.flush()
    os._exit(EXIT_FATAL)


# Asynchronous saves (train.async_checkpoints): each rank's writer thread, done with its files,
# leaves its hashes in the temporary tag as `.written-rank<R>.json`; rank 0's writer waits for
# every rank's and commits. No collective runs in a writer thread: the training's own go on.
WRITTEN_PREFIX = ".written-rank"
WRITTEN_POLL_S = 0.02


def _publish(run: Any, spec: Any, step: int, hashes: dict, faults: Any, started: float) -> None:
    """In this rank's writer thread, once its files of `step` are written."""
    path = CHECKPOINTS / temp_tag(tag_for(step))
    faults.in_save(step)
    with atomic_file(path / f"{WRITTEN_PREFIX}{run.rank}.json") as f:
        json.dump(hashes, f)
    if run.rank != 0:
        return
    marks = [path / f"{WRITTEN_PREFIX}{r}.json" for r in range(spec.world)]
    patience = max(launch.PATIENT_TIMEOUT_S, launch.collective_timeout_s())  # as a save in the step
    deadline = time.monotonic() + patience
    while missing := [r for r, m in enumerate(marks) if not m.exists()]:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank(s) {', '.join(map(str, missing))} did not finish writing {path.name} in "
                f"{patience:.0f} s (train.collective_timeout_s, at least {launch.PATIENT_TIMEOUT_S})"
            )
        time.sleep(WRITTEN_POLL_S)
    merged = {}
    for m in marks:
        merged.update(json.loads(m.read_text()))
        m.unlink()
    _commit_step(run, spec, step, merged)
    _log_save(run, tag_for(step), started, "written in")


def written(run: Any, wait: bool = True, why: str | None = None) -> None:
    """With train.async_checkpoints: until the checkpoint being written is complete (`wait`
    False: only when its writer has already finished). A write that failed ends the run in one
    line naming the checkpoint that is kept, as a failed save does (`why`: the reason the run
    was ending anyway, which the line keeps)."""
    ce = run.engine.checkpoint_engine
    if getattr(ce, "thread", None) is None or (not wait and ce.busy):
        return
    tag, previous = ce.in_flight
    try:
        ce.wait()
    except (OSError, RuntimeError) as e:
        _end_if_storage(e, tag, previous, run.rank, why)


def resume(run: Any, spec: Any) -> tuple[int, dict | None]:
    """Load spec.resume into the engine (weights, optimizer, RNG, expert biases); returns the
    step it saved and the run's health state (0 and None for a fresh run).

    Every file is unpickled without running code (dsflow.safeload). A checkpoint that cannot be
    loaded (pickled code, a damaged file, shapes of another model) ends the run with one line
    naming the tag and the file, and is marked so that a rerun resumes from the one before."""
    if not spec.resume:
        return 0, None
    client, error = None, None
    try:
        client = _load(run, spec)
    except Exception as e:  # noqa: BLE001 - whatever the files make DeepSpeed raise
        error = e
    _leave_unless_all_loaded(error, spec, run)
    run.balancer.sync_bias()
    if run.rank == 0:
        saved = len(client["rng"])
        elastic = f" (saved by {saved} ranks)" if saved != spec.world else ""
        print(f"[dsflow train] resumed from step {client['step']}{elastic}", file=sys.stderr)
    return client["step"], client.get("health")


# --------------------------------------------------------------------------- earlier runs
# A params change that starts a new run keeps the run it replaces: `move_aside` moves its tags,
# `latest`, run.json and ds_config.json into previous/<fingerprint>-step<N>/, where neither
# `tags` nor `resume_tag` looks; `bring_back` returns one when its params are restored.
# Entries move one rename each into a hidden staging folder, which one rename then names (or,
# bringing back, one rename hides the folder first), so a run is visible in one place only; a
# kill in between is finished by `finish_moves` at the next start.

PREVIOUS = "previous"
MOVING = ".moving-"
RESTORING = ".restoring-"
RUN_FILES = ("latest", "run.json", "ds_config.json")


def run_entries(root: Path) -> list[str]:
    """The names in `root` that make up the run it holds: its tags and the files naming it."""
    return tags(root) + [name for name in RUN_FILES if (root / name).is_file()]


def _move_entries(src: Path, dst: Path, names: list[str]) -> None:
    for name in names:
        os.rename(src / name, dst / name)
    fsync_dir(src)
    fsync_dir(dst)


def previous_runs(root: Path = CHECKPOINTS) -> list[str]:
    """The moved-aside runs in previous/, oldest first (by when they were moved)."""
    folder = root / PREVIOUS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return [p.name for p in sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))]


def previous_name(root: Path, fingerprint: str | None) -> str:
    """`<fingerprint>-step<N>`: the run and its newest step; a free name in previous/."""
    newest = tags(root)[-1]
    base = f"{fingerprint or 'unknown'}-{TAG_PREFIX}{step_of(newest)}"
    name, n = base, 1
    while (root / PREVIOUS / name).exists() or (root / PREVIOUS / f"{MOVING}{name}").exists():
        n += 1
        name = f"{base}.{n}"
    return name


def move_aside(root: Path, fingerprint: str | None) -> str | None:
    """Move the run in `root` into previous/<fingerprint>-step<N>/; returns that path relative
    to `root` (None when `root` holds no checkpoint). OSError when it cannot be moved."""
    if not tags(root):
        return None
    name = previous_name(root, fingerprint)
    folder = root / PREVIOUS
    folder.mkdir(exist_ok=True)
    staging = folder / f"{MOVING}{name}"
    staging.mkdir()
    _move_entries(root, staging, run_entries(root))
    os.rename(staging, folder / name)
    fsync_dir(folder)
    # The folder's time says when the run was moved aside: retention removes the oldest.
    os.utime(folder / name)
    return f"{PREVIOUS}/{name}"


def bring_back(root: Path, name: str) -> None:
    """Move previous/`name` back into `root` (which holds no run: see `move_aside`)."""
    folder = root / PREVIOUS
    hidden = folder / f"{RESTORING}{name}"
    os.rename(folder / name, hidden)
    fsync_dir(folder)
    _move_entries(hidden, root, sorted(p.name for p in hidden.iterdir()))
    hidden.rmdir()
    fsync_dir(folder)


def finish_moves(root: Path = CHECKPOINTS) -> list[str]:
    """Finish what a killed `move_aside` or `bring_back` left half done; returns the runs'
    names."""
    folder = root / PREVIOUS
    if not folder.is_dir():
        return []
    done = []
    for staging in sorted(folder.glob(f"{MOVING}*")):
        name = staging.name[len(MOVING) :]
        _move_entries(root, staging, run_entries(root))
        os.rename(staging, folder / name)
        done.append(name)
    for hidden in sorted(folder.glob(f"{RESTORING}*")):
        _move_entries(hidden, root, sorted(p.name for p in hidden.iterdir()))
        hidden.rmdir()
        done.append(hidden.name[len(RESTORING) :])
    fsync_dir(folder)
    return done


def kept_run(root: Path, fingerprint: str) -> str | None:
    """The newest moved-aside run of this fingerprint, by its newest step."""
    runs = [n for n in previous_runs(root) if n.startswith(f"{fingerprint}-{TAG_PREFIX}")]
    steps = {n: int(re.sub(r"\D.*", "", n.split(f"-{TAG_PREFIX}", 1)[1]) or 0) for n in runs}
    return max(runs, key=lambda n: (steps[n], n)) if runs else None


def drop_previous(root: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` moved-aside runs; returns the names removed."""
    runs = previous_runs(root)
    removed = runs[: max(len(runs) - keep, 0)]
    for name in removed:
        shutil.rmtree(root / PREVIOUS / name)
    return removed


def _load(run: Any, spec: Any) -> dict:
    """spec.resume into the engine, weights-only; its client state, RNG and biases applied."""
    with safeload.weights_only():
        _, client = run.engine.load_checkpoint(
            str(CHECKPOINTS), tag=spec.resume, load_module_strict=not spec.lora_on
        )
    if client is None:
        raise ValueError("DeepSpeed found no checkpoint to load")
    from dsflow.train import devicestep  # torch: the ranks' side only

    devicestep.after_load(run.engine.optimizer)
    if len(client["rng"]) == spec.world:
        set_rng_state(client["rng"][run.rank])
    if "expert_bias" in client:
        # A universal checkpoint (another world size) restores parameters only, not the
        # module's buffers: the router biases come from the client state.
        run.balancer.load_bias_state(client["expert_bias"])
    return client


def _peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is another rank's failure (or memory) seen from here, not this rank's
    trouble with the checkpoint's files."""
    import torch
    import torch.distributed as dist

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError, dist.DistError)):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("connection closed by peer", "connection reset", "gloo"))


def _leave_unless_all_loaded(error: BaseException | None, spec: Any, run: Any) -> None:
    """Return when every rank loaded the checkpoint; else leave: a rank that failed says why in
    one line (the first one's wins) and marks the tag unloadable (not for memory or a peer's
    failure).

    ZeRO-0/1/2 ranks read the same files and DeepSpeed runs no collective while loading them:
    there the ranks agree (one all-reduce) whether any failed and all leave together, cleanly
    under the train stage (which prints the line). ZeRO-3 and universal checkpoints are read
    rank by rank between DeepSpeed's collectives, so a rank that failed leaves at once and the
    launcher stops the others (an agreement could meet a peer inside another collective)."""
    import torch
    import torch.distributed as dist

    if error is not None:
        _report_unloadable(error, spec, run.rank)
    agreed = False
    if not spec.zero3 and not spec.resume.endswith(f"/{UNIVERSAL}"):
        try:
            flag = torch.tensor([0 if error is None else 1], device=run.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = True
            if flag.item() and error is None:
                error = RuntimeError("another rank could not load the checkpoint")
        except Exception as e:  # noqa: BLE001 - a peer left in the middle of loading
            error = error or e
    if error is None:
        return
    sys.stderr.flush()
    os._exit(0 if agreed and os.environ.get("DSFLOW_STATUS_FILE") else EXIT_FATAL)


def _report_unloadable(error: BaseException, spec: Any, rank: int) -> None:
    tag = spec.resume.split("/")[0]  # "stepN/universal" was converted from stepN
    if _peer_failure(error):
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        report_fatal(f"rank {rank} stopped while loading checkpoint {tag}: {reason}")
        return
    zero = True if spec.ds_config["zero_optimization"].get("stage", 0) else None
    line = unloadable_line(error, tag, previous_tag(CHECKPOINTS, tag, spec.world, zero))
    mark_unloadable(CHECKPOINTS, tag, line)
    report_fatal(line)


def unloadable_line(exc: BaseException, tag: str, nxt: str | None) -> str:
    """One line: which checkpoint could not be loaded, from which file, and what a rerun does."""
    file = exc.path if isinstance(exc, safeload.CheckpointError) else safeload.last_file
    where = "loading it"
    if file:  # relative to the tag (a universal checkpoint's files are in sub-folders)
        parts = Path(file).parts
        where = "/".join(parts[parts.index(tag) + 1 :]) if tag in parts else file
    if isinstance(exc, safeload.CheckpointError):
        reason = exc.reason
    else:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
    rerun = f"a rerun resumes from {nxt}" if nxt else "a rerun starts from step 0"
    return (
        f"cannot load checkpoint {tag} ({where}: {reason}); it is marked unloadable "
        f"({CHECKPOINTS}/{tag}/{UNLOADABLE}) and {rerun}"
    )


def mark_unloadable(root: Path, tag: str, line: str) -> None:
    """Keep resume_tag from picking `tag` again (the first reason stays)."""
    with contextlib.suppress(OSError):
        fd = os.open(root / tag / UNLOADABLE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")


def previous_tag(root: Path, tag: str, world: int | None, zero: bool | None) -> str | None:
    """The newest complete tag older than `tag` (sizes and layout only)."""
    older = [t for t in tags(root) if t < tag]
    return next((t for t in reversed(older) if not validate_tag(root, t, world, zero, True)), None)
