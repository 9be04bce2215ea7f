"""Checkpoints in checkpoints/: DeepSpeed's own format, one tag per saved step, `latest` marker.

A checkpoint is only resumed when the run it came from trained the same thing: `fingerprint`
hashes every param that changes the math (model, data, batch, optimizer, schedule shape), but not
the budget, so raising max_steps continues a run while changing lr starts a new one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

CHECKPOINTS = Path("checkpoints")
TAG_PREFIX = "step"

# Params that may change between a run and its resumption.
RESUMABLE_KEYS = {
    "max_steps",
    "max_tokens",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "peak_tflops",
    "launcher",
    "master_port",
    "force",
}


def fingerprint(params: dict, world: int, data_sha: str) -> str:
    train = {k: v for k, v in params["train"].items() if k not in RESUMABLE_KEYS}
    blob = json.dumps(
        {
            "seed": params["seed"],
            "model": params["model"],
            "train": train,
            "world": world,
            "data": data_sha,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def tags(root: Path = CHECKPOINTS) -> list[str]:
    return sorted(p.name for p in root.glob(f"{TAG_PREFIX}*") if p.is_dir())


def latest_tag(root: Path = CHECKPOINTS) -> str | None:
    marker = root / "latest"
    if not marker.exists():
        return None
    tag = marker.read_text().strip()
    return tag if (root / tag).is_dir() else None


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
    """Remove a previous run's checkpoints (a different fingerprint cannot be resumed)."""
    for tag in tags(root):
        shutil.rmtree(root / tag, ignore_errors=True)
    (root / "latest").unlink(missing_ok=True)
