"""Progress bars and stage logging shared by every stage.

A stage's log, logs/<stage>.log, holds every line the stage and its ranks print, in order: the
stage's own messages through its logger, the ranks' output through a pump (child_output) that
copies it to the terminal and appends it to the log line by line, less the noise (LogLines). Every writer appends (O_APPEND)
whole lines, so none overwrites another's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from dsflow.paths import LOGS

log = logging.getLogger("dsflow")
# How long a stage waits for the pump to write the ranks' last lines once they are gone (only a
# process they left behind, still holding the pipe, makes it wait that long).
PUMP_DRAIN_S = 30


def bar(
    iterable=None, *, desc: str, total: int | None = None, unit: str = "it", disable=False, **kw
):
    """A tqdm bar on stderr; DSFLOW_PROGRESS=0 turns bars off (e.g. in CI logs)."""
    disable = disable or os.environ.get("DSFLOW_PROGRESS", "1") == "0"
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        unit_scale=True,
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
        disable=disable,
        **kw,
    )


def setup_logging(stage: str, log_dir: str | Path = LOGS, to_file: bool = True) -> None:
    """Messages go to stderr and, with `to_file`, to logs/<stage>.log (the log file Snakemake
    declares), emptied first. A stage's ranks log with `to_file=False`: their stderr reaches the
    log through the stage (child_output)."""
    if os.environ.get("DSFLOW_PROGRESS", "1") == "0":
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(f"[dsflow {stage}] %(message)s"))
    log.addHandler(console)
    if not to_file:
        return
    path = Path(log_dir) / f"{stage}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    # Appending, not "w": a "w" handle writes at its own offset, over the lines others appended.
    file_handler = logging.FileHandler(path, mode="a")
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s [dsflow {stage}] %(message)s"))
    log.addHandler(file_handler)


def log_file() -> Path | None:
    """The log the stage's messages go to (None: stderr only)."""
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return None


def to_log(text: str, path: Path | None = None) -> None:
    """Append `text` to the stage's log only (or to `path`): for what the stage already printed
    itself (its one-line error, a traceback)."""
    path = path or log_file()
    if path is None:
        return
    for handler in log.handlers:
        # A stage refused before it set up its logging still has an earlier stage's handlers in
        # this process (the tests call cli.main in-process), whose streams may be closed.
        with contextlib.suppress(ValueError):
            handler.flush()
    lines = text.rstrip("\n").split("\n")
    with path.open("a") as f:
        f.write("".join(f"{stamp()} {line}\n" for line in lines))


