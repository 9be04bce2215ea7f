"""Stage `download`: documents from a source -> data/raw/{train,val}.parquet + manifest.json.

Or, for the files source with `download.files.store: reference`, data/raw/parts.json instead of
the Parquet files: where in the files the documents lie, with each range's hash, so the later
stages read the files themselves (`dsflow.data.raw`) and a 100 GB corpus is not copied.

Each document goes to val when a hash of its text falls below `val_fraction` (`raw.val_mask`), so
the split does not depend on order or count, and duplicate texts never straddle train and val.
Documents travel in batches of UTF-8 bytes from the source to the writer, so a document costs a
few list operations, not a trip through dicts.
"""

from __future__ import annotations

import bisect
import math
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, compress
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dsflow.atomic import atomic_dir, sha256_file, write_json
from dsflow.data import grammar, hub
from dsflow.data.raw import val_mask
from dsflow.data.textfiles import FileSource
from dsflow.errors import UsageError
from dsflow.paths import RAW, RAW_PARTIAL, RAW_PARTS
from dsflow.progress import bar, log

SPLITS = ("train", "val")
# A row group ends at whichever comes first, so readers' batches stay bounded in memory.
ROW_GROUP_DOCS = 8192
ROW_GROUP_BYTES = 8 << 20
BUILTIN_BATCH = 1024
# Names the split's hash in the hf source's resume key: parts split by another hash start over.
SPLIT_HASH = "xxh3_64"


def builtin_batches(cfg: dict, seed: int) -> Iterator[tuple[list[bytes], dict, list[str]]]:
    n = cfg["max_docs"]
    if n is None:
        raise UsageError("download.max_docs: the builtin source needs a document count, not null")
    with bar(desc="download", unit="doc", total=n) as progress:
        for lo in range(0, n, BUILTIN_BATCH):
            texts, logprobs = [], []
            for i in range(lo, min(n, lo + BUILTIN_BATCH)):
                text, logprob = grammar.generate(seed, i)
                if text.strip():
                    texts.append(text.encode("utf-8"))
                    logprobs.append(logprob)
            yield texts, {"logprob": logprobs}, [""] * len(texts)
            progress.update(min(n, lo + BUILTIN_BATCH) - lo)


class Tally:
    """Documents, bytes and (builtin) nats per split, and the largest document and its origin."""

    def __init__(self, saved: dict | None = None):
        saved = saved or {}
        self.stats = saved.get("stats") or {s: {"docs": 0, "bytes": 0, "nats": 0.0} for s in SPLITS}
        self.largest = saved.get("largest", [0, ""])

    @property
    def docs(self) -> int:
        return sum(st["docs"] for st in self.stats.values())

    @property
    def bytes(self) -> int:
        return sum(st["bytes"] for st in self.stats.values())

    def add(self, split: str, sizes: list[int], origins: list[str], logprobs=()) -> None:
        """Documents of these sizes, from these origins, added to `split`."""
        st = self.stats[split]
        st["docs"] += len(sizes)
        st["bytes"] += sum(sizes)
        for logprob in logprobs:  # one at a time: the same float sums as document by document
            st["nats"] -= logprob
        if sizes and max(sizes) > self.largest[0]:
            largest = max(sizes)
            self.largest = [largest, origins[sizes.index(largest)]]

    def admits(self, cfg: dict, sizes: list[int]) -> int:
        """How many of these documents the caps let in: up to the one that reaches a cap."""
        n = len(sizes)
        if cfg["max_docs"]:
            n = min(n, cfg["max_docs"] - self.docs)
        if cfg["max_bytes"]:
            reached = accumulate(sizes[:n], initial=self.bytes)
            n = min(n, bisect.bisect_left(list(reached), cfg["max_bytes"], 1))
        return n

    def full(self, cfg: dict) -> bool:
        return bool(
            (cfg["max_docs"] and self.docs >= cfg["max_docs"])
            or (cfg["max_bytes"] and self.bytes >= cfg["max_bytes"])
        )

    def to_json(self) -> dict:
        return {"stats": self.stats, "largest": self.largest}


