"""Diagnostics that cost nothing unless an environment variable turns them on: the step profiler
(DSFLOW_PROFILE) and fault injection for the reliability tests (DSFLOW_FAULT_*). `Hooks` is what
the training loop calls; with neither set every call returns at once, but for the heartbeat the
train stage's watchdog reads (dsflow.launch.Heartbeat: a few bytes written to memory)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dsflow.launch import Heartbeat
from dsflow.paths import PROFILE


class StepProfiler:
    """DSFLOW_PROFILE=FIRST:LAST[:PATH] profiles optimizer steps FIRST..LAST on rank 0 with
    torch.profiler. It writes to PATH (default logs/profile.txt): the ops and kernels by their
    time on the device, device busy time against wall time per step, device time per step by
    kernel kind (KERNEL_KINDS), and where the device waited (idle time per phase of the step:
    data, forward, backward, optimizer step, sync, bookkeeping; the stop check and checkpoint
    saves between steps are in none). The chrome trace goes beside it (PATH + .trace.json.gz).
    For docs/performance.md."""

    PHASES = ("data", "forward", "backward", "optimizer", "sync", "bookkeeping")

    def __init__(self, first: int | None, last: int | None, path: str, device_type: str):
        self.first, self.last, self.path = first, last, Path(path)
        self.device_type = device_type
        self.prof = None
        self.open = None
        self.t0 = 0.0

    def mark(self, phase: str | None) -> None:
        """The step enters `phase` (None: leaves the last one); seen by the profiler only."""
        if self.prof is None:
            return
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None
        if phase is not None:
            self.open = torch.profiler.record_function(f"dsflow/{phase}")
            self.open.__enter__()

    @classmethod
    def from_env(cls, rank: int, device_type: str) -> StepProfiler:
        spec = os.environ.get("DSFLOW_PROFILE", "")
        if rank != 0 or not spec:
            return cls(None, None, "", device_type)
        first, last, *rest = spec.split(":", 2)
        return cls(int(first), int(last), rest[0] if rest else str(PROFILE), device_type)

    def step_begins(self, step: int) -> None:
        if step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def writes_at(self, step: int) -> bool:
        """`step_ends(step)` writes the profile (host work the step's time leaves out)."""
        return self.prof is not None and step == self.last

    def step_ends(self, step: int) -> None:
        self.mark(None)
        if self.prof is None or step != self.last:
            return
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        steps = self.last - self.first + 1
        events = self.prof.key_averages()
        key = "device_time_total" if self.device_type == "cuda" else "cpu_time_total"
        # The phase labels show up as device events too (user annotations): not kernel time.
        kernels = [
            (e.name, e.self_device_time_total) for e in self.prof.events() if _is_device_work(e)
        ]
        busy = sum(us for _, us in kernels)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(
                f"steps {self.first}-{self.last}: wall {1e3 * wall / steps:.1f} ms/step, "
                f"device kernels {busy / 1e3 / steps:.1f} ms/step\n\n"
            )
            f.write(events.table(sort_by=key, row_limit=40, max_name_column_width=70))
            f.write("\n" + kernel_kinds(kernels, steps) + "\n")
            f.write("\n" + self.idle_by_phase(steps) + "\n")
            if self.device_type == "cuda":
                f.write("\n" + memory_by_stream() + "\n")
        self.prof.export_chrome_trace(f"{self.path}.trace.json.gz")  # gzipped by the suffix
        self.prof = None

    def idle_by_phase(self, steps: int) -> str:
        """Per phase: host wall time, how much of it the device had no kernel running, and how
        often the host waited for the device (after a sync the device idles until the host
        queues work again: these are the places to look at first)."""
        events = self.prof.events()
        kernels = [(e.time_range.start, e.time_range.end) for e in events if _is_device_work(e)]
        # Versioned or per-thread-stream names carry a suffix (cudaStreamSynchronize_ptsz).
        syncs = [e.time_range.start for e in events if e.name.split("_")[0] in SYNC_CALLS]
        lines = [
            f"{'phase':<12} {'host ms/step':>12} {'device idle ms/step':>20} {'syncs/step':>10}"
        ]
        for name in self.PHASES:
            ranges = [
                (e.time_range.start, e.time_range.end)
                for e in events
                if e.name == f"dsflow/{name}" and e.device_type.name == "CPU"
            ]
            wall, idle = device_idle(ranges, kernels)
            waits = count_within(ranges, syncs)
            lines.append(
                f"{name:<12} {wall / 1e3 / steps:>12.1f} {idle / 1e3 / steps:>20.1f} "
                f"{waits / steps:>10.1f}"
            )
        return "\n".join(lines)


def memory_by_stream() -> str:
    """What the caching allocator holds, per CUDA stream (each stream has its own pool: memory
    freed on one is not reused by another's allocations) and in all: reserved, allocated, the
    peaks, and the free parts of partly used blocks (fragmentation). Where the planner's figure
    and torch.cuda.max_memory_reserved part, this says which pool kept the difference."""
    gb = 1e9
    pools: dict[int, list[int]] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = pools.setdefault(seg["stream"], [0, 0, 0])
        pool[0] += seg["total_size"]
        pool[1] += seg["allocated_size"]
        pool[2] += 1
    stats = torch.cuda.memory_stats()
    lines = [f"{'stream':<18} {'reserved GB':>11} {'allocated GB':>12} {'segments':>8}"]
    for stream, (reserved, allocated, count) in sorted(pools.items()):
        lines.append(f"{stream:<18} {reserved / gb:>11.2f} {allocated / gb:>12.2f} {count:>8}")
    for key in ("reserved_bytes", "allocated_bytes", "inactive_split_bytes"):
        lines.append(
            f"{key}: now {stats[f'{key}.all.current'] / gb:.2f} GB, peak "
            f"{stats[f'{key}.all.peak'] / gb:.2f} GB"
        )
    lines.append(f"allocation retries {stats['num_alloc_retries']}, OOMs {stats['num_ooms']}")
    return "\n".join(lines)


# CUDA runtime calls in which the host waits for the device (`.item()`, `.tolist()`, a
# device-to-host copy, torch.cuda.synchronize, an event wait).
SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)


