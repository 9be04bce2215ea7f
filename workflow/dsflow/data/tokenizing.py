"""Stage `tokenize`: documents -> token ids, via `datasets.map` -> data/tokens/{split}.parquet.

Each row is one document: its ids followed by EOS, and its UTF-8 byte count (bits-per-byte needs
the bytes behind every token). Workers are single-threaded processes (`tokenize.num_proc`), so the
knob means what it says and results do not depend on thread scheduling.

The file is `tokenizing.py`, not `tokenize.py`, so it never shadows the standard library's module.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow.compute as pc
from tokenizers import Tokenizer

from dsflow.atomic import atomic_dir, write_json
from dsflow.errors import UsageError
from dsflow.paths import RAW, TOKENIZER, TOKENS
from dsflow.progress import log

SPLITS = ("train", "val")

_tokenizer = None


def _encoder(tokenizer_dir: str):
    """The raw `tokenizers.Tokenizer`, loaded once per worker process."""
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    return _tokenizer


def encode_batch(batch: dict, tokenizer_dir: str, eos_id: int) -> dict:
    texts = batch["text"]
    encodings = _encoder(tokenizer_dir).encode_batch_fast(texts, add_special_tokens=False)
    return {
        "input_ids": [enc.ids + [eos_id] for enc in encodings],
        "n_bytes": [len(t.encode("utf-8")) for t in texts],
    }


def tokenize_split(src: Path, dst: Path, cache: Path, eos_id: int, cfg: dict) -> dict:
    import datasets

    datasets.disable_caching()
    ds = datasets.Dataset.from_parquet(str(src), cache_dir=str(cache), columns=["text"])
    out = ds.map(
        encode_batch,
        batched=True,
        batch_size=cfg["batch_size"],
        num_proc=cfg["num_proc"] if cfg["num_proc"] > 1 else None,
        remove_columns=["text"],
        fn_kwargs={"tokenizer_dir": str(TOKENIZER), "eos_id": eos_id},
        features=datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("uint32")),
                "n_bytes": datasets.Value("int64"),
            }
        ),
        desc=f"tokenize {src.stem}",
        keep_in_memory=False,
        cache_file_name=str(cache / f"{src.stem}.arrow"),
    )
    out.to_parquet(str(dst))
    table = out.data.table
    return {
        "docs": len(out),
        "tokens": pc.sum(pc.list_value_length(table.column("input_ids"))).as_py(),
        "bytes": pc.sum(table.column("n_bytes")).as_py(),
    }


def run(params: dict) -> None:
    from transformers import AutoTokenizer

    for split in SPLITS:
        if not (RAW / f"{split}.parquet").exists():
            raise UsageError(f"{RAW / split}.parquet: missing; run the download stage first")
    if not (TOKENIZER / "tokenizer.json").exists():
        raise UsageError(f"{TOKENIZER}/tokenizer.json: missing; run the tokenizer stage first")
    eos_id = AutoTokenizer.from_pretrained(TOKENIZER).eos_token_id
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with atomic_dir(TOKENS) as tmp:
        cache = tmp / ".cache"
        cache.mkdir()
        meta = {"eos_id": eos_id, "splits": {}}
        for split in SPLITS:
            meta["splits"][split] = tokenize_split(
                RAW / f"{split}.parquet",
                tmp / f"{split}.parquet",
                cache,
                eos_id,
                params["tokenize"],
            )
        shutil.rmtree(cache)
        write_json(tmp / "meta.json", meta)
    log.info("tokenized -> %s", TOKENS)
