"""Stage `tokenize`: documents -> token ids -> data/tokens/{split}.parquet.

Each row is one document: its ids as the tokenizer encodes it with its special tokens (dsflow's
BPE and DeepSeek's tokenizers put BOS first), then EOS, and its UTF-8 byte count (bits-per-byte
needs the bytes behind every token). A task is one row group of the raw split; `tokenize.num_proc`
single-threaded worker processes encode tasks, and the stage writes their results in row-group
order as they arrive, with at most two tasks per worker in flight. So memory is bounded by the
row group, not the corpus, and the output does not depend on the number of processes. With
num_proc 1 the stage encodes in its own process.

The file is `tokenizing.py`, not `tokenize.py`, so it never shadows the standard library's module.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from dsflow.atomic import atomic_dir, write_json
from dsflow.errors import UsageError
from dsflow.paths import RAW, TOKENIZER, TOKENS
from dsflow.progress import bar, log

SPLITS = ("train", "val")
# One encode_batch call gets at most this much text: its Encoding objects cost far more memory
# per token than the ids they hold.
ENCODE_BYTES = 4 << 20
SCHEMA = pa.schema([("input_ids", pa.list_(pa.uint32())), ("n_bytes", pa.int64())])

_worker: dict = {}


def init_worker(tokenizer_json: str, eos_id: int) -> None:
    """Load the tokenizer once per process; single-threaded, as num_proc promises."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=Tokenizer.from_file(tokenizer_json), eos_id=eos_id)


def encode_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Flat uint32 ids (each document as the tokenizer encodes it, then EOS unless its
    template already ends it with one) and each document's token count."""
    tok, eos = _worker["tokenizer"], _worker["eos_id"]
    ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=True)]
    for x in ids:
        if not x or x[-1] != eos:
            x.append(eos)
    counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.uint32, count=int(counts.sum()))
    return flat, counts


def arrow(data: np.ndarray, kind: pa.DataType) -> pa.Array:
    """A numpy array as an Arrow array over the same memory. pa.array(numpy) and
    Array.to_numpy import pandas: a quarter of a CPU second in every process, for nothing."""
    return pa.Array.from_buffers(kind, len(data), [None, pa.py_buffer(data)])


def values(array: pa.Array, dtype) -> np.ndarray:
    """The values of a null-free primitive Arrow array as numpy, over the same memory."""
    return np.frombuffer(array.buffers()[1] or b"", dtype=dtype)[
        array.offset : array.offset + len(array)
    ]


def encode_row_group(src: str, group: int, batch_size: int) -> tuple:
    """(flat ids, token counts, byte counts) of one row group, encoded in bounded batches."""
    parquet = pq.ParquetFile(src)
    parts, counts, sizes = [], [], []
    for batch in parquet.iter_batches(batch_size=batch_size, row_groups=[group], columns=["text"]):
        texts = batch.column(0)
        n_bytes = values(pc.binary_length(texts).cast(pa.int64()), np.int64)
        # Cut where the running byte count crosses a multiple of ENCODE_BYTES.
        cuts = np.flatnonzero(np.diff(np.cumsum(n_bytes) // ENCODE_BYTES)) + 1
        for lo, hi in zip([0, *cuts], [*cuts, len(texts)], strict=True):
            flat, count = encode_texts(texts.slice(lo, hi - lo).to_pylist())
            parts.append(flat)
            counts.append(count)
        sizes.append(n_bytes)
    if not parts:
        return np.empty(0, np.uint32), np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(parts), np.concatenate(counts), np.concatenate(sizes)


def row_group_results(src: Path, cfg: dict, tokenizer_json: str, eos_id: int):
    """Each row group's encoding, in order, from `num_proc` processes."""
    groups = range(pq.ParquetFile(src).num_row_groups)
    args = [(str(src), g, cfg["batch_size"]) for g in groups]
    if cfg["num_proc"] == 1:
        init_worker(tokenizer_json, eos_id)
        yield from (encode_row_group(*a) for a in args)
        return
    # spawn: the parent holds Arrow's threads, which a fork would copy mid-lock.
    ctx = mp.get_context("spawn")
    with ctx.Pool(cfg["num_proc"], init_worker, (tokenizer_json, eos_id)) as pool:
        pending: deque = deque()
        for a in args:
            pending.append(pool.apply_async(encode_row_group, a))
            if len(pending) >= 2 * cfg["num_proc"]:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def tokenize_split(src: Path, dst: Path, eos_id: int, cfg: dict, tokenizer_dir: Path) -> dict:
    totals = {"docs": 0, "tokens": 0, "bytes": 0}
    tokenizer_json = str(tokenizer_dir / "tokenizer.json")
    n_docs = pq.ParquetFile(src).metadata.num_rows
    with (
        pq.ParquetWriter(dst, SCHEMA, compression="zstd") as writer,
        bar(desc=f"tokenize {src.stem}", total=n_docs, unit="doc") as progress,
    ):
        for flat, counts, sizes in row_group_results(src, cfg, tokenizer_json, eos_id):
            offsets = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            ids = pa.LargeListArray.from_arrays(
                arrow(offsets, pa.int64()), arrow(flat, pa.uint32())
            )
            ids = ids.cast(SCHEMA.field("input_ids").type)
            writer.write_table(pa.table([ids, arrow(sizes, pa.int64())], schema=SCHEMA))
            totals["docs"] += len(counts)
            totals["tokens"] += int(counts.sum())
            totals["bytes"] += int(sizes.sum())
            progress.update(len(counts))
    return totals


def run(params: dict) -> None:
    for split in SPLITS:
        if not (RAW / f"{split}.parquet").exists():
            raise UsageError(f"{RAW / split}.parquet: missing; run the download stage first")
    if not (TOKENIZER / "tokenizer.json").exists():
        raise UsageError(f"{TOKENIZER}/tokenizer.json: missing; run the tokenizer stage first")
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(TOKENIZER).eos_token_id
    with atomic_dir(TOKENS) as tmp:
        meta = {"eos_id": eos_id, "splits": {}}
        for split in SPLITS:
            meta["splits"][split] = tokenize_split(
                RAW / f"{split}.parquet",
                tmp / f"{split}.parquet",
                eos_id,
                params["tokenize"],
                TOKENIZER,
            )
        write_json(tmp / "meta.json", meta)
    log.info("tokenized -> %s", TOKENS)
