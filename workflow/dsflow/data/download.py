"""Stage `download`: documents from a source -> data/raw/{train,val}.parquet + manifest.json.

Each document goes to val when a hash of its text falls below `val_fraction`, so the split does not
depend on order or count, and duplicate texts never straddle train and val.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dsflow.atomic import atomic_dir, sha256_file, write_json
from dsflow.data import grammar
from dsflow.errors import UsageError
from dsflow.paths import RAW
from dsflow.progress import bar, log

SPLITS = ("train", "val")
ROW_GROUP_DOCS = 8192


def val_split(text: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def builtin_documents(cfg: dict, seed: int) -> Iterator[dict]:
    n = cfg["max_docs"]
    if n is None:
        raise UsageError("download.max_docs: the builtin source needs a document count, not null")
    for i in range(n):
        text, logprob = grammar.generate(seed, i)
        yield {"text": text, "logprob": logprob}


def hf_documents(cfg: dict) -> Iterator[dict]:
    import datasets

    hf = cfg["hf"]
    try:
        ds = datasets.load_dataset(
            hf["path"], hf["name"], split=hf["split"], revision=hf["revision"], streaming=True
        )
        rows = iter(ds)
        first = next(rows, None)
    except Exception as e:  # the Hub client raises many types; all mean "cannot load"
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"download.hf.path: cannot load dataset {hf['path']!r} "
            f"(name={hf['name']}, split={hf['split']}): {reason}. Check the name and your network, "
            "or use download.source: files with a local copy"
        ) from None
    if first is None:
        return
    field = hf["text_field"]
    if field not in first:
        raise UsageError(
            f"download.hf.text_field: dataset {hf['path']!r} has no field {field!r} "
            f"(fields: {', '.join(sorted(first))})"
        )
    yield {"text": first[field]}
    for row in rows:
        yield {"text": row[field]}


def _check_utf8(path: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"{path}: not valid UTF-8 at byte {offset + e.start}; "
                    "re-encode the file as UTF-8 (e.g. iconv -t UTF-8)"
                ) from None
            offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise UsageError(
                f"{path}: ends inside a UTF-8 character; the file is truncated"
            ) from None


def _check_parquet(path: str) -> None:
    try:
        pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{path}: cannot read as .parquet ({str(e).strip()[:200]})") from None


def expand_paths(patterns: list[str]) -> list[str]:
    if not patterns:
        raise UsageError("download.files.paths: empty; list .txt/.jsonl/.parquet files or globs")
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise UsageError(f"download.files.paths: {pattern!r} matches no file")
        files.extend(m for m in matched if os.path.isfile(m))
    return files


BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def file_documents(cfg: dict) -> Iterator[dict]:
    import datasets

    field = cfg["files"]["text_field"]
    for path in expand_paths(cfg["files"]["paths"]):
        ext = Path(path).suffix.lower()
        if ext not in BUILDERS:
            raise UsageError(
                f"{path}: unsupported file type {ext!r} (use .txt, .jsonl or .parquet)"
            )
        if not os.access(path, os.R_OK):
            raise UsageError(f"{path}: cannot read the file (check its permissions)")
        if ext == ".parquet":
            _check_parquet(path)
        else:
            _check_utf8(path)
        # One .txt file is one document: stories and articles keep their paragraph breaks.
        extra = {"sample_by": "document"} if ext == ".txt" else {}
        try:
            ds = datasets.load_dataset(
                BUILDERS[ext], data_files=[path], split="train", streaming=True, **extra
            )
            key = "text" if ext == ".txt" else field
            for row in ds:
                if key not in row:
                    raise UsageError(
                        f"{path}: a record has no field {field!r} (fields: {', '.join(sorted(row))}); "
                        "set download.files.text_field"
                    )
                text = row[key]
                if not isinstance(text, str):
                    raise UsageError(
                        f"{path}: field {field!r} holds {type(text).__name__}, not text"
                    )
                yield {"text": text}
        except UsageError:
            raise
        except Exception as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UsageError(f"{path}: cannot read as {ext} ({reason})") from None


class SplitWriter:
    """Streams documents into one Parquet file per split, in fixed-size row groups."""

    def __init__(self, out: Path, schema: pa.Schema):
        self.schema = schema
        self.paths = {s: out / f"{s}.parquet" for s in SPLITS}
        self.writers = {
            s: pq.ParquetWriter(p, schema, compression="zstd") for s, p in self.paths.items()
        }
        self.buffers: dict[str, list[dict]] = {s: [] for s in SPLITS}
        self.stats = {s: {"docs": 0, "bytes": 0, "nats": 0.0} for s in SPLITS}

    def add(self, split: str, doc: dict, n_bytes: int) -> None:
        self.buffers[split].append(doc)
        st = self.stats[split]
        st["docs"] += 1
        st["bytes"] += n_bytes
        if "logprob" in doc:
            st["nats"] -= doc["logprob"]
        if len(self.buffers[split]) >= ROW_GROUP_DOCS:
            self._flush(split)

    def _flush(self, split: str) -> None:
        if self.buffers[split]:
            table = pa.Table.from_pylist(self.buffers[split], schema=self.schema)
            self.writers[split].write_table(table)
            self.buffers[split] = []

    def close(self) -> None:
        for split in SPLITS:
            self._flush(split)
            self.writers[split].close()


def run(params: dict) -> None:
    cfg = params["download"]
    source = cfg["source"]
    if source == "builtin":
        docs = builtin_documents(cfg, params["seed"])
        fields = [("text", pa.string()), ("logprob", pa.float64())]
        total = cfg["max_docs"]
    elif source == "hf":
        docs, fields, total = hf_documents(cfg), [("text", pa.string())], cfg["max_docs"]
    else:
        docs, fields, total = file_documents(cfg), [("text", pa.string())], None
    max_docs = cfg["max_docs"]
    max_bytes = cfg["max_bytes"]

    with atomic_dir(RAW) as tmp:
        writer = SplitWriter(tmp, pa.schema(fields))
        n_docs = n_bytes = 0
        try:
            for doc in bar(docs, desc="download", total=total, unit="doc"):
                text = doc["text"]
                if not text or not text.strip():
                    continue
                size = len(text.encode("utf-8"))
                split = "val" if val_split(text, cfg["val_fraction"]) else "train"
                writer.add(split, doc, size)
                n_docs += 1
                n_bytes += size
                if (max_docs and n_docs >= max_docs) or (max_bytes and n_bytes >= max_bytes):
                    break
        finally:
            writer.close()
        stats = writer.stats
        if n_docs == 0:
            raise UsageError(f"download: the {source} source gave no non-empty document")
        for split in SPLITS:
            if stats[split]["docs"] == 0:
                raise UsageError(
                    f"download: {n_docs} document(s) leave the {split} split empty; "
                    "add documents or change download.val_fraction"
                )
        manifest = {"source": source, "val_fraction": cfg["val_fraction"], "splits": {}}
        if source == "builtin":
            manifest.update(grammar_version=grammar.GRAMMAR_VERSION, seed=params["seed"])
        elif source == "hf":
            manifest["hf"] = cfg["hf"]
        else:
            manifest["files"] = expand_paths(cfg["files"]["paths"])
        for split in SPLITS:
            st = stats[split]
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
            nats = sum(stats[s]["nats"] for s in SPLITS)
            manifest["entropy_bits_per_byte"] = nats / math.log(2) / n_bytes
        write_json(tmp / "manifest.json", manifest)
    log.info(
        "%d documents, %.1f MB -> %s (train %d, val %d)",
        n_docs,
        n_bytes / 1e6,
        RAW,
        stats["train"]["docs"],
        stats["val"]["docs"],
    )
