"""One training rank: `python -m dsflow.train.loop` is what torchrun / the DeepSpeed launcher start.

The train stage (dsflow.train.stage) resolves everything first and writes checkpoints/run.json; one
rank of node 0 reads that plan and hands it to every rank (shared_plan), so all ranks, on every
node, agree on batch, steps and config. The loop is top to bottom here: build, resume, step
(micro-batches -> DeepSpeed), balance experts, log, validate, checkpoint, export.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dsflow import dsconfig, launch
from dsflow.atomic import atomic_file
from dsflow.data.shards import BatchLoader, ShardReader
from dsflow.model import fastpaths as kernels
from dsflow.model.balance import ExpertBalancer
from dsflow.model.build import build_model, save_hf
from dsflow.model.flops import flops_per_token, mfu, peak_flops
from dsflow.model.loss import TrainingLM, evaluate_loss
from dsflow.model.presets import model_config, param_counts
from dsflow.paths import FINAL, LIVE, PROFILE, SHARDS, TOKENIZER, TRAIN_METRICS
from dsflow.train import checkpoint as ckpt
from dsflow.train import fusedgrads
from dsflow.train.masteradam import MasterAdamW
from dsflow.train.metrics import EventClock, Readback

EXIT_FATAL = 3  # a one-line reason is in DSFLOW_STATUS_FILE (the train stage prints it)
EXIT_STOPPED = 143  # stopped on request (SIGTERM / SIGINT / checkpoints/.stop), checkpoint saved

# Grad-norm spike: a step's norm above SPIKE_FACTOR x the median of the last SPIKE_WINDOW norms
# (once SPIKE_MIN_HISTORY are known) is logged as train/grad_norm_spike (the ratio).
SPIKE_FACTOR = 5.0
SPIKE_WINDOW = 100
SPIKE_MIN_HISTORY = 10


class Stop:
    """SIGTERM/SIGINT ask the loop to checkpoint and leave at the next step boundary (so does
    checkpoints/.stop, which the train stage creates when it is signalled: every rank checks it
    and the decision is all-reduced, so all ranks stop after the same step)."""

    requested = False

    @classmethod
    def install(cls) -> None:
        def handler(signum, frame):
            cls.requested = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_int(value: int, device) -> list[int]:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [int(x) for x in out]


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Logger:
    """Rank 0 only: DVCLive metrics (for dvc plots / metrics) and the progress bar."""

    def __init__(self, start: int, steps: int, resumed: bool):
        import dvclive.live
        from dvclive import Live

        from dsflow.progress import bar

        if not os.environ.get("DVC_ROOT"):
            # Outside `dvc repro`, DVCLive would `dvc init` a plain git checkout (and crash on
            # one with no commits); dsflow only wants its files there.
            dvclive.live.get_dvc_repo = lambda: None

        if resumed:
            truncate_live_logs(LIVE, start)
        self.live = Live(str(LIVE), resume=resumed, save_dvc_exp=False, dvcyaml=None, report=None)
        if "data" in getattr(self.live, "_studio_events_to_skip", ()):
            # DVCLive 3.49 gathers data for DVC Studio at every step even when Studio is not
            # set up (and drops it later): it re-reads every metric's whole TSV, so each step
            # costs more than the last (2 ms at step 10, 32 ms at step 2000 on a 2-core
            # machine: bench/logging_overhead.py), all of it time the GPU waits. With Studio
            # set up it stays as it is.
            self.live.post_data_to_studio = lambda: None
        self.bar = bar(desc="train", total=steps, initial=start, unit="step")

    def log(self, step: int, metrics: dict) -> None:
        self.live.step = step
        for name, value in metrics.items():
            if value is not None and math.isfinite(value):
                self.live.log_metric(name, value)
        self.live.next_step()

    def progress(self, loss: float, tokens_per_s: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.live.end()


def truncate_live_logs(root: Path, start: int) -> None:
    """A resumed run re-logs the steps after `start`: drop their old rows (logged before the
    interruption) so each step appears once."""
    for tsv in (root / "plots" / "metrics").rglob("*.tsv"):
        lines = tsv.read_text().splitlines(keepends=True)
        if not lines:
            continue
        header, rows = lines[0], lines[1:]
        step_col = header.rstrip("\n").split("\t").index("step")
        kept = [r for r in rows if int(r.split("\t")[step_col]) <= start]
        tsv.write_text(header + "".join(kept))


def report_fatal(message: str) -> None:
    """One line for the train stage to print (the first rank to fail wins), and on stderr."""
    print(f"[dsflow train] error: {message}", file=sys.stderr, flush=True)
    path = os.environ.get("DSFLOW_STATUS_FILE")
    if path:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(message.replace("\n", " ") + "\n")


class StepClock:
    """A step's time is the period since the last step ended, so the per-step bookkeeping (loss
    all-reduce, expert stats, logging), during which the device idles, counts; what runs
    inside `aside()` (validation, checkpoint saves, profile writing) does not: it is
    reported on its own. The first step is timed from its own start.

    With `events` (CUDA, train.perf.async_metrics) the host does not wait for a step's end, so
    the period is measured between CUDA events on the device (dsflow.readback.EventClock):
    `step_done` then returns a span that `seconds` turns into seconds once it has passed."""

    def __init__(self, events: bool = False):
        self.last_end: float | None = None
        self.set_aside = 0.0  # seconds inside aside() since last_end
        self.events = EventClock() if events else None

    def step_begins(self) -> None:
        if self.events is not None:
            self.events.step_begins()

    def step_done(self, started: float, end_event=None) -> float | tuple:
        if self.events is not None:
            return self.events.step_done(end_event)
        now = time.perf_counter()
        dt = now - (started if self.last_end is None else self.last_end) - self.set_aside
        self.last_end, self.set_aside = now, 0.0
        return dt

    def seconds(self, span: float | tuple) -> float:
        return span if isinstance(span, float) else EventClock.seconds(span)

    @contextlib.contextmanager
    def aside(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.set_aside += time.perf_counter() - t
            if self.events is not None:
                self.events.aside()


class StepHealth:
    """Numerical bookkeeping per optimizer step; every rank holds the same one (it sees only
    all-reduced values), so every rank takes the same decision.

    - skipped: DeepSpeed did not apply the update (fp16 loss-scale overflow, or a non-finite
      gradient caught by ZeRO's overflow check); counted, logged as train/skipped_steps.
    - bad: the loss itself is NaN/Inf. Its update must have been skipped; `max_bad` in a row
      stop the run (the last good checkpoint is kept: no checkpoint is saved during a streak).
    - spike: an applied step whose grad norm exceeds `factor` x the running median.
    """

    def __init__(
        self,
        max_bad: int,
        state: dict | None = None,
        factor: float = SPIKE_FACTOR,
        window: int = SPIKE_WINDOW,
        min_history: int = SPIKE_MIN_HISTORY,
    ):
        state = state or {}
        self.max_bad = max_bad
        self.skipped = int(state.get("skipped", 0))
        self.bad = int(state.get("bad", 0))
        self.spikes = int(state.get("spikes", 0))
        self.norms: deque[float] = deque(state.get("norms", []), maxlen=window)
        self.factor, self.min_history = factor, min_history
        self.streak = 0
        self.streak_start: int | None = None

    def state(self) -> dict:
        return {
            "skipped": self.skipped,
            "bad": self.bad,
            "spikes": self.spikes,
            "norms": list(self.norms),
        }

    def observe(self, step: int, loss: float, applied: bool, grad_norm: float | None) -> dict:
        """Record optimizer step `step`; returns {"bad", "skipped", "spike" (ratio or None),
        "stop" (why the run must stop, or None)}."""
        bad = not math.isfinite(loss)
        out = {"bad": bad, "skipped": not applied, "spike": None, "stop": None}
        if not applied:
            self.skipped += 1
        if bad:
            self.bad += 1
            self.streak += 1
            if self.streak == 1:
                self.streak_start = step
            if applied:
                out["stop"] = (
                    f"loss is {loss} at step {step} and DeepSpeed applied the update (this "
                    "optimizer setup has no overflow check, e.g. ZeRO stage 0 in fp32): the "
                    "weights are no longer finite"
                )
            elif self.streak >= self.max_bad:
                span = f"step {step}" if self.streak == 1 else f"steps {self.streak_start}-{step}"
                out["stop"] = (
                    f"loss was non-finite ({loss}) for {self.streak} consecutive step(s) ({span}, "
                    f"train.max_bad_steps: {self.max_bad}); their updates were skipped"
                )
            return out
        self.streak, self.streak_start = 0, None
        if applied and grad_norm is not None and math.isfinite(grad_norm):
            if len(self.norms) >= self.min_history:
                median = statistics.median(self.norms)
                if median > 0 and grad_norm > self.factor * median:
                    out["spike"] = grad_norm / median
                    self.spikes += 1
            self.norms.append(grad_norm)
        return out


class StepProfiler:
    """DSFLOW_PROFILE=FIRST:LAST[:PATH] profiles optimizer steps FIRST..LAST on rank 0 with
    torch.profiler and writes a table of the ops and kernels by device time, device busy time
    vs wall time per step, and where the device waited (idle time per phase of the step: data,
    forward, backward, optimizer step, sync, bookkeeping; the stop check and checkpoint saves
    between steps are in none) to PATH (default logs/profile.txt), and the chrome trace beside
    it (PATH + .trace.json.gz). For docs/performance.md."""

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
        busy = sum(e.self_device_time_total for e in self.prof.events() if _is_device_work(e))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(
                f"steps {self.first}-{self.last}: wall {1e3 * wall / steps:.1f} ms/step, "
                f"device kernels {busy / 1e3 / steps:.1f} ms/step\n\n"
            )
            f.write(events.table(sort_by=key, row_limit=40, max_name_column_width=70))
            f.write("\n" + self.idle_by_phase(steps) + "\n")
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
    """Fault injection for the reliability tests (tests/test_reliability.py); all off unless set.

    DSFLOW_FAULT_STEP=s [DSFLOW_FAULT_RANK=r, default 0] SIGKILLs rank r right after step s, as a
    crash or an OOM kill would; with DSFLOW_FAULT_POINT=micro, inside step s instead (after its
    first micro-step's backward, before the next). DSFLOW_FAULT_SAVE=s SIGKILLs rank r while the
    checkpoint of step s is saved: after every rank wrote the temporary tag, before the rename.
    DSFLOW_FAULT_ENOSPC=s makes rank r's checkpoint writes of step s fail as a full disk does
    (a partial file, then ENOSPC). DSFLOW_FAULT_NAN_FROM_STEP=s turns the loss NaN from step s
    on. DSFLOW_FAULT_STEP_DELAY=t sleeps t seconds per step. DSFLOW_FAULT_MARK=path: the time
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

    @contextlib.contextmanager
    def disk_full(self, engine, step: int):
        if not self._here(step, self.enospc_step):
            yield
            return
        ce = engine.checkpoint_engine
        original = ce.save

        def save(state_dict, path):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)  # what a full disk leaves: a partial file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        ce.save = save
        try:
            yield
        finally:
            ce.save = original


def save_failure(exc: BaseException, tag: str, previous: str | None, rank: int) -> str | None:
    """The one-line reason a checkpoint write failed, or None when `exc` is not about storage."""
    root = ckpt.CHECKPOINTS
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    need = max(ckpt.tag_bytes(root, previous), 16 << 20)
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


def shared_plan(device) -> tuple[dict, dict] | None:
    """(run.json, ds_config.json) as node 0's train stage wrote them, on every rank.

    The first rank launched by node 0's stage (PLAN_SOURCE_ENV; rank 0 when no rank says so,
    e.g. under DeepSpeed's pdsh launcher) reads them and broadcasts, so another node never
    reads a stale run.json. A rank whose own stage planned differently (FINGERPRINT_ENV: other
    params or data on that node) makes every rank stop: None, after reporting why.
    """
    sources = all_gather_int(1 if os.environ.get(launch.PLAN_SOURCE_ENV) else 0, device)
    source = sources.index(1) if 1 in sources else 0
    box: list = [None, None]
    if dist.get_rank() == source:
        box = [
            json.loads((ckpt.CHECKPOINTS / "run.json").read_text()),
            json.loads((ckpt.CHECKPOINTS / "ds_config.json").read_text()),
        ]
    dist.broadcast_object_list(box, src=source)
    mine = os.environ.get(launch.FINGERPRINT_ENV)
    differs = bool(mine) and mine != box[0]["fingerprint"]
    if all_sum([1.0 if differs else 0.0], device)[0]:
        who = f"node {socket.gethostname()} (run {mine})" if differs else "another node"
        report_fatal(
            f"{who} planned a different run than node 0 (run {box[0]['fingerprint']}): every "
            "node needs the same params and data shards"
        )
        return None
    return box[0], box[1]


def main() -> int:
    device_type = os.environ.get("DSFLOW_DEVICE") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )

    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    shared = shared_plan(device)
    if shared is None:
        return EXIT_FATAL
    plan, ds_config = shared
    params, train = plan["params"], plan["params"]["train"]
    assert world == plan["world"], f"launched {world} ranks, the plan says {plan['world']}"
    Stop.install()
    faults = Faults(rank)

    seed = params["seed"]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    model_params = params["model"]
    config = model_config(model_params["preset"], plan["vocab_size"], model_params["overrides"])
    model = build_model(config, device_type=device_type, pretrained=model_params["pretrained"])
    config = model.config
    balance = train["balance"]
    balancer = ExpertBalancer(model, gamma=balance["gamma"], seq_aux_alpha=balance["seq_aux_alpha"])

    zero3 = ds_config["zero_optimization"].get("stage", 0) == 3
    perf = kernels.Perf(**plan["perf"])  # resolved by the train stage (train.plan_run)
    perf = kernels.apply(model, perf, balancer, device)
    if rank == 0:
        print(f"[dsflow train] fast paths: {perf.describe()}", file=sys.stderr)
    if zero3 and balancer.routers:
        # ZeRO-3 gathers a module's parameters when its forward starts, following the order
        # it traced; routed experts run in a data-dependent order (or not at all), so the
        # ranks fetch different parameters (DeepSpeed: "Detected a disagreement on list length
        # between rank0 and rank1", or a hang). Leaf: the whole MoE block is gathered at once.
        from deepspeed.utils import set_z3_leaf_modules
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        set_z3_leaf_modules(model, [DeepseekV3MoE])
    # Marks the checkpoints as plain data parallel (no tensor/pipeline slicing), which is what
    # deepspeed.checkpoint.ds_to_universal needs to convert them for an elastic resume.
    from deepspeed.checkpoint import constants as ds_ckpt

    trainee = TrainingLM(model, ce_chunk=perf.ce_chunk)
    setattr(
        trainee,
        ds_ckpt.UNIVERSAL_CHECKPOINT_INFO,
        {ds_ckpt.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds_ckpt.UNIVERSAL_CHECKPOINT_VERSION_VALUE},
    )
    trainable = [p for p in trainee.parameters() if p.requires_grad]
    optimizer = None
    if perf.optimizer == "fused":
        # DeepSpeed's bf16 mode would cast the parameters (not the buffers) and wrap its own
        # optimizer; here dsflow casts them the same way and brings the optimizer.
        for p in trainee.parameters():
            p.data = p.data.to(torch.bfloat16)
        opt = train["optimizer"]
        optimizer = MasterAdamW(
            trainable,
            lr=opt["lr"],
            betas=tuple(opt["betas"]),
            eps=opt["eps"],
            weight_decay=opt["weight_decay"],
            max_grad_norm=train["grad_clip"],
        )
    engine, _, _, _ = deepspeed.initialize(
        model=trainee, model_parameters=trainable, optimizer=optimizer, config=ds_config
    )
    if optimizer is not None and world == 1:
        # ZeRO-0's all-reduce of one rank would only copy every gradient into buckets and back.
        engine.enable_backward_allreduce = False
    if perf.fused_grad_checks and not fusedgrads.install(engine.optimizer) and rank == 0:
        print(
            "[dsflow train] train.perf.fused_grad_checks: not applicable to this layout "
            f"({type(engine.optimizer).__name__}); DeepSpeed's own checks run",
            file=sys.stderr,
        )
    # DeepSpeed broadcasts parameters at start-up, not buffers: give every rank rank 0's biases.
    balancer.sync_bias()

    start = 0
    health_state = None
    resume = plan.get("resume")  # validated by the train stage (checkpoint.resume_tag)
    if resume:
        _, client = engine.load_checkpoint(
            str(ckpt.CHECKPOINTS), tag=resume, load_module_strict=True
        )
        start = client["step"]
        health_state = client.get("health")
        if len(client["rng"]) == world:
            set_rng_state(client["rng"][rank])
        if "expert_bias" in client:
            # A universal checkpoint (another world size) restores parameters only, not the
            # module's buffers: the router biases come from the client state.
            balancer.load_bias_state(client["expert_bias"])
        balancer.sync_bias()
        if rank == 0:
            elastic = (
                f" (saved by {len(client['rng'])} ranks)" if len(client["rng"]) != world else ""
            )
            print(f"[dsflow train] resumed from step {start}{elastic}", file=sys.stderr)
    health = StepHealth(train.get("max_bad_steps", 10), health_state)

    micro, accum = plan["batch"]["micro"], plan["batch"]["accum"]
    steps, seq_len = plan["steps"], train["seq_len"]
    global_tokens = micro * accum * world * seq_len
    # The train stage verified every shard's sha256 just before launch.
    verify = not plan.get("data_verified", False)
    reader = ShardReader(SHARDS / "train", seq_len, seed=seed, verify=verify)
    val_reader = ShardReader(SHARDS / "val", seq_len, seed=seed, verify=verify)
    val_windows = train["eval_batches"] * micro * world

    fpt = flops_per_token(config, seq_len)
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"
    peak = peak_flops(device_name, train["precision"], train["peak_tflops"])
    counts = param_counts(config)

    def validate() -> float:
        # Validation is a small share of the run: eager, instead of compiling a no-grad graph.
        stance = (
            torch.compiler.set_stance("force_eager") if perf.compile else contextlib.nullcontext()
        )
        with stance:
            total, count = evaluate_loss(
                engine.module,  # through DeepSpeed's module: ZeRO-3 hooks gather the weights
                val_reader,
                micro=micro,
                device=device,
                rank=rank,
                world=world,
                max_windows=val_windows,
                # ZeRO-3 gathers parameters inside every forward: all ranks must run as many.
                lockstep=zero3,
            )
        total, count = all_sum([total, count], device)
        return total / count

    last_good = resume.split("/")[0] if resume else None  # the newest complete checkpoint

    def save(step_done: int) -> None:
        """Atomic: every rank writes into a temporary tag; once all are done rank 0 records the
        manifest, renames it to its final name and moves `latest` (checkpoint.commit)."""
        nonlocal last_good
        tag = ckpt.tag_for(step_done)
        tmp = ckpt.temp_tag(tag)
        # DeepSpeed stores client state from rank 0 only: gather every rank's RNG into it.
        states: list = [None] * world
        dist.all_gather_object(states, rng_state())
        client = {
            "step": step_done,
            "rng": states,
            "fingerprint": plan["fingerprint"],
            "health": health.state(),
            "expert_bias": balancer.bias_state(),
        }
        try:
            with faults.disk_full(engine, step_done):
                engine.save_checkpoint(
                    str(ckpt.CHECKPOINTS), tag=tmp, client_state=client, save_latest=False
                )
            faults.in_save(step_done)
            dist.barrier()
            if rank == 0:
                ckpt.write_manifest(
                    ckpt.CHECKPOINTS, tmp, step_done, world, bool(engine.save_zero_checkpoint)
                )
                ckpt.commit(ckpt.CHECKPOINTS, tmp, tag)
        except (OSError, RuntimeError) as e:
            message = save_failure(e, tag, last_good, rank)
            if message is None:
                raise
            # The other ranks wait in a barrier for this one: leave now, so that they fail
            # fast (their peer is gone) and the launcher stops them.
            report_fatal(message)
            sys.stderr.flush()
            os._exit(EXIT_FATAL)
        last_good = tag
        if rank == 0:
            ckpt.prune(ckpt.CHECKPOINTS, train["keep_checkpoints"])
        dist.barrier()

    logger = Logger(start, steps, resumed=start > 0) if rank == 0 else None
    loader = BatchLoader(
        reader,
        start=start,
        rank=rank,
        world=world,
        micro=micro,
        accum=accum,
        device=device,
        depth=2 if perf.prefetch else 0,
        pin=perf.prefetch and device_type == "cuda",
    )
    engine.train()
    wall0 = time.perf_counter()
    history: list[dict] = []
    val_loss = None
    step = start
    last_saved = start if start > 0 else None
    loss_value = float("nan")
    profiler = StepProfiler.from_env(rank, device_type)
    graphs = perf.compile and perf.compile_mode in ("reduce-overhead", "max-autotune")
    # One step late (train.perf.async_metrics): the host reads step N's numbers after it has
    # queued step N+1, so the device never waits for the host between steps. Steps that
    # evaluate, checkpoint or end the run are read at once (their decisions need them).
    late = perf.async_metrics
    cuda = device_type == "cuda"
    clock = StepClock(events=late and cuda)
    # The fused optimizer's kernel path decides on the device whether it took a step (no host
    # sync); the engine is not told.
    applied_on_device = isinstance(optimizer, MasterAdamW) and optimizer._triton(device)

    def capture(step_done: int, loss_sum: torch.Tensor, data_wait: float, t0: float) -> Readback:
        """Step `step_done`'s numbers, queued for reading back (all ranks, same collectives)."""
        loss = loss_sum / accum
        if world > 1:
            dist.all_reduce(loss)
            loss = loss / world
        if applied_on_device:
            applied = optimizer.applied
        else:
            applied = bool(engine.was_step_applied())
        if applied is False:
            # A skipped update (overflow) must not move the expert biases either.
            balancer.reset()
            expert = {}
        else:
            expert = balancer.update_async(applied=applied)
        requested = Stop.requested or (ckpt.CHECKPOINTS / ckpt.STOP_FILE).exists()
        peaks = [
            peak_memory_bytes(device),
            torch.cuda.max_memory_reserved(device) if cuda else 0,
        ]
        values = {
            "step": step_done,
            "loss": loss,
            "applied": applied,
            "grad_norm": engine.get_global_grad_norm(),
            "lr": engine.get_lr()[0],
            "data_wait": data_wait,
            **{f"expert.{k}": v for k, v in expert.items()},
        }
        if world > 1:
            # All ranks take the stop decision together, from the same all-reduced flag.
            # (No copy from pageable host memory: on CUDA that would wait for the step.)
            flag = torch.full((1,), 1.0 if requested else 0.0, dtype=torch.float64, device=device)
            dist.all_reduce(flag)
            mine = torch.tensor(peaks, dtype=torch.int64, pin_memory=cuda).to(
                device, non_blocking=cuda
            )
            gathered = torch.zeros(world * 2, dtype=torch.int64, device=device)
            dist.all_gather_into_tensor(gathered, mine)
            values.update(stop=flag[0], peaks=gathered.view(world, 2))
        else:
            values.update(stop=requested, peaks=[peaks])
        if not late and cuda:
            torch.cuda.synchronize(device)
        record = Readback(values, device, timed=clock.events is not None)
        record.dt = clock.step_done(t0, record.event)
        return record

    def finish(record: Readback) -> tuple[dict, bool]:
        """Read a captured step back: health, validation when due, logging. Returns the health
        event and whether a stop was requested."""
        nonlocal loss_value, val_loss
        v = record.values()
        step_done = v["step"]
        loss_value = v["loss"]
        applied = bool(v["applied"])
        snapshot = {k.split(".", 1)[1]: x for k, x in v.items() if k.startswith("expert.")}
        expert = balancer.stats_of(snapshot) if applied else {}
        grad_norm = v["grad_norm"]
        grad_norm = float(grad_norm) if grad_norm is not None else None
        event = health.observe(step_done, loss_value, applied, grad_norm)
        dt = clock.seconds(record.dt)
        tokens_per_s = global_tokens / dt
        peaks = [[int(x) for x in row] for row in v["peaks"]]
        memory, reserved = [p[0] for p in peaks], [p[1] for p in peaks]
        eval_due = step_done % train["eval_every"] == 0 or step_done == steps
        if not event["bad"] and eval_due:
            with clock.aside():
                val_loss = validate()
        if rank == 0:
            metrics = {
                "train/loss": loss_value,
                "train/lr": v["lr"],
                "train/grad_norm": grad_norm,
                "train/skipped_steps": float(health.skipped),
                "perf/tokens_per_s": tokens_per_s,
                "perf/mfu": mfu(tokens_per_s / world, fpt, peak),
                "perf/step_s": dt,
                "perf/data_wait_frac": v["data_wait"] / dt,
                "memory/peak_gb_max": max(memory) / 1e9,
                "experts/max_over_mean": expert.get("max_over_mean"),
                "experts/entropy_min": expert.get("entropy_min"),
                "tokens": step_done * global_tokens,
            }
            if event["spike"] is not None:
                metrics["train/grad_norm_spike"] = event["spike"]
                print(
                    f"[dsflow train] step {step_done}: grad norm {grad_norm:.4g} is "
                    f"{event['spike']:.1f}x its running median",
                    file=sys.stderr,
                )
            if event["bad"]:
                print(
                    f"[dsflow train] step {step_done}: loss is {loss_value}; update skipped "
                    f"({health.streak} in a row, the run stops at {health.max_bad})",
                    file=sys.stderr,
                )
            elif event["skipped"]:
                print(
                    f"[dsflow train] step {step_done}: gradient overflow, update skipped "
                    f"({health.skipped} skipped so far)",
                    file=sys.stderr,
                )
            if val_loss is not None and eval_due:
                metrics["val/loss"] = val_loss
            if step_done % train["log_every"] == 0 or step_done == steps or "val/loss" in metrics:
                logger.log(step_done, metrics)
            logger.progress(loss_value, tokens_per_s)
            history.append(
                {
                    "step": step_done,
                    "dt": dt,
                    "memory": memory,
                    "reserved": reserved,
                    "expert": expert,
                    **metrics,
                }
            )
        return event, bool(v["stop"])

    pending: Readback | None = None
    while step < steps:
        profiler.step_begins(step + 1)
        faults.step_begins()
        clock.step_begins()
        t0 = time.perf_counter()
        data_wait = 0.0
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        for a in range(accum):
            profiler.mark("data")
            td = time.perf_counter()
            inputs, targets = loader.get(step, a)
            faults.trace(step + 1, loader.last_windows)
            data_wait += time.perf_counter() - td
            profiler.mark("forward")
            if graphs:
                # A new iteration: CUDA graph outputs of the last one may be overwritten.
                torch.compiler.cudagraph_mark_step_begin()
            loss = engine(inputs, targets)
            if faults.nan(step + 1):
                loss = loss * float("nan")
            profiler.mark("backward")
            engine.backward(loss + balancer.aux_loss())
            profiler.mark("optimizer")
            engine.step()
            loss_sum += loss.detach().double()
            faults.after_micro(step + 1, a)
        step += 1
        profiler.mark("sync")
        record = capture(step, loss_sum, data_wait, t0)
        profiler.mark("bookkeeping")
        due = (
            not late
            or step == steps
            or step % train["eval_every"] == 0
            or step % train["checkpoint_every"] == 0
        )
        ready = [r for r in (pending, record if due else None) if r is not None]
        pending = None if due else record
        stop, fatal = False, None
        for r in ready:
            event, requested = finish(r)
            stop, fatal = stop or requested, event["stop"]
            if fatal:
                break
        if stop and pending is not None and not fatal:
            # This step is checkpointed below: its own numbers (health) first.
            event, _ = finish(pending)
            pending, fatal = None, event["stop"]
        if fatal:
            # (A step read late is not logged: the run stops on an earlier one's numbers.)
            if rank == 0:
                logger.close()
                kept = (
                    f"the last good checkpoint {last_good} is kept and a rerun resumes from it"
                    if last_good
                    else "there is no good checkpoint yet (a rerun starts from step 0)"
                )
                report_fatal(
                    f"{fatal}; stopped: {kept} (lower train.optimizer.lr, or check the "
                    "data, before rerunning)"
                )
            profiler.mark(None)
            loader.close()  # its reader thread must not run into the interpreter's teardown
            # Every rank stops here together: under the train stage, which reports the reason,
            # a clean exit (no launcher traceback); run by hand, a failure.
            return 0 if os.environ.get("DSFLOW_STATUS_FILE") else EXIT_FATAL
        if profiler.writes_at(step):
            with clock.aside():
                profiler.step_ends(step)
        else:
            profiler.step_ends(step)
        faults.after_step(step)
        # No periodic checkpoint during a run of bad steps: the last good one stays the newest.
        periodic = step % train["checkpoint_every"] == 0 and health.streak == 0
        if periodic or step == steps or stop:
            with clock.aside():
                save(step)
            last_saved = step
        if stop and step < steps:
            if rank == 0:
                logger.close()
                print(
                    f"[dsflow train] stopped on request after step {step}; checkpoint "
                    f"{ckpt.tag_for(step)} saved",
                    file=sys.stderr,
                )
            loader.close()
            # Asked by the train stage (checkpoints/.stop): a clean exit, the stage reports it.
            # Signalled directly: the conventional 128 + SIGTERM.
            return EXIT_STOPPED if Stop.requested else 0

    assert pending is None, "the last step is always read at once"
    loader.close()
    if last_saved != steps and start < steps:
        save(steps)
    if val_loss is None:
        val_loss = validate()
    # ZeRO-3: every rank takes part in gathering the full weights, rank 0 keeps them.
    weights = engine._zero3_consolidated_16bit_state_dict() if zero3 else None
    if rank == 0:
        if logger:
            logger.close()
        save_hf(model, FINAL, TOKENIZER, weights)
        zero = ds_config["zero_optimization"]
        hardware = {
            "device_name": device_name,
            "zero_stage": zero["stage"],
            "offload_optimizer": dsconfig.offload_device(zero, "optimizer"),
            "offload_param": dsconfig.offload_device(zero, "param"),
            "precision": train["precision"],
        }
        if device_type == "cuda":
            hardware["gpu_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
        write_metrics(
            history,
            plan,
            counts,
            val_loss,
            loss_value,
            time.perf_counter() - wall0,
            {
                **hardware,
                "skipped_steps": health.skipped,
                "bad_steps": health.bad,
                "grad_norm_spikes": health.spikes,
            },
        )
    dist.barrier()
    return 0


def write_metrics(history, plan, counts, val_loss, train_loss, wall_s, hardware) -> None:
    steady = history[min(len(history) - 1, max(1, len(history) // 10)) :] if history else []

    def mean(key):
        vals = [h[key] for h in steady if h.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    last = history[-1] if history else {}
    metrics = {
        "step": plan["steps"],
        "tokens": plan["steps"]
        * plan["batch"]["micro"]
        * plan["batch"]["accum"]
        * plan["world"]
        * plan["params"]["train"]["seq_len"],
        "train_loss": train_loss,
        "val_loss": val_loss,
        "tokens_per_s": mean("perf/tokens_per_s"),
        "mfu": mean("perf/mfu"),
        "step_s": mean("perf/step_s"),
        "data_wait_frac": mean("perf/data_wait_frac"),
        "peak_memory_gb_per_rank": [m / 1e9 for m in last.get("memory", [])],
        "peak_reserved_gb_per_rank": [m / 1e9 for m in last.get("reserved", [])],
        "experts_max_over_mean": last.get("experts/max_over_mean"),
        "experts_entropy_min": last.get("experts/entropy_min"),
        "world_size": plan["world"],
        "device": plan["device"],
        "params_total": counts["total"],
        "params_activated": counts["activated"],
        "wall_s": wall_s,
        **hardware,
    }
    with atomic_file(TRAIN_METRICS) as f:
        json.dump(metrics, f, indent=2, sort_keys=True)
        f.write("\n")


def shutdown(code: int) -> int:
    """Destroy the process group before the interpreter's teardown. Left to teardown, Gloo's
    worker threads can still hold work objects, and freeing them there aborts the process
    ("terminate called without an active exception", pytorch#190489): a finished run exiting
    -6. No collective here: a rank that returns early does not wait for the others."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(shutdown(main()))
