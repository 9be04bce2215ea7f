"""A run's health, seen the same way by every rank: skipped and non-finite steps, gradient-norm
spikes, stop requests, and the exit codes and one-line reasons the train stage turns into
messages (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import statistics
import sys
import time
import traceback
from collections import deque
from pathlib import Path

from dsflow.launch import RANKS_DIR_ENV

EXIT_FATAL = 3  # a one-line reason is in DSFLOW_STATUS_FILE (the train stage prints it)
EXIT_STOPPED = 143  # stopped on request (SIGTERM / SIGINT / checkpoints/.stop), checkpoint saved
EXIT_RAISED = 1  # an exception, recorded for the train stage (report_exception)
# What a rank raises when a peer is gone or never came (gloo's RuntimeError names itself; NCCL
# raises torch.distributed.DistError): a consequence, not the cause.
PEER_LOST = re.compile(r"gloo|NCCL|Connection (reset|closed) by peer|Timed out waiting")

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


def report_fatal(message: str) -> None:
    """One line for the train stage to print (the first rank to fail wins), and on stderr."""
    print(f"[dsflow train] error: {message}", file=sys.stderr, flush=True)
    path = os.environ.get("DSFLOW_STATUS_FILE")
    if path:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(message.replace("\n", " ") + "\n")


def lost_a_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank died or hung."""
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return bool(PEER_LOST.search(str(exc)))


def report_exception(exc: BaseException) -> bool:
    """In a rank started by the train stage: record `exc` as rankR.error in $DSFLOW_RANKS_DIR
    (rank, PID, time, type, message, traceback, whether a peer was lost) for the stage, which
    prints one line for the run and puts the tracebacks in its log. False when there is no stage
    to tell (run by hand: the caller lets the traceback show)."""
    folder = os.environ.get(RANKS_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    rank = int(os.environ.get("RANK", 0))
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "type": type(exc).__name__,
        "message": " ".join(str(exc).split()),
        "peer_lost": lost_a_peer(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    path = Path(folder) / f"rank{rank}.error"
    with contextlib.suppress(OSError):
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)
    return True


def rank_errors(folder: Path) -> list[dict]:
    """The exceptions report_exception recorded in `folder`, first raised first."""
    errors = []
    for path in folder.glob("rank*.error"):
        with contextlib.suppress(OSError, ValueError):
            errors.append(json.loads(path.read_text()))
    return sorted(errors, key=lambda e: (e.get("time", 0), e.get("rank", 0)))


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
