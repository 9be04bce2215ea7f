"""A training step's numbers: captured on the device, read back without making the host wait,
timed, checked for health, logged (DVCLive, the progress bar) and summed up in
metrics/train.json.

`float(t)` or `.tolist()` of a CUDA tensor waits until the device has run everything queued
before it. At the end of a step that empties the device's queue: the GPU then idles while the
host logs, and while it launches the next forward's first kernels (docs/performance.md gives
the measured share of a step). A `Readback`
copies the values it is given into pinned host memory behind the step's work and records an
event; `values()` waits for that event only. Read one step later (train.perf.async_metrics),
that event has long passed, and the device has the next step's work queued meanwhile.

On CPU everything is already done when it is queued: the values are copied at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsflow.atomic import atomic_dir, atomic_file
from dsflow.model.flops import flops_per_token, mfu, mfu_peak
from dsflow.paths import CHECKPOINTS, LIVE, TRAIN_METRICS
from dsflow.progress import bar
from dsflow.train.checkpoint import STOP_FILE
from dsflow.train.health import Stop

# In a run's last checkpoint tag: its metrics/train.json and dvclive/ as it finished.
FINISHED = "finished"
# The health state's key (saved with every checkpoint) for the run's training seconds so far.
WALL_KEY = "wall_s"


class Readback:
    """`values` maps names to tensors (any shape, any device, read as float64; 0-dim ones come
    back as floats, others as CPU tensors) or host values (returned as they are)."""

    def __init__(self, values: dict[str, Any], device: torch.device, timed: bool = False):
        self._host = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        self._layout = [(k, tuple(v.shape)) for k, v in tensors.items()]
        self.event = None
        self._buffer = None
        cuda = device.type == "cuda"
        if tensors:
            flat = torch.cat(
                [
                    v.detach().reshape(-1).to(device=device, dtype=torch.float64)
                    for v in tensors.values()
                ]
            )
            if cuda:
                self._buffer = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
                self._buffer.copy_(flat, non_blocking=True)
            else:
                self._buffer = flat.cpu()
        if cuda:
            self.event = torch.cuda.Event(enable_timing=timed)
            self.event.record()

    def values(self) -> dict[str, Any]:
        if self.event is not None:
            self.event.synchronize()
        out = dict(self._host)
        offset = 0
        for name, shape in self._layout:
            n = math.prod(shape)
            chunk = self._buffer[offset : offset + n]
            offset += n
            out[name] = float(chunk[0]) if shape == () else chunk.view(shape).clone()
        return out


class EventClock:
    """Step times from CUDA events, for steps whose end the host does not wait for: a step runs
    from the previous step's end event to its own (so the device's idle time between them
    counts, as with a host clock after a sync); the first step, and the first after `aside()`
    (validation, checkpoints: reported on their own), from an event recorded as it begins."""

    def __init__(self):
        self._last: torch.cuda.Event | None = None
        self._begin: torch.cuda.Event | None = None

    def step_begins(self) -> None:
        if self._last is None:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()

    def step_done(self, end: torch.cuda.Event) -> tuple:
        """The step's (begin, end) events: `seconds()` of them once `end` has passed."""
        begin = self._last if self._last is not None else self._begin
        self._last = end
        return (begin, end)

    def aside(self) -> None:
        """Call after work that is not a step (it then starts the next step's timing anew)."""
        self._last = None

    @staticmethod
    def seconds(span: tuple) -> float:
        begin, end = span
        return begin.elapsed_time(end) / 1e3