def count_within(ranges: list[tuple[float, float]], points: list[float]) -> int:
    """How many of `points` fall inside one of `ranges` (half-open [start, end))."""
    return sum(1 for t in points if any(a <= t < b for a, b in ranges))


def _is_device_work(event) -> bool:
    return event.device_type.name == "CUDA" and not getattr(event, "is_user_annotation", False)


# Kernel kinds by name, the first match wins: the optimizer's Triton kernel and the gradient
# norm's multi-tensor launch; CUTLASS's grouped GEMM (the routed experts); cuDNN's attention
# with its helpers, inductor's (triton_*) included; cuBLAS's GEMMs; the rest of inductor's fused
# kernels (norms, activations, rotary, the experts' dispatch and combine); routing's sort/top-k.
KERNEL_KINDS = (
    ("optimizer", re.compile(r"adamw_master|multi_tensor_apply")),
    ("grouped GEMM", re.compile(r"GroupProblemShape|PtrArray|grouped_gemm|[Gg]rouped")),
    ("attention", re.compile(r"cudnn|flash|fmha")),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|cublas|xmma", re.IGNORECASE)),
    ("fused (inductor)", re.compile(r"^triton_")),
    ("sort / top-k", re.compile(r"[Ss]ort|[Tt]op[Kk]|radix")),
)


def kernel_kinds(kernels: list[tuple[str, float]], steps: int) -> str:
    """Device time per step by kernel kind (KERNEL_KINDS; "other": the rest), from
    (kernel name, microseconds) pairs, largest first."""
    totals: dict[str, float] = {}
    for name, us in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        totals[kind] = totals.get(kind, 0.0) + us
    whole = sum(totals.values()) or 1.0
    lines = [f"{'kernel kind':<18} {'ms/step':>8} {'share':>6}"]
    for kind, us in sorted(totals.items(), key=lambda item: -item[1]):
        lines.append(f"{kind:<18} {us / 1e3 / steps:>8.2f} {100 * us / whole:>5.1f}%")
    return "\n".join(lines)


def device_idle(
    ranges: list[tuple[float, float]], kernels: list[tuple[float, float]]
) -> tuple[float, float]:
    """(total length of `ranges`, the part of it in which no interval of `kernels` runs)."""
    busy: list[list[float]] = []
    for start, end in sorted(k for k in kernels if k[1] > k[0]):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    wall = sum(b - a for a, b in ranges)
    overlap = sum(
        max(0.0, min(b, e) - max(a, s)) for a, b in ranges for s, e in busy if s < b and e > a
    )
    return wall, wall - overlap


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


