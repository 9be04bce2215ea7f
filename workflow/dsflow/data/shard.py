"""Stage `shard`: the token stream -> fixed-size flat binary shards + index.json per split.

Format (data/shards/{train,val}/): `shard_00000.bin`, ... hold the concatenated token ids of the
split's documents (each followed by EOS) as little-endian uint16 when the vocabulary has fewer than
65536 tokens, else uint32; every shard but the last holds exactly `shard.shard_tokens` tokens.
`index.json` lists per shard its file, token count and sha256, plus dtype, vocab size, special ids,
and the split's documents and UTF-8 bytes. `dsflow.data.ShardReader` reads them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dsflow.atomic import atomic_dir, sha256_file, write_json
from dsflow.errors import UsageError
from dsflow.paths import SHARDS, TOKENIZER, TOKENS
from dsflow.progress import bar, log

SPLITS = ("train", "val")
FORMAT_VERSION = 1
# Rows read at a time: memory follows the longest documents, not the corpus.
READ_ROWS = 1024


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size < 2**16 else np.dtype("<u4")


class ShardWriter:
    """Cuts a stream of token arrays into files of exactly `shard_tokens` tokens."""

    def __init__(self, out: Path, shard_tokens: int, dtype: np.dtype):
        self.out, self.shard_tokens, self.dtype = out, shard_tokens, dtype
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.filled = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self.filled)
            self.buffer[self.filled : self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        if not self.filled:
            return
        path = self.out / f"shard_{len(self.shards):05d}.bin"
        self.buffer[: self.filled].tofile(path)
        self.shards.append({"file": path.name, "tokens": self.filled, "sha256": sha256_file(path)})
        self.filled = 0

    def close(self) -> list[dict]:
        self._flush()
        return self.shards


def shard_split(src: Path, dst: Path, shard_tokens: int, vocab_size: int) -> dict:
    dtype = token_dtype(vocab_size)
    dst.mkdir()
    writer = ShardWriter(dst, shard_tokens, dtype)
    parquet = pq.ParquetFile(src)
    docs = n_bytes = 0
    max_id = -1
    with bar(desc=f"shard {src.stem}", total=parquet.metadata.num_rows, unit="doc") as progress:
        for batch in parquet.iter_batches(batch_size=READ_ROWS, columns=["input_ids", "n_bytes"]):
            # Straight from the Arrow buffer: Array.to_numpy would import pandas.
            flat = batch.column(0).flatten()
            ids = np.frombuffer(flat.buffers()[1] or b"", np.uint32)[flat.offset :][: len(flat)]
            if len(ids):
                max_id = max(max_id, int(ids.max()))
            writer.add(ids.astype(dtype, copy=False))
            docs += batch.num_rows
            n_bytes += pc.sum(batch.column(1)).as_py() or 0
            progress.update(batch.num_rows)
    if max_id >= vocab_size:
        raise UsageError(
            f"{src}: token id {max_id} >= vocab size {vocab_size}; rerun the tokenize stage"
        )
    shards = writer.close()
    index = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "docs": docs,
        "bytes": n_bytes,
        "tokens": sum(s["tokens"] for s in shards),
        "shard_tokens": shard_tokens,
        "shards": shards,
    }
    return index


def run(params: dict) -> None:
    from transformers import AutoTokenizer

    for split in SPLITS:
        if not (TOKENS / f"{split}.parquet").exists():
            raise UsageError(f"{TOKENS / split}.parquet: missing; run the tokenize stage first")
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    vocab_size = len(tok)
    specials = {"eos_id": tok.eos_token_id, "bos_id": tok.bos_token_id, "pad_id": tok.pad_token_id}
    with atomic_dir(SHARDS) as tmp:
        for split in SPLITS:
            index = shard_split(
                TOKENS / f"{split}.parquet",
                tmp / split,
                params["shard"]["shard_tokens"],
                vocab_size,
            )
            index.update(specials)
            write_json(tmp / split / "index.json", index)
            log.info(
                "%s: %d tokens in %d shard(s), %.3f bytes/token",
                split,
                index["tokens"],
                len(index["shards"]),
                index["bytes"] / max(index["tokens"], 1),
            )
