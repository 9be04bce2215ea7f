"""Stage `download`: documents from a source -> data/raw/{train,val}.parquet + manifest.json.

Each document goes to val when a hash of its text falls below `val_fraction`, so the split does not
depend on order or count, and duplicate texts never straddle train and val.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dsflow.atomic import atomic_dir, sha256_file, write_json
from dsflow.data import grammar, hub
from dsflow.data.textfiles import FileSource
from dsflow.errors import UsageError
from dsflow.paths import RAW, RAW_PARTIAL
from dsflow.progress import bar, log

SPLITS = ("train", "val")
# A row group ends at whichever comes first, so readers' batches stay bounded in memory.
ROW_GROUP_DOCS = 8192
ROW_GROUP_BYTES = 8 << 20


def val_split(text: str, val_fraction: float) -> bool:
    return val_split_bytes(text.encode("utf-8"), val_fraction)


def val_split_bytes(data: bytes, val_fraction: float) -> bool:
    digest = hashlib.sha256(data).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def builtin_documents(cfg: dict, seed: int) -> Iterator[dict]:
    n = cfg["max_docs"]
    if n is None:
        raise UsageError("download.max_docs: the builtin source needs a document count, not null")
    for i in range(n):
        text, logprob = grammar.generate(seed, i)
        yield {"text": text, "logprob": logprob}


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

    def add(self, split: str, n_bytes: int, doc: dict) -> None:
        st = self.stats[split]
        st["docs"] += 1
        st["bytes"] += n_bytes
        if "logprob" in doc:
            st["nats"] -= doc["logprob"]
        if n_bytes > self.largest[0]:
            self.largest = [n_bytes, doc.get("origin", "")]

    def full(self, cfg: dict) -> bool:
        return bool(
            (cfg["max_docs"] and self.docs >= cfg["max_docs"])
            or (cfg["max_bytes"] and self.bytes >= cfg["max_bytes"])
        )

    def to_json(self) -> dict:
        return {"stats": self.stats, "largest": self.largest}


class SplitWriter:
    """Streams documents into one Parquet file per split, in bounded row groups. Texts arrive as
    UTF-8 bytes and become one Arrow buffer per row group: no per-string conversion."""

    def __init__(self, out: Path, schema: pa.Schema, dictionary: bool = True):
        self.schema = schema
        self.paths = {s: out / f"{s}.parquet" for s in SPLITS}
        self.writers = {
            s: pq.ParquetWriter(p, schema, compression="zstd", use_dictionary=dictionary)
            for s, p in self.paths.items()
        }
        self.extra = [f for f in schema.names if f != "text"]
        self.columns = {s: {f: [] for f in schema.names} for s in SPLITS}
        self.buffered = {s: 0 for s in SPLITS}

    def add(self, split: str, doc: dict, data: bytes) -> None:
        columns = self.columns[split]
        columns["text"].append(data)
        for name in self.extra:
            columns[name].append(doc[name])
        self.buffered[split] += len(data)
        if len(columns["text"]) >= ROW_GROUP_DOCS or self.buffered[split] >= ROW_GROUP_BYTES:
            self._flush(split)

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
        self.writers[split].write_table(pa.table(arrays, schema=self.schema))
        self.columns[split] = {f: [] for f in self.schema.names}
        self.buffered[split] = 0

    def close(self) -> None:
        for split in SPLITS:
            self._flush(split)
            self.writers[split].close()


def write_stream(docs: Iterator[dict], cfg: dict, writer: SplitWriter, tally: Tally) -> None:
    """The builtin and files sources: each non-blank document to its split, up to the caps."""
    for doc in docs:
        text = doc["text"]
        if not text or not text.strip():
            continue
        data = text.encode("utf-8")
        split = "val" if val_split_bytes(data, cfg["val_fraction"]) else "train"
        writer.add(split, doc, data)
        tally.add(split, len(data), doc)
        if tally.full(cfg):
            break


def hf_download(cfg: dict) -> tuple[hub.Partial, Tally]:
    """Stream the Hub dataset into committed parts, resuming from the last commit."""
    key = {k: cfg[k] for k in ("hf", "val_fraction", "max_docs", "max_bytes")}
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
            for text in texts:
                if not text.strip():
                    continue
                data = text.encode("utf-8")
                split = "val" if val_split_bytes(data, cfg["val_fraction"]) else "train"
                partial.add(split, text, len(data))
                tally.add(split, len(data), {})
                if tally.full(cfg):
                    break
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


def build_manifest(params: dict, tally: Tally, writer: SplitWriter, files: list[str]) -> dict:
    cfg = params["download"]
    source = cfg["source"]
    manifest = {"source": source, "val_fraction": cfg["val_fraction"], "splits": {}}
    if source == "builtin":
        manifest.update(grammar_version=grammar.GRAMMAR_VERSION, seed=params["seed"])
    elif source == "hf":
        manifest["hf"] = cfg["hf"]
    else:
        manifest["files"] = files
        manifest["split_by"] = cfg["files"]["split_by"]
        manifest["chunk_bytes"] = cfg["files"]["chunk_bytes"]
    for split in SPLITS:
        st = tally.stats[split]
        entry = {
            "file": f"{split}.parquet",
            "docs": st["docs"],
            "bytes": st["bytes"],
            "sha256": sha256_file(writer.paths[split]),
        }
        if source == "builtin":
            # Exact: the grammar is unambiguous, so -logprob is each text's information.
            entry["entropy_bits_per_byte"] = st["nats"] / math.log(2) / st["bytes"]
        manifest["splits"][split] = entry
    if source == "builtin":
        nats = sum(tally.stats[s]["nats"] for s in SPLITS)
        manifest["entropy_bits_per_byte"] = nats / math.log(2) / tally.bytes
    return manifest


def run(params: dict) -> None:
    cfg = params["download"]
    source = cfg["source"]
    fields = [("text", pa.string())]
    files: list[str] = []
    if source == "builtin":
        fields.append(("logprob", pa.float64()))
    elif source == "files":
        file_source = FileSource(cfg["files"])
        files = file_source.paths
    partial = None
    with atomic_dir(RAW) as tmp:
        # Dictionary pages never pay for free text; the builtin corpus keeps them, and its bytes.
        writer = SplitWriter(tmp, pa.schema(fields), dictionary=source == "builtin")
        try:
            if source == "hf":
                partial, tally = hf_download(cfg)
                for split in SPLITS:
                    for texts in partial.texts(split):
                        for text in texts:
                            writer.add(split, {}, text.encode("utf-8"))
            else:
                tally = Tally()
                docs = (
                    bar(
                        builtin_documents(cfg, params["seed"]),
                        desc="download",
                        unit="doc",
                        total=cfg["max_docs"],
                    )
                    if source == "builtin"
                    else file_source.documents()
                )
                write_stream(docs, cfg, writer, tally)
        finally:
            writer.close()
        check_splits(cfg, tally)
        write_json(tmp / "manifest.json", build_manifest(params, tally, writer, files))
    if partial is not None:
        shutil.rmtree(partial.folder)
    log.info(
        "%d documents, %.1f MB -> %s (train %d, val %d)",
        tally.docs,
        tally.bytes / 1e6,
        RAW,
        tally.stats["train"]["docs"],
        tally.stats["val"]["docs"],
    )
