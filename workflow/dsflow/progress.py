"""Progress bars and stage logging shared by every stage."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

from dsflow.paths import LOGS

log = logging.getLogger("dsflow")


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


def setup_logging(stage: str, log_dir: str | Path = LOGS, append: bool = False) -> None:
    """Messages go to stderr and to logs/<stage>.log (the log file Snakemake declares)."""
    if os.environ.get("DSFLOW_PROGRESS", "1") == "0":
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(f"[dsflow {stage}] %(message)s"))
    log.addHandler(console)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_dir / f"{stage}.log", mode="a" if append else "w")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(file_handler)