class Faults:
    """Fault injection for the reliability tests (tests/e2e/test_reliability.py); all off unless
    set.

    DSFLOW_FAULT_STEP=s [DSFLOW_FAULT_RANK=r, default 0] SIGKILLs rank r right after step s, as a
    crash or an OOM kill would; with DSFLOW_FAULT_POINT=micro, inside step s instead (after its
    first micro-step's backward, before the next). DSFLOW_FAULT_SAVE=s SIGKILLs rank r while the
    checkpoint of step s is saved: after every rank wrote the temporary tag, before the rename.
    DSFLOW_FAULT_ENOSPC=s makes rank r's checkpoint writes of step s fail as a full disk does
    (a partial file, then ENOSPC). DSFLOW_FAULT_NAN_FROM_STEP=s turns the loss NaN from step s
    on. DSFLOW_FAULT_RAISE=s makes rank r raise a RuntimeError right after step s, as a bug would.
    DSFLOW_FAULT_STEP_DELAY=t sleeps t seconds per step. DSFLOW_FAULT_MARK=path: the time
    of a kill is written there first. DSFLOW_DATA_TRACE=path: every rank appends, per training
    micro-batch, the step and the sha1 of each window it read to path.rankR (the elastic-resume
    test checks a resumed run reads what an uninterrupted one reads).
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.target = _env_int("DSFLOW_FAULT_RANK") or 0
        self.kill_step = _env_int("DSFLOW_FAULT_STEP")
        self.point = os.environ.get("DSFLOW_FAULT_POINT", "step")
        self.save_step = _env_int("DSFLOW_FAULT_SAVE")
        self.enospc_step = _env_int("DSFLOW_FAULT_ENOSPC")
        self.nan_from = _env_int("DSFLOW_FAULT_NAN_FROM_STEP")
        self.raise_step = _env_int("DSFLOW_FAULT_RAISE")
        self.delay = float(os.environ.get("DSFLOW_FAULT_STEP_DELAY") or 0)
        self.mark = os.environ.get("DSFLOW_FAULT_MARK")
        self.data_trace = os.environ.get("DSFLOW_DATA_TRACE")

    def _kill(self, what: str) -> None:
        print(f"[dsflow fault] SIGKILL rank {self.rank} {what}", file=sys.stderr, flush=True)
        if self.mark:
            Path(self.mark).write_text(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def _here(self, step: int, at: int | None) -> bool:
        return at is not None and at == step and self.rank == self.target

    def step_begins(self) -> None:
        if self.delay:
            time.sleep(self.delay)

    def after_micro(self, step: int, micro: int) -> None:
        if self.point == "micro" and micro == 0 and self._here(step, self.kill_step):
            self._kill(f"inside step {step}, after micro-step {micro}")

    def after_step(self, step: int) -> None:
        if self.point == "step" and self._here(step, self.kill_step):
            self._kill(f"after step {step}")
        if self._here(step, self.raise_step):
            raise RuntimeError(f"injected fault: rank {self.rank} raised after step {step}")

    def in_save(self, step: int) -> None:
        if self._here(step, self.save_step):
            self._kill(f"while saving step {step}: temporary tag written, not yet renamed")

    def trace(self, step: int, windows: np.ndarray) -> None:
        if not self.data_trace:
            return
        import hashlib

        digests = [hashlib.sha1(np.ascontiguousarray(w).tobytes()).hexdigest() for w in windows]
        with open(f"{self.data_trace}.rank{self.rank}", "a") as f:
            f.write(json.dumps({"step": step, "windows": digests}) + "\n")

    def nan(self, step: int) -> bool:
        return self.nan_from is not None and step >= self.nan_from

    def disk_full(self, engine, step: int) -> None:
        """Before step `step`'s save: its checkpoint writes fail with ENOSPC. The run ends at
        this save (train.async_checkpoints: in its writer thread), so nothing is put back."""
        if not self._here(step, self.enospc_step):
            return

        def write(state_dict, path):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)  # what a full disk leaves: a partial file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        ce = engine.checkpoint_engine
        # dsflow's engines write through `write`; another engine (a ds_config's) saves.
        setattr(ce, "write" if hasattr(ce, "write") else "save", write)


class Hooks:
    """The profiler's and the fault injector's calls around a step, in one place."""

    def __init__(self, rank: int, device_type: str, heartbeat: Heartbeat | None = None):
        self.profiler = StepProfiler.from_env(rank, device_type)
        self.faults = Faults(rank)
        self.heartbeat = heartbeat

    def step_begins(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.step_begins(step)
        self.profiler.step_begins(step)
        self.faults.step_begins()

    def arm(self) -> None:
        """Training is under way: the stage's watchdog may judge this rank from now on."""
        if self.heartbeat is not None:
            self.heartbeat.arm()

    def mark(self, phase: str | None) -> None:
        """The step enters `phase` (every rank passes the same marks in the same order, so the
        heartbeat's count of them says which rank is behind)."""
        if self.heartbeat is not None:
            self.heartbeat.beat()
        self.profiler.mark(phase)

    def step_ends(self, step: int, aside) -> None:
        """`aside`: the step clock's context for host work that is not the step's."""
        if self.profiler.writes_at(step):
            with aside():
                self.profiler.step_ends(step)
        else:
            self.profiler.step_ends(step)
        self.faults.after_step(step)