class SplitWriter:
    """Streams documents into one Parquet file per split, in bounded row groups. Texts arrive as
    UTF-8 bytes and become one Arrow buffer per row group: no per-string conversion. A row group
    ends after the document that brings it to ROW_GROUP_DOCS documents or ROW_GROUP_BYTES,
    whatever the batches the documents came in. No column statistics: no reader uses them, and
    min/max over long strings is work on every page. Compressing a row group, most of the
    stage's CPU, runs in a thread (Arrow releases the GIL) while the next one is read; one row
    group at a time, in order, so the files are the same bytes."""

    def __init__(self, out: Path, schema: pa.Schema, dictionary: bool = True):
        self.schema = schema
        self.paths = {s: out / f"{s}.parquet" for s in SPLITS}
        self.writers = {
            s: pq.ParquetWriter(
                p, schema, compression="zstd", use_dictionary=dictionary, write_statistics=False
            )
            for s, p in self.paths.items()
        }
        self.extra = [f for f in schema.names if f != "text"]
        self.columns = {s: {f: [] for f in schema.names} for s in SPLITS}
        self.buffered = {s: 0 for s in SPLITS}
        self.pool = ThreadPoolExecutor(1)
        self.pending = None

    def add(self, split: str, docs: list[bytes], extra: dict | None = None) -> None:
        columns, start = self.columns[split], 0
        while start < len(docs):
            room = ROW_GROUP_DOCS - len(columns["text"])
            sizes = accumulate(map(len, docs[start : start + room]), initial=self.buffered[split])
            sizes = list(sizes)
            n = min(bisect.bisect_left(sizes, ROW_GROUP_BYTES, 1), len(sizes) - 1)
            # Copies: a file's documents may be views of the block they were cut from.
            columns["text"] += map(bytes, docs[start : start + n])
            for name in self.extra:
                columns[name] += extra[name][start : start + n]
            self.buffered[split] = sizes[n]
            start += n
            if len(columns["text"]) >= ROW_GROUP_DOCS or sizes[n] >= ROW_GROUP_BYTES:
                self._flush(split)
                columns = self.columns[split]

    def _flush(self, split: str) -> None:
        columns = self.columns[split]
        texts = columns["text"]
        if not texts:
            return
        offsets = np.zeros(len(texts) + 1, dtype=np.int32)
        np.cumsum([len(t) for t in texts], out=offsets[1:])
        text = pa.StringArray.from_buffers(
            len(texts), pa.py_buffer(offsets), pa.py_buffer(b"".join(texts))
        )
        arrays = [text] + [pa.array(columns[f], self.schema.field(f).type) for f in self.extra]
        self._wait()
        table = pa.table(arrays, schema=self.schema)
        self.pending = self.pool.submit(self.writers[split].write_table, table)
        self.columns[split] = {f: [] for f in self.schema.names}
        self.buffered[split] = 0

    def _wait(self) -> None:
        """Until the row group in flight is written; its error, if any, raised here."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        try:
            for split in SPLITS:
                self._flush(split)
            self._wait()
        finally:
            self.pool.shutdown()
            for w in self.writers.values():
                w.close()


def write_batches(batches, cfg: dict, writer: SplitWriter | None, tally: Tally, seen=None) -> None:
    """The builtin and files sources: (documents, extra columns, origins) batches of non-blank
    documents, each document to its split, up to the caps; counted only, with no writer.
    `seen`, if given, gets each batch's val flags of the documents admitted."""
    for docs, extra, origins in batches:
        sizes = list(map(len, docs))
        n = tally.admits(cfg, sizes)
        to_val = val_mask(docs[:n], cfg["val_fraction"])
        if seen is not None:
            seen(to_val)
        for split, mask in (("train", [not v for v in to_val]), ("val", to_val)):
            columns = {k: list(compress(v, mask)) for k, v in extra.items()}
            if writer is not None:
                writer.add(split, list(compress(docs, mask)), columns)
            tally.add(
                split,
                list(compress(sizes, mask)),
                list(compress(origins, mask)),
                columns.get("logprob", ()),
            )
        if tally.full(cfg):
            break


