"""The `hf` source: a Hub dataset (or a local dataset folder), streamed and resumable.

`datasets.load_dataset(..., streaming=True)` reads the dataset's files (for a large corpus, many
parquet files) one after another without downloading them first. Every `PART_DOCS` documents the
download commits what it has to `data/raw.partial/`: the documents as one parquet file per split,
then `state.json` with the stream's position (`IterableDataset.state_dict()`) and the counts. A
download that is killed or loses its network restarts from the last commit, with the same params,
instead of from the first file. The finished split files are built from the parts, so they are the
same bytes whether or not the download was interrupted.

Test hook: DSFLOW_FAULT_DOWNLOAD_PARTS=<n> SIGKILLs the process once n parts are committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dsflow.atomic import write_json
from dsflow.errors import UsageError
from dsflow.progress import log

PART_DOCS = 8192
PART_BYTES = 32 << 20
BATCH_ROWS = 1000
STATE_VERSION = 1


def first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def open_stream(hf: dict):
    import datasets

    try:
        return datasets.load_dataset(
            hf["path"], hf["name"], split=hf["split"], revision=hf["revision"], streaming=True
        )
    except Exception as e:  # the Hub client raises many types; all mean "cannot load"
        raise UsageError(
            f"download.hf.path: cannot load dataset {hf['path']!r} "
            f"(name={hf['name']}, split={hf['split']}): {first_line(e)}. Check the name and your "
            "network, or use download.source: files with a local copy"
        ) from None


def text_batches(ds, hf: dict, after_docs: int) -> Iterator[list[str]]:
    """Lists of texts from the stream, `BATCH_ROWS` rows at a time; a batch is whole before the
    stream's position is read, so a commit never splits one."""
    field = hf["text_field"]
    rows = ds.iter(batch_size=BATCH_ROWS)
    try:
        for batch in rows:
            if field not in batch:
                raise UsageError(
                    f"download.hf.text_field: dataset {hf['path']!r} has no field {field!r} "
                    f"(fields: {', '.join(sorted(batch))})"
                )
            yield [t for t in batch[field] if t is not None]
    except (UsageError, GeneratorExit):
        raise
    except Exception as e:
        raise UsageError(
            f"download.hf.path: reading {hf['path']!r} failed after {after_docs} committed "
            f"documents ({first_line(e)}); run the download again to resume"
        ) from None
    finally:
        rows.close() if hasattr(rows, "close") else None


class Partial:
    """The committed prefix of an hf download: part files and state.json in `folder`."""

    def __init__(self, folder: Path, key: dict):
        self.folder = folder
        self.key = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        self.state = self._load()
        self.pending: dict[str, list[str]] = {"train": [], "val": []}
        self.pending_bytes = 0

    def _load(self) -> dict:
        state_file = self.folder / "state.json"
        if state_file.exists():
            try:
                state = json.loads(state_file.read_text())
            except json.JSONDecodeError:
                state = {}
            if state.get("key") == self.key and state.get("version") == STATE_VERSION:
                return state
            log.info("%s: from other params; starting over", self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        return {"version": STATE_VERSION, "key": self.key, "parts": [], "stream": None}

    def add(self, split: str, text: str, n_bytes: int) -> None:
        self.pending[split].append(text)
        self.pending_bytes += n_bytes

    def due(self) -> bool:
        docs = sum(len(v) for v in self.pending.values())
        return docs >= PART_DOCS or self.pending_bytes >= PART_BYTES

    def commit(self, stream_state, tally: dict, done: bool = False) -> None:
        """Parts first, then the state naming them: a kill in between leaves an orphan part
        that the next commit overwrites."""
        number = len(self.state["parts"])
        part = {}
        for split, texts in self.pending.items():
            if texts:
                name = f"part-{number:05d}-{split}.parquet"
                table = pa.table({"text": pa.array(texts, pa.string())})
                pq.write_table(table, self.folder / name, compression="zstd")
                part[split] = name
        self.state["parts"].append(part)
        self.state.update(stream=stream_state, tally=tally, done=done)
        write_json(self.folder / "state.json", self.state)
        self.pending = {"train": [], "val": []}
        self.pending_bytes = 0
        fault = os.environ.get("DSFLOW_FAULT_DOWNLOAD_PARTS")
        if fault and len(self.state["parts"]) >= int(fault) and not done:
            os.kill(os.getpid(), signal.SIGKILL)

    def texts(self, split: str) -> Iterator[list[str]]:
        """The committed texts of one split, in order, a row group at a time."""
        for part in self.state["parts"]:
            if split in part:
                for batch in pq.ParquetFile(self.folder / part[split]).iter_batches(
                    batch_size=PART_DOCS
                ):
                    yield batch.column(0).to_pylist()