class StepClock:
    """A step's time is the period since the last step ended, so the per-step bookkeeping (loss
    all-reduce, expert stats, logging), during which the device idles, counts; what runs
    inside `aside()` (validation, checkpoint saves, profile writing) does not: it is
    reported on its own. The first step is timed from its own start.

    With `events` (CUDA, train.perf.async_metrics) the host does not wait for a step's end, so
    the period is measured between CUDA events on the device (EventClock):
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


class Logger:
    """Rank 0 only: DVCLive metrics (for dvc plots / metrics) and the progress bar."""

    def __init__(self, start: int, steps: int, resumed: bool):
        import dvclive.live  # imported on rank 0 only: the others log nothing
        from dvclive import Live

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
            # costs more than the last (bench/logging_overhead.py measures it), all of it time
            # the GPU waits. With Studio
            # set up it stays as it is.
            self.live.post_data_to_studio = lambda: None
        # The run's average rate, not tqdm's moving one: a validation or a save pauses one step,
        # and the log keeps the bar as drawn at those very steps (its time left twice too long).
        self.bar = bar(desc="train", total=steps, initial=start, unit="step", smoothing=0)
        self.warm = False

    def log(self, step: int, metrics: dict) -> None:
        self.live.step = step
        for name, value in metrics.items():
            if value is not None and math.isfinite(value):
                self.live.log_metric(name, value)
        self.live.next_step()

    def progress(self, loss: float, tokens_per_s: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.bar.update(1)
        if not self.warm and not self.bar.disable:
            # The first step holds the compilation and warm-up: the average starts after it.
            self.warm = True
            self.bar.start_t, self.bar.initial = self.bar._time(), self.bar.n

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


def summary(spec, history, counts, val_loss, train_loss, wall_s, hardware) -> dict:
    """metrics/train.json's content: the run's summary, means over its steady steps (the first
    tenth of the steps, at least the first, warm up)."""
    steady = history[min(len(history) - 1, max(1, len(history) // 10)) :] if history else []

    def mean(key):
        vals = [h[key] for h in steady if h.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    last = history[-1] if history else {}
    peak, peak_what = mfu_peak(hardware.get("device_name", "cpu"), spec.precision, spec.peak_tflops)
    if mean("perf/mfu") is not None:
        print(
            f"[dsflow train] MFU {100 * mean('perf/mfu'):.1f}% of the {peak_what}", file=sys.stderr
        )
    return {
        "step": spec.steps,
        "tokens": spec.steps * spec.global_tokens,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "tokens_per_s": mean("perf/tokens_per_s"),
        "mfu": mean("perf/mfu"),
        "mfu_peak_tflops": peak / 1e12 if peak else None,
        "mfu_peak": peak_what if peak else None,
        "step_s": mean("perf/step_s"),
        "data_wait_frac": mean("perf/data_wait_frac"),
        "peak_memory_gb_per_rank": [m / 1e9 for m in last.get("memory", [])],
        "peak_reserved_gb_per_rank": [m / 1e9 for m in last.get("reserved", [])],
        # What the planner predicted for peak_reserved_gb_per_rank (dsflow.plan.memory), on a GPU.
        "planned_reserved_gb": (
            spec.planned_reserved_bytes / 1e9 if spec.planned_reserved_bytes else None
        ),
        # Multi-token prediction: each depth's loss at the last step.
        **{k.split("/")[1]: v for k, v in last.items() if k.startswith("train/mtp_loss_")},
        "experts_max_over_mean": last.get("experts/max_over_mean"),
        "experts_entropy_min": last.get("experts/entropy_min"),
        "world_size": spec.world,
        "device": spec.device,
        "params_total": counts["total"],
        "params_activated": counts["activated"],
        "wall_s": wall_s,
        **hardware,
    }


def metrics_text(metrics: dict) -> str:
    return json.dumps(metrics, indent=2, sort_keys=True) + "\n"


def write_metrics(metrics: dict, record: Path | None = None) -> None:
    """metrics/train.json; with `record` (the run's last checkpoint tag) first kept there, with
    dvclive/, so that a train stage started again on the finished run writes the same outputs
    (`restore_finished`) instead of resuming into a run of no step."""
    if record is not None:
        with atomic_dir(record / FINISHED) as tmp:
            (tmp / TRAIN_METRICS.name).write_text(metrics_text(metrics))
            if LIVE.is_dir():
                shutil.copytree(LIVE, tmp / LIVE.name)
    with atomic_file(TRAIN_METRICS) as f:
        f.write(metrics_text(metrics))


def finished_record(record: Path) -> Path | None:
    """What the run kept in `record` (its last checkpoint tag) when it finished; None when it
    kept nothing (saved by an older dsflow, or stopped between that checkpoint and its
    outputs)."""
    kept = record / FINISHED
    return kept if (kept / TRAIN_METRICS.name).is_file() else None


def restore_finished(record: Path) -> bool:
    """metrics/train.json and dvclive/ as the run kept them in `record` when it finished;
    False when it kept none."""
    kept = finished_record(record)
    if kept is None:
        return False
    if (kept / LIVE.name).is_dir():
        with atomic_dir(LIVE) as tmp:
            shutil.copytree(kept / LIVE.name, tmp, dirs_exist_ok=True)
    with atomic_file(TRAIN_METRICS) as f:
        f.write((kept / TRAIN_METRICS.name).read_text())
    return True


def history_from_live(root: Path = LIVE) -> list[dict]:
    """The logged steps' metrics as `summary` reads them ({"step": n, "perf/step_s": ..., ...},
    in step order), from dvclive's TSVs: what is left of a finished run that kept no record."""
    steps: dict[int, dict] = {}
    base = root / "plots" / "metrics"
    for tsv in sorted(base.rglob("*.tsv")):
        name = tsv.relative_to(base).with_suffix("").as_posix()
        lines = tsv.read_text().splitlines()
        if not lines:
            continue
        header = lines[0].split("\t")
        for row in lines[1:]:
            cells = dict(zip(header, row.split("\t"), strict=False))
            with contextlib.suppress(KeyError, ValueError):  # a row cut short by a kill
                value, step = float(cells[name.split("/")[-1]]), int(cells["step"])
                steps.setdefault(step, {"step": step})[name] = value
    return [steps[k] for k in sorted(steps)]


