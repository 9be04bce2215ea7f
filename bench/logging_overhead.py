"""The train stage's per-step metric logging: DVCLive as is against dsflow's Logger, side by side.

DVCLive 3.49 re-reads every metric's TSV at each step for DVC Studio, even when Studio is not
set up; the train stage's Logger (dsflow.train.metrics) leaves that out then. Both log the 12
metrics the train stage logs per step into their own temporary directory; printed: the mean host
time per step's logging around a few step counts, and the ratio.

    python bench/logging_overhead.py --steps 2000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import dvclive.live
from dvclive import Live

from dsflow.train.metrics import Logger

METRICS = 12


def run(kind: str, steps: int) -> dict[int, float]:
    """Seconds each step's logging took, by step."""
    os.chdir(tempfile.mkdtemp(prefix=f"bench-logging-{kind}-"))
    if kind == "dsflow":
        logger = Logger(0, steps, resumed=False)

        def log(step: int, metrics: dict) -> None:
            logger.log(step, metrics)
    else:
        dvclive.live.get_dvc_repo = lambda: None  # as the Logger does outside `dvc repro`
        live = Live("dvclive", save_dvc_exp=False, dvcyaml=None, report=None)

        def log(step: int, metrics: dict) -> None:
            live.step = step
            for name, value in metrics.items():
                live.log_metric(name, value)
            live.next_step()

    times = {}
    for step in range(1, steps + 1):
        metrics = {f"metric/{i}": 1.0 / (step + i) for i in range(METRICS)}
        t = time.perf_counter()
        log(step, metrics)
        times[step] = time.perf_counter() - t
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    os.environ.pop("DVC_ROOT", None)
    os.environ["DSFLOW_PROGRESS"] = "0"  # the Logger's progress bar
    plain, ours = run("dvclive", args.steps), run("dsflow", args.steps)
    print(
        f"{'step':>6} {'DVCLive ms':>11} {'dsflow ms':>10} {'ratio':>7}  (mean of the 10 steps up to it)"
    )
    marks = [s for s in (10, 100, 500, 1000, 2000, 5000, 10000) if s <= args.steps]
    for s in marks:
        window = range(max(1, s - 9), s + 1)
        a = 1e3 * sum(plain[i] for i in window) / len(window)
        b = 1e3 * sum(ours[i] for i in window) / len(window)
        print(f"{s:>6} {a:>11.2f} {b:>10.2f} {a / b:>6.1f}x")


if __name__ == "__main__":
    main()