def hf_download(cfg: dict) -> tuple[hub.Partial, Tally]:
    """Stream the Hub dataset into committed parts, resuming from the last commit."""
    key = {k: cfg[k] for k in ("hf", "val_fraction", "max_docs", "max_bytes")}
    key["split_hash"] = SPLIT_HASH
    partial = hub.Partial(RAW_PARTIAL, key)
    tally = Tally(partial.state.get("tally"))
    if partial.state.get("done"):
        return partial, tally
    ds = hub.open_stream(cfg["hf"])
    if partial.state["stream"] is not None:
        ds.load_state_dict(partial.state["stream"])
        log.info("resuming after %d documents (%.1f MB)", tally.docs, tally.bytes / 1e6)
    with bar(desc="download", total=cfg["max_docs"], initial=tally.docs, unit="doc") as progress:
        for texts in hub.text_batches(ds, cfg["hf"], tally.docs):
            texts = [t for t in texts if t.strip()]
            docs = [t.encode("utf-8") for t in texts]
            n = tally.admits(cfg, list(map(len, docs)))
            texts, docs = texts[:n], docs[:n]
            for text, data, to_val in zip(
                texts, docs, val_mask(docs, cfg["val_fraction"]), strict=True
            ):
                split = "val" if to_val else "train"
                partial.add(split, text, len(data))
                tally.add(split, [len(data)], [""])
            progress.n = tally.docs
            progress.refresh()
            if tally.full(cfg):
                break
            if partial.due():
                partial.commit(ds.state_dict(), tally.to_json())
    partial.commit(None, tally.to_json(), done=True)
    return partial, tally


def cut_finer(files: dict, origin: str) -> str:
    """What makes documents smaller under the files source's current split_by."""
    split_by = files["split_by"]
    if split_by == "auto" and origin.lower().endswith(".txt"):
        split_by = "chunk"
    if split_by == "chunk":
        return f"lower download.files.chunk_bytes (now {files['chunk_bytes']})"
    if split_by == "line":
        return "add documents or raise download.val_fraction"
    return "set download.files.split_by: chunk (or line)"


def check_splits(cfg: dict, tally: Tally) -> None:
    """A split the training cannot use is an error that says which key to change."""
    source = cfg["source"]
    if tally.docs == 0:
        raise UsageError(f"download: the {source} source gave no non-empty document")
    size, origin = tally.largest
    too_long = None
    if source == "files" and size > cfg["val_fraction"] * tally.bytes:
        too_long = (
            f"{origin} holds a document of {size} bytes, {100 * size / tally.bytes:.0f}% of the "
            f"corpus, more than download.val_fraction ({cfg['val_fraction']}): "
            f"{cut_finer(cfg['files'], origin)}"
        )
    for split in SPLITS:
        if tally.stats[split]["docs"] == 0:
            hint = too_long or "add documents or raise download.val_fraction"
            raise UsageError(
                f"download: {tally.docs} document(s) leave the {split} split empty; {hint}"
            )
    if too_long:
        raise UsageError(f"download: the val split cannot be a fair sample: {too_long}")


class PartSplits:
    """The documents admitted from each of the files source's parts, and how many of them went
    to val, from the val flags of the documents in order: the readers of a split skip the
    parts that hold none of its documents, and count rows without reading."""

    def __init__(self, source: FileSource):
        self.parts = source.parts
        self.docs: list[int] = []
        self.val: list[int] = []

    def add(self, to_val: list[bool]) -> None:
        i = 0
        while i < len(to_val):
            if not self.docs or self.docs[-1] == self.parts[len(self.docs) - 1][3]:
                self.docs.append(0)
                self.val.append(0)
            take = min(self.parts[len(self.docs) - 1][3] - self.docs[-1], len(to_val) - i)
            self.docs[-1] += take
            self.val[-1] += sum(to_val[i : i + take])
            i += take

    def table(self) -> list[list]:
        """[file number, start, end, hash, documents, val documents, bytes] of every part
        admitted from: the last one's count may stop short of what its range holds (a cap)."""
        admitted = zip(self.parts[: len(self.docs)], self.docs, self.val, strict=True)
        return [
            [number, start, end, f"{digest:016x}", docs, val, size]
            for (number, start, end, _, digest, size), docs, val in admitted
        ]