class Meter:
    """Each step's numbers, from the device to the logs: `capture` queues them (every rank runs
    the same collectives), `settle` reads them back, at once or one step late
    (train.perf.async_metrics), checks the run's health, validates when due and logs (rank 0).

    One step late, the host reads step N's numbers after it has queued step N+1, so the device
    never waits for the host between steps. Steps that evaluate, checkpoint or end the run are
    read at once: their decisions need them."""

    def __init__(self, run, spec, health, validate, start: int, wall_before: float = 0.0):
        self.run, self.spec, self.health, self.validate = run, spec, health, validate
        # The run's seconds before this launch (its earlier parts, up to the checkpoint this
        # one resumed from), so that wall_s counts the whole run.
        self.wall_before, self.wall0 = wall_before, time.perf_counter()
        self.late = run.perf.async_metrics
        self.clock = StepClock(events=self.late and run.cuda)
        self.logger = Logger(start, spec.steps, resumed=start > 0) if run.rank == 0 else None
        self.fpt = flops_per_token(
            run.model.config,
            spec.seq_len,
            frozen=spec.lora_on,
            mtp_depth=spec.model.get("mtp_depth", 0),
        )
        self.device_name = torch.cuda.get_device_name(run.device) if run.cuda else "cpu"
        # MFU against the datasheet dense peak of the precision in use (train.peak_tflops wins).
        self.peak, _ = mfu_peak(self.device_name, spec.precision, spec.peak_tflops)
        self.history: list[dict] = []
        self.pending: Readback | None = None
        self.val_loss: float | None = None
        self.loss = float("nan")

    def wall_s(self) -> float:
        """The run's training seconds so far: its earlier parts and this one."""
        return self.wall_before + time.perf_counter() - self.wall0

    def state(self) -> dict:
        """What a checkpoint keeps of the run's health and clock (resume gives it back)."""
        return {**self.health.state(), WALL_KEY: self.wall_s()}

    def capture(self, step: int, loss_sum: torch.Tensor, data_wait: float, t0: float) -> Readback:
        """Step `step`'s numbers, queued for reading back."""
        run, world = self.run, self.run.world
        loss = loss_sum / self.spec.accum
        if world > 1:
            dist.all_reduce(loss)
            loss = loss / world
        parts = {}
        if loss.dim():  # multi-token prediction: [loss, main loss, each depth's loss]
            parts, loss = {"main": loss[1], "mtp": loss[2:]}, loss[0]
        if run.applied_on_device:
            applied = run.applied()
        else:
            applied = bool(run.engine.was_step_applied())
        if applied is False:
            # A skipped update (overflow) must not move the expert biases either.
            run.balancer.reset()
            expert = {}
        else:
            expert = run.balancer.update_async(applied=applied)
        values = {
            "step": step,
            "loss": loss,
            "applied": applied,
            "grad_norm": run.engine.get_global_grad_norm(),
            "lr": run.engine.get_lr()[0],
            "data_wait": data_wait,
            **parts,
            **{f"expert.{k}": v for k, v in expert.items()},
            **self._stop_and_peaks(),
        }
        if not self.late and run.cuda:
            torch.cuda.synchronize(run.device)
        record = Readback(values, run.device, timed=self.clock.events is not None)
        record.dt = self.clock.step_done(t0, record.event)
        return record

    def _stop_and_peaks(self) -> dict:
        """The stop request and every rank's peak memory (allocated, reserved)."""
        run = self.run
        requested = Stop.requested or (CHECKPOINTS / STOP_FILE).exists()
        peaks = [
            peak_memory_bytes(run.device),
            torch.cuda.max_memory_reserved(run.device) if run.cuda else 0,
        ]
        if run.world == 1:
            return {"stop": requested, "peaks": [peaks]}
        # All ranks take the stop decision together, from the same all-reduced flag.
        # (No copy from pageable host memory: on CUDA that would wait for the step.)
        device = run.device
        flag = torch.full((1,), 1.0 if requested else 0.0, dtype=torch.float64, device=device)
        dist.all_reduce(flag)
        mine = torch.tensor(peaks, dtype=torch.int64, pin_memory=run.cuda).to(
            device, non_blocking=run.cuda
        )
        gathered = torch.zeros(run.world * 2, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(gathered, mine)
        return {"stop": flag[0], "peaks": gathered.view(run.world, 2)}

    def settle(self, step: int, record: Readback) -> tuple[str | None, bool]:
        """Read back what is due after step `step`: (why the run must stop, or None; whether a
        stop was requested)."""
        spec = self.spec
        due = not self.late or step == spec.steps or spec.eval_due(step)
        due = due or spec.checkpoint_due(step)
        ready = [r for r in (self.pending, record if due else None) if r is not None]
        self.pending = None if due else record
        stop, fatal = False, None
        for r in ready:
            event, requested = self.finish(r)
            stop, fatal = stop or requested, event["stop"]
            if fatal:
                break
        if stop and self.pending is not None and not fatal:
            # This step is checkpointed next: its own numbers (health) first.
            event, _ = self.finish(self.pending)
            self.pending, fatal = None, event["stop"]
        return fatal, stop

    def finish(self, record: Readback) -> tuple[dict, bool]:
        """Read a captured step back: health, validation when due, logging. Returns the health
        event and whether a stop was requested."""
        v = record.values()
        step = v["step"]
        # train/loss is the next-token loss val/loss measures; health watches what is trained.
        self.loss = v.get("main", v["loss"])
        applied = bool(v["applied"])
        snapshot = {k.split(".", 1)[1]: x for k, x in v.items() if k.startswith("expert.")}
        expert = self.run.balancer.stats_of(snapshot) if applied else {}
        grad_norm = float(v["grad_norm"]) if v["grad_norm"] is not None else None
        event = self.health.observe(step, v["loss"], applied, grad_norm)
        dt = self.clock.seconds(record.dt)
        eval_due = self.spec.eval_due(step)
        if not event["bad"] and eval_due:
            with self.clock.aside():
                self.val_loss = self.validate()
        if self.run.rank == 0:
            self._log(step, v, dt, grad_norm, expert, event, eval_due)
        return event, bool(v["stop"])

    def _log(self, step, v, dt, grad_norm, expert, event, eval_due) -> None:
        """Rank 0: the step's metrics to DVCLive and the progress bar, and into history."""
        spec, health = self.spec, self.health
        tokens_per_s = spec.global_tokens / dt
        peaks = [[int(x) for x in row] for row in v["peaks"]]
        memory, reserved = [p[0] for p in peaks], [p[1] for p in peaks]
        metrics = {
            "train/loss": self.loss,
            "train/lr": v["lr"],
            "train/grad_norm": grad_norm,
            "train/skipped_steps": float(health.skipped),
            "perf/tokens_per_s": tokens_per_s,
            "perf/mfu": mfu(tokens_per_s / spec.world, self.fpt, self.peak),
            "perf/step_s": dt,
            "perf/data_wait_frac": v["data_wait"] / dt,
            "memory/peak_gb_max": max(memory) / 1e9,
            "experts/max_over_mean": expert.get("max_over_mean"),
            "experts/entropy_min": expert.get("entropy_min"),
            "tokens": step * spec.global_tokens,
        }
        for k, value in enumerate(v.get("mtp", []), start=1):
            metrics[f"train/mtp_loss_{k}"] = float(value)
        if event["spike"] is not None:
            metrics["train/grad_norm_spike"] = event["spike"]
        say_health(step, event, grad_norm, self.loss, health)
        if self.val_loss is not None and eval_due:
            metrics["val/loss"] = self.val_loss
        if step % spec.log_every == 0 or step == spec.steps or "val/loss" in metrics:
            self.logger.log(step, metrics)
        self.logger.progress(self.loss, tokens_per_s)
        row = {"step": step, "dt": dt, "memory": memory, "reserved": reserved, "expert": expert}
        self.history.append({**row, **metrics})

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


def say_health(step: int, event: dict, grad_norm: float | None, loss: float, health) -> None:
    """One line on stderr for a spike, a non-finite loss or a skipped update."""
    if event["spike"] is not None:
        print(
            f"[dsflow train] step {step}: grad norm {grad_norm:.4g} is "
            f"{event['spike']:.1f}x its running median",
            file=sys.stderr,
        )
    if event["bad"]:
        print(
            f"[dsflow train] step {step}: loss is {loss}; update skipped "
            f"({health.streak} in a row, the run stops at {health.max_bad})",
            file=sys.stderr,
        )
    elif event["skipped"]:
        print(
            f"[dsflow train] step {step}: gradient overflow, update skipped "
            f"({health.skipped} skipped so far)",
            file=sys.stderr,
        )
