"""Stage `tokenize`: documents -> token ids -> data/tokens/{split}.parquet.

Each row is one document: its ids as the tokenizer encodes it with its special tokens (dsflow's
BPE and DeepSeek's tokenizers put BOS first), then EOS, and its UTF-8 byte count (bits-per-byte
needs the bytes behind every token). A task is one piece of the raw split (`dsflow.data.raw`: a
row group of its Parquet file, or ranges of the referenced files); `tokenize.num_proc`
single-threaded worker processes encode tasks, and the stage writes their results in piece
order as they arrive, with at most two tasks per worker in flight. So memory is bounded by the
piece, not the corpus, and the output does not depend on the number of processes. With
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
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from dsflow.atomic import atomic_dir, write_json
from dsflow.data import raw
from dsflow.errors import UsageError
from dsflow.paths import TOKENIZER, TOKENS
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


def encode_piece(piece: tuple, batch_size: int) -> tuple:
    """(flat ids, token counts, byte counts) of one piece, encoded in bounded batches."""
    parts, counts, sizes = [], [], []
    for texts, n_bytes in raw.read_piece(piece, batch_size):
        # Cut where the running byte count crosses a multiple of ENCODE_BYTES.
        cuts = np.flatnonzero(np.diff(np.cumsum(n_bytes) // ENCODE_BYTES)) + 1
        for lo, hi in zip([0, *cuts], [*cuts, len(texts)], strict=True):
            flat, count = encode_texts(texts[lo:hi])
            parts.append(flat)
            counts.append(count)
        sizes.append(n_bytes)
    if not parts:
        return np.empty(0, np.uint32), np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(parts), np.concatenate(counts), np.concatenate(sizes)


def piece_results(pieces: list, cfg: dict, tokenizer_json: str, eos_id: int):
    """Each piece's encoding, in order, from `num_proc` processes."""
    args = [(piece, cfg["batch_size"]) for piece in pieces]
    if cfg["num_proc"] == 1:
        init_worker(tokenizer_json, eos_id)
        yield from (encode_piece(*a) for a in args)
        return
    # spawn: the parent holds Arrow's threads, which a fork would copy mid-lock.
    ctx = mp.get_context("spawn")
    with ctx.Pool(cfg["num_proc"], init_worker, (tokenizer_json, eos_id)) as pool:
        pending: deque = deque()
        for a in args:
            pending.append(pool.apply_async(encode_piece, a))
            if len(pending) >= 2 * cfg["num_proc"]:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def tokenize_split(meta: dict, split: str, pieces: list, dst: Path, eos_id: int, cfg: dict) -> dict:
    """The split's `pieces` (raw.pieces) encoded into `dst`; its totals for meta.json."""
    totals = {"docs": 0, "tokens": 0, "bytes": 0}
    tokenizer_json = str(TOKENIZER / "tokenizer.json")
    n_docs = meta["splits"][split]["docs"]
    with (
        pq.ParquetWriter(dst, SCHEMA, compression="zstd") as writer,
        bar(desc=f"tokenize {split}", total=n_docs, unit="doc") as progress,
    ):
        for flat, counts, sizes in piece_results(pieces, cfg, tokenizer_json, eos_id):
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
    meta = raw.manifest()
    pieces = {split: raw.pieces(meta, split) for split in SPLITS}  # what is missing, said first
    if not (TOKENIZER / "tokenizer.json").exists():
        raise UsageError(f"{TOKENIZER}/tokenizer.json: missing; run the tokenizer stage first")
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(TOKENIZER).eos_token_id
    with atomic_dir(TOKENS) as tmp:
        out = {"eos_id": eos_id, "splits": {}}
        for split in SPLITS:
            out["splits"][split] = tokenize_split(
                meta, split, pieces[split], tmp / f"{split}.parquet", eos_id, params["tokenize"]
            )
        write_json(tmp / "meta.json", out)
    log.info("tokenized -> %s", TOKENS)
