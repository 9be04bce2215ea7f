"""Every run-directory path, named once. Paths are relative to the project folder (the stages run
there); dvc.yaml and the Snakefile declare the same outputs (tests/unit/test_frontends.py checks
it).
"""

from __future__ import annotations

from pathlib import Path

# The checkpoint to continue from (model.pretrained), resolved once: a Hub id to its commit and
# files, a local folder to its content hash. The hashes' cache lets a rerun skip unchanged files.
PRETRAINED = Path("data/pretrained.json")
PRETRAINED_HASHES = Path("data/pretrained.hashes.json")

# Data stages: download -> tokenizer -> tokenize -> shard.
RAW = Path("data/raw")
RAW_PARTIAL = Path("data/raw.partial")  # a resumable hf download in progress
MANIFEST = RAW / "manifest.json"
RAW_PARTS = RAW / "parts.json"  # download.files.store reference: where the documents lie
TOKENIZER = Path("data/tokenizer")
TOKENS = Path("data/tokens")
SHARDS = Path("data/shards")

# plan -> train -> evaluate -> report.
PLAN = Path("reports/plan.json")
CHECKPOINTS = Path("checkpoints")
FINAL = Path("models/final")
LIVE = Path("dvclive")
TRAIN_METRICS = Path("metrics/train.json")
EVAL_METRICS = Path("metrics/eval.json")
EVAL_DETAILS = Path("reports/eval")
REPORT_HTML = Path("reports/report.html")
REPORT_MD = Path("reports/report.md")
FIGURES = Path("reports/figures")
LOGS = Path("logs")
PROFILE = LOGS / "profile.txt"


def shard_index(split: str) -> Path:
    """The index of one split's shards (train or val)."""
    return SHARDS / split / "index.json"


def export_dir(tag: str) -> Path:
    """Where `dsflow export` writes a checkpoint's HF model unless --out says otherwise."""
    return Path(f"models/export-{tag}")


# The project lock (dsflow.lock): one lock file per path below, and each holder's name.
LOCKS = Path(".locks")

# What each stage reads and writes, as dvc.yaml declares its data deps and outs
# (tests/unit/test_trust_lock.py checks they agree): the paths the project lock holds while it runs.
# export reads a checkpoint's tag, complete once named, so it may run beside a training.
STAGE_IO: dict[str, tuple[tuple[Path, ...], tuple[Path, ...]]] = {
    "pretrained": ((), (PRETRAINED,)),
    "download": ((), (RAW,)),
    "tokenizer": ((RAW, PRETRAINED), (TOKENIZER,)),
    "tokenize": ((RAW, TOKENIZER), (TOKENS,)),
    "shard": ((TOKENS, TOKENIZER), (SHARDS,)),
    "plan": ((SHARDS, PRETRAINED), (PLAN,)),
    "train": ((SHARDS, TOKENIZER, PRETRAINED, PLAN), (FINAL, CHECKPOINTS, LIVE, TRAIN_METRICS)),
    "evaluate": ((FINAL, SHARDS, RAW), (EVAL_METRICS, EVAL_DETAILS)),
    "report": (
        (TRAIN_METRICS, EVAL_METRICS, EVAL_DETAILS, PLAN),
        (REPORT_HTML, REPORT_MD, FIGURES),
    ),
    "export": ((TOKENIZER,), ()),
}