def build_manifest(params: dict, tally: Tally, outputs: dict, files: list[str]) -> dict:
    """What data/raw holds; `outputs` maps a split to its Parquet file, or is empty when the
    files are referenced."""
    cfg = params["download"]
    source = cfg["source"]
    manifest = {"source": source, "val_fraction": cfg["val_fraction"], "splits": {}}
    if source == "builtin":
        manifest.update(grammar_version=grammar.GRAMMAR_VERSION, seed=params["seed"])
    elif source == "hf":
        manifest["hf"] = cfg["hf"]
    else:
        manifest["files"] = files
        for key in ("split_by", "chunk_bytes", "text_field", "store"):
            manifest[key] = cfg["files"][key]
    for split in SPLITS:
        st = tally.stats[split]
        entry = {"docs": st["docs"], "bytes": st["bytes"]}
        if split in outputs:
            entry.update(file=outputs[split].name, sha256=sha256_file(outputs[split]))
        if source == "builtin":
            # Exact: the grammar is unambiguous, so -logprob is each text's information.
            entry["entropy_bits_per_byte"] = st["nats"] / math.log(2) / st["bytes"]
        manifest["splits"][split] = entry
    if source == "builtin":
        nats = sum(tally.stats[s]["nats"] for s in SPLITS)
        manifest["entropy_bits_per_byte"] = nats / math.log(2) / tally.bytes
    return manifest


def write_copy(params: dict, file_source: FileSource | None, tmp: Path):
    """Documents into tmp/{train,val}.parquet: (tally, the Parquet files, the hf partial)."""
    cfg = params["download"]
    source = cfg["source"]
    fields = [("text", pa.string())] + ([("logprob", pa.float64())] if source == "builtin" else [])
    # Dictionary pages never pay for free text; the builtin corpus keeps them, and its bytes.
    writer = SplitWriter(tmp, pa.schema(fields), dictionary=source == "builtin")
    partial = None
    try:
        if source == "hf":
            partial, tally = hf_download(cfg)
            for split in SPLITS:
                for texts in partial.texts(split):
                    writer.add(split, [t.encode("utf-8") for t in texts])
        else:
            tally = Tally()
            batches = (
                builtin_batches(cfg, params["seed"])
                if source == "builtin"
                else ((docs, {}, origins) for docs, origins in file_source.batches())
            )
            write_batches(batches, cfg, writer, tally)
    finally:
        writer.close()
    return tally, writer.paths, partial


def write_reference(cfg: dict, file_source: FileSource, tmp: Path) -> Tally:
    """The files' documents read, checked and counted; where they lie -> tmp/parts.json."""
    tally = Tally()
    splits = PartSplits(file_source)
    batches = ((docs, {}, origins) for docs, origins in file_source.batches())
    write_batches(batches, cfg, None, tally, splits.add)
    write_json(tmp / RAW_PARTS.name, {"parts": splits.table()})
    return tally


def run(params: dict) -> None:
    cfg = params["download"]
    file_source = FileSource(cfg["files"]) if cfg["source"] == "files" else None
    reference = file_source is not None and cfg["files"]["store"] == "reference"
    with atomic_dir(RAW) as tmp:
        if reference:
            tally, outputs, partial = write_reference(cfg, file_source, tmp), {}, None
        else:
            tally, outputs, partial = write_copy(params, file_source, tmp)
        check_splits(cfg, tally)
        files = file_source.paths if file_source else []
        write_json(tmp / "manifest.json", build_manifest(params, tally, outputs, files))
    if partial is not None:
        shutil.rmtree(partial.folder)
    log.info(
        "%d documents, %.1f MB -> %s (train %d, val %d)%s",
        tally.docs,
        tally.bytes / 1e6,
        RAW,
        tally.stats["train"]["docs"],
        tally.stats["val"]["docs"],
        ", as references to the files" if reference else "",
    )
