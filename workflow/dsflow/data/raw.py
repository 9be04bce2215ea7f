"""Reading data/raw: a split's documents, whichever way the download stage stored them.

The download stage either wrote the documents ({train,val}.parquet) or, for files it may
reference (`download.files.store: reference`), parts.json: ranges of the files, each with the
hash of what it held, how many documents it gave and how many of them went to val. Reading a
range cuts it again as the manifest's `split_by` says and keeps the split's documents by the
same hash the download used, so both stores give a split the same documents in the same order.
Work is handed out in pieces (a Parquet row group, or consecutive ranges of about PIECE_BYTES)
that worker processes read on their own; a split's reader skips the ranges that hold none of
its documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import compress
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from xxhash import xxh3_64_intdigest

from dsflow.data.textfiles import read_part
from dsflow.errors import UsageError
from dsflow.paths import MANIFEST, RAW, RAW_PARTS

PIECE_BYTES = 8 << 20
Batches = Iterator[tuple[list[str], np.ndarray]]


def val_split(text: str, val_fraction: float) -> bool:
    return val_mask([text.encode("utf-8")], val_fraction)[0]


def val_mask(docs: list[bytes], val_fraction: float) -> list[bool]:
    """Which documents go to val: those whose 64-bit hash falls below val_fraction * 2**64. The
    hash is xxh3-64: the split needs a well-mixed function of the text, not a cryptographic one,
    and sha256 cost the download as much CPU as everything but the compression."""
    limit = val_fraction * 2**64
    return [xxh3_64_intdigest(d) < limit for d in docs]


def manifest() -> dict:
    if not MANIFEST.exists():
        raise UsageError(f"{MANIFEST}: missing; run the download stage first")
    return json.loads(MANIFEST.read_text())


def referenced(meta: dict) -> bool:
    return meta.get("store") == "reference"


def pieces(meta: dict, split: str) -> list[tuple]:
    """The split's pieces of work, in order: what `read_piece` takes. The last item of each is
    its number of the split's documents. Parts that hold none of them are left out."""
    if not referenced(meta):
        path = RAW / f"{split}.parquet"
        if not path.exists():
            raise UsageError(f"{path}: missing; run the download stage first")
        meta_pq = pq.ParquetFile(path).metadata
        return [
            ("parquet", str(path), g, meta_pq.row_group(g).num_rows)
            for g in range(meta_pq.num_row_groups)
        ]
    if not RAW_PARTS.exists():
        raise UsageError(f"{RAW_PARTS}: missing; run the download stage first")
    cut = {k: meta[k] for k in ("split_by", "chunk_bytes", "text_field", "val_fraction")}
    out, group, size = [], [], 0
    for number, start, end, digest, docs, val, nbytes in json.loads(RAW_PARTS.read_text())["parts"]:
        mine = val if split == "val" else docs - val
        if mine == 0:
            continue
        group.append((meta["files"][number], start, end, int(digest, 16), docs, mine))
        size += nbytes
        if size >= PIECE_BYTES:
            out.append(("parts", split, cut, group, sum(g[-1] for g in group)))
            group, size = [], 0
    if group:
        out.append(("parts", split, cut, group, sum(g[-1] for g in group)))
    return out


def values(array: pa.Array, dtype) -> np.ndarray:
    """The values of a null-free primitive Arrow array as numpy, over the same memory.
    Array.to_numpy imports pandas: a quarter of a CPU second in every process, for nothing."""
    return np.frombuffer(array.buffers()[1] or b"", dtype=dtype)[
        array.offset : array.offset + len(array)
    ]


def part_docs(part: tuple, split: str, cut: dict) -> list:
    """The split's documents of one referenced part, as the download admitted them."""
    path, start, end, digest, count, mine = part
    docs = read_part(path, Path(path).suffix.lower(), start, end, digest, cut)[:count]
    to_val = val_mask(docs, cut["val_fraction"])
    docs = list(compress(docs, to_val if split == "val" else [not v for v in to_val]))
    if len(docs) != mine:  # the hash matched, so only a different split_by could do this
        raise UsageError(f"{RAW_PARTS}: does not match {path}; rerun the download stage")
    return docs


def read_piece(piece: tuple, batch_size: int, keep: np.ndarray | None = None) -> Batches:
    """(texts, their UTF-8 byte counts) of a piece, at most batch_size documents at a time;
    with `keep`, a mask over the piece's documents, only those it keeps (a referenced part
    with none is not read)."""
    if piece[0] == "parquet":
        _, path, group, _ = piece
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(
            batch_size=batch_size, row_groups=[group], columns=["text"]
        ):
            texts, row = batch.column(0), row + batch.num_rows
            if keep is not None:
                texts = texts.filter(pa.array(keep[row - batch.num_rows : row]))
            yield texts.to_pylist(), values(pc.binary_length(texts).cast(pa.int64()), np.int64)
        return
    _, split, cut, parts, _ = piece
    row = 0
    for part in parts:
        mask, row = None if keep is None else keep[row : row + part[-1]], row + part[-1]
        if mask is not None and not mask.any():
            continue
        docs = part_docs(part, split, cut)
        docs = docs if mask is None else list(compress(docs, mask))
        for lo in range(0, len(docs), batch_size):
            batch = docs[lo : lo + batch_size]
            sizes = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
            yield [str(d, "utf-8") for d in batch], sizes


def batches(split: str, batch_size: int = 1024, rows=None) -> Batches:
    """The split's documents in order: (texts, their UTF-8 byte counts), batch_size at most.
    `rows`, given an array of the split's row numbers (uint64), says which to keep: pieces and
    referenced parts with none kept are skipped unread."""
    meta = manifest()
    first = 0
    for piece in pieces(meta, split):
        keep = None
        if rows is not None:
            keep = rows(np.arange(first, first + piece[-1], dtype=np.uint64))
        first += piece[-1]
        if keep is None or keep.any():
            yield from read_piece(piece, batch_size, keep)