class LoggedStream(io.TextIOBase):
    """A stage's own stdout or stderr: what it prints goes on to `stream` and, line by line, into
    the stage's log (its logger's lines reach the log on their own, not through this)."""

    def __init__(self, stream):
        self.stream = stream
        self.pending = ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        *lines, rest = (self.pending + text).split("\n")
        self.pending = unfinished(rest.encode()).decode()
        for line in lines:
            to_log(shown(line.encode()).decode())
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def close_line(self) -> None:
        """Log a last line printed without its newline."""
        if self.pending:
            to_log(shown(self.pending.encode()).decode())
            self.pending = ""

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # tqdm draws its unicode bars only on a stream that names one
        return getattr(self.stream, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True


@contextlib.contextmanager
def logged_prints() -> Iterator[None]:
    """While the stage runs, what it prints itself (a plan's table, a warning) is in its log."""
    out, err = LoggedStream(sys.stdout), LoggedStream(sys.stderr)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        out.close_line()
        err.close_line()


def stamp(now: float | None = None) -> str:
    """The time as logging's asctime writes it (2024-01-31 12:00:00,123)."""
    now = time.time() if now is None else now
    return (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
    )


def shown(line: bytes) -> bytes:
    """What a terminal shows of one output line: a progress bar's last redraw, not all of them."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def unfinished(rest: bytes) -> bytes:
    """The part of an unfinished line that can still show: a progress bar redraws its line with
    \r and never ends it, so only its last redraw is kept (the held text stays bounded)."""
    cut = rest.rstrip(b"\r").rfind(b"\r")
    return rest[cut + 1 :] if cut >= 0 else rest


# Lines the ranks print that look like trouble and are none, left out of the stage's log (the
# terminal shows what was printed):
LOG_NOISE = (
    # DeepSpeed, once per rank, as it loads the CPU op the stage built before the launch.
    re.compile(rb"deepspeed_shm_comm_op built successfully"),
    # DeepSpeed's scheduler asked for its lr before the first step: that lr is the schedule's
    # first, as intended.
    re.compile(rb"get learning rate from scheduler before it has started"),
)
# A Python warning as the warnings module prints it: "PATH:LINE: SomeWarning: message", then the
# source line it points at, indented.
WARNING = re.compile(rb"\S+\.py:\d+: \w*Warning: ")
# The same warning from every rank: torch's "[rank1]:W1206 08:22:25.27 28636 file.py:630] ...",
# a Python warning (after whatever a progress bar left on its line), a library that did not load.
REPEATED = re.compile(
    rb"(?:\[rank\d+\]:)?W\d{4} [\d:.]+ \d+ (?P<torch>.*)"
    rb"|.*?(?P<python>\w[\w/.+-]*\.py:\d+: \w*Warning: .*)"
    rb"|(?P<load>Failed to load .*)"
)
# Where installed packages live: a path inside one is shown from the package on.
SITE_PACKAGES = re.compile(rb"(?:/[\w.+-]+)*/?\b(?:site|dist)-packages/")


class LogLines:
    """What the stage's log keeps of its ranks' lines: none of LOG_NOISE; paths into installed
    packages from the package on; a warning once, as the first rank printed it, without the
    source line a Python warning prints under itself."""

    def __init__(self):
        self.seen: set[bytes] = set()
        self.after_warning = False

    def kept(self, line: bytes) -> bytes | None:
        """`line` as the log keeps it, or None."""
        if self.after_warning and line.startswith(b"  "):
            self.after_warning = False
            return None  # the source line the warning printed under itself
        self.after_warning = bool(WARNING.search(line))
        if any(noise.search(line) for noise in LOG_NOISE):
            return None
        line = SITE_PACKAGES.sub(b"", line)
        repeated = REPEATED.match(line)
        if repeated:
            said = next(g for g in repeated.groups() if g is not None)
            if said in self.seen:
                return None
            self.seen.add(said)
        return line


def pump(log_path: str, source: int = 0, terminal: int = 1) -> None:
    """Copy file descriptor `source` to `terminal` as it comes (progress bars stay live) and
    append each whole line to `log_path`. Signals are ignored: when the stage is interrupted or
    killed, its ranks still checkpoint and print, and their last lines still reach the log."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    out = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pending = b""
    keep = LogLines()
    while chunk := os.read(source, 1 << 16):
        with contextlib.suppress(OSError):  # the terminal went away: keep logging
            os.write(terminal, chunk)
        *lines, pending = (pending + chunk).split(b"\n")
        pending = unfinished(pending)
        kept = [x for x in (keep.kept(shown(x)) for x in lines) if x is not None]
        if kept:
            os.write(out, b"".join(f"{stamp()} ".encode() + x + b"\n" for x in kept))
    if pending and (last := keep.kept(shown(pending))) is not None:
        os.write(out, f"{stamp()} ".encode() + last + b"\n")
    os.close(out)


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return 2


def whole_lines(env: dict) -> dict:
    """`env` for processes that share one child_output pipe: without PYTHONUNBUFFERED, under
    which print() writes its text and its newline apart, so two ranks' lines could interleave
    mid-line (Python's stderr is line-buffered anyway: each line still leaves at once)."""
    return {k: v for k, v in env.items() if k != "PYTHONUNBUFFERED"}


@contextlib.contextmanager
def child_output() -> Iterator[int | None]:
    """A file descriptor for the stdout and stderr of the processes a stage starts (launcher,
    ranks): what they print reaches this stage's stderr and its log, whole lines in order. None
    when the stage has no log (the children then share this process's stdout and stderr)."""
    path = log_file()
    if path is None:
        yield None
        return
    for handler in log.handlers:
        handler.flush()
    read, write = os.pipe()
    code = f"from dsflow.progress import pump; pump({str(path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=read, stdout=_stderr_fd())
    os.close(read)
    try:
        yield write
    finally:
        os.close(write)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=PUMP_DRAIN_S)
