"""The `files` source: local .txt, .jsonl and .parquet files -> document texts.

Files are read with plain buffered reads in blocks of `BLOCK` bytes, so memory stays bounded by
a few blocks and the largest document (`MAX_DOC_BYTES`), not the file or corpus size, and a file
costs one open and a few reads: no per-file framework setup. Documents come out in batches of
UTF-8 bytes (views of the block read, where they are its bytes verbatim), validated and cleaned,
so the writer never converts them back from str. A batch ends once its parts read BLOCK bytes,
so the blocks its views keep alive are few.
`download.files.split_by` says how a text becomes documents:

- `auto`: a .txt file is cut like `chunk`; a .jsonl or .parquet record is one document.
- `file`: a .txt file (or a record) is one document.
- `paragraph`: runs of non-blank lines, separated by blank lines, each stripped.
- `line`: each line without its line ending.
- `chunk`: pieces of at most `chunk_bytes` bytes that end at a line end; a longer line is cut at a
  character boundary. The pieces of a file concatenate back to the file exactly.

A file's documents come in parts, each a range of the file (bytes of a .txt or .jsonl, rows of a
.parquet) holding whole documents, with a hash of what the range holds. Cutting a part's range
again gives the same documents (`read_part`), so data/raw may keep parts instead of documents,
and a later reader knows when the file changed under it.
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import os
import re
import stat
from collections.abc import Iterator
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
from xxhash import xxh3_64, xxh3_64_intdigest

from dsflow.errors import UsageError
from dsflow.progress import bar

BLOCK = 8 << 20
# The most one document may hold. A paragraph or line waiting for its end is held whole, and the
# writer and tokenize hold whole documents; past this the file is not cut the way split_by says.
MAX_DOC_BYTES = 8 << 20
# A record batch ends at this many documents or BLOCK bytes, whichever comes first.
BATCH_DOCS = 1024
SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
# A newline, then one or more lines holding only whitespace: the end of a paragraph.
PARAGRAPH_BREAK = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")
UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
# The first byte that is not ASCII whitespace (as str.isspace has it, with the separators
# \x1c-\x1f): an ASCII one makes a document non-blank at once.
NOT_SPACE = re.compile(rb"[^ \t\n\r\f\v\x1c-\x1f]")


class Part(NamedTuple):
    """Documents of one file range: [start, end) in bytes (.txt, .jsonl) or rows (.parquet), and
    xxh3-64 of what the range holds (its bytes; a .parquet's texts, each after its length), and
    how many bytes that is."""

    docs: list[bytes]
    start: int
    end: int
    digest: int
    size: int


def expand_paths(patterns: list[str]) -> list[tuple[str, int]]:
    """(path, size) of every regular file the patterns match, each glob sorted."""
    if not patterns:
        raise UsageError("download.files.paths: empty; list .txt/.jsonl/.parquet files or globs")
    files: list[tuple[str, int]] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise UsageError(f"download.files.paths: {pattern!r} matches no file")
        for path in matched:
            st = os.stat(path)
            if stat.S_ISREG(st.st_mode):
                files.append((path, st.st_size))
    return files


def check_file(path: str) -> str:
    """The file's suffix, once it is known to be a supported file (one stat per file: the
    permission check is the open itself)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUFFIXES:
        raise UsageError(f"{path}: unsupported file type {ext!r} (use .txt, .jsonl or .parquet)")
    if ext == ".parquet":
        try:
            pq.ParquetFile(path)
        except PermissionError:
            raise UsageError(f"{path}: cannot read the file (check its permissions)") from None
        except (pa.ArrowException, OSError) as e:
            msg = str(e).strip()[:200]
            raise UsageError(f"{path}: cannot read as .parquet ({msg})") from None
    return ext


def check_text_start(path: str, head: bytes) -> None:
    """Refuse what is not UTF-8 text before reading further: binaries and UTF-16."""
    if head.startswith(UTF16_BOMS):
        raise UsageError(
            f"{path}: UTF-16 text; re-encode the file as UTF-8 (iconv -f UTF-16 -t UTF-8)"
        )
    nul = head.find(b"\x00", 0, 8192)
    if nul >= 0:
        raise UsageError(
            f"{path}: looks binary (a NUL byte at offset {nul}); list only text files in "
            "download.files.paths"
        )


def decode(path: str, data: bytes, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path}: not valid UTF-8 at byte {offset + e.start}; re-encode the file as UTF-8 "
            "(e.g. iconv -f LATIN1 -t UTF-8)"
        ) from None


def too_long(path: str, split_by: str, where: str) -> UsageError:
    unit = {"paragraph": "paragraph (no blank line)", "line": "line"}.get(split_by, "document")
    return UsageError(
        f"{path}: a {unit} longer than {MAX_DOC_BYTES} bytes {where}; a document holds at most "
        f"{MAX_DOC_BYTES >> 20} MB: set download.files.split_by: chunk (pieces of "
        "download.files.chunk_bytes, cut at line ends)"
    )


def cut_chunks(data: bytes, chunk_bytes: int, final: bool) -> tuple[list[tuple[int, int]], int]:
    """(start, end) pieces of `data` of at most `chunk_bytes`, ending after a newline where the
    piece has one; the offset where the unfinished rest starts (all of it when `final`)."""
    spans, pos, n = [], 0, len(data)
    while n - pos > chunk_bytes or (final and pos < n):
        if n - pos <= chunk_bytes:
            end = n
        else:
            end = data.rfind(b"\n", pos, pos + chunk_bytes) + 1
            if end <= pos:  # one line longer than a chunk: cut it, not a character
                end = pos + chunk_bytes
                while end > pos and (data[end] & 0xC0) == 0x80:
                    end -= 1
                if end == pos:  # no character starts here (not UTF-8): decoding will say so
                    end = pos + chunk_bytes
        spans.append((pos, end))
        pos = end
    # A part is cut again on its own (read_part), with nothing after it, which makes whatever
    # is left within chunk_bytes one chunk. So every chunk but a part's last must start more
    # than chunk_bytes before the part's end: trailing chunks that do not wait for the next
    # block, where they come out the same.
    while not final and len(spans) >= 2 and pos - spans[-2][0] <= chunk_bytes:
        spans.pop()
        pos = spans[-1][1]
    return spans, pos


def cut_separated(
    data: bytes, split_by: str, final: bool, scan: int = 0
) -> tuple[list[tuple[int, int]], int]:
    """(start, end) paragraphs or lines of `data`; where the unfinished rest starts. The search
    for separators starts at `scan`: the caller knows no separator starts before it, so a long
    document is searched once, not once per block read."""
    spans, pos = [], 0
    if split_by == "paragraph":
        for m in PARAGRAPH_BREAK.finditer(data, scan):
            spans.append((pos, m.start()))
            pos = m.end()
    else:
        nl = data.find(b"\n", scan)
        while nl >= 0:
            spans.append((pos, nl))
            pos = nl + 1
            nl = data.find(b"\n", pos)
    if final and pos < len(data):
        spans.append((pos, len(data)))
        pos = len(data)
    return spans, pos


def cut(data: bytes, split_by: str, chunk_bytes: int, final: bool, scan: int = 0):
    if split_by in ("chunk", "auto"):
        return cut_chunks(data, chunk_bytes, final)
    if split_by == "file":
        return ([(0, len(data))], len(data)) if final else ([], 0)
    return cut_separated(data, split_by, final, scan)


def resume_at(data: bytes, keep: int, split_by: str) -> int:
    """Where the separator search resumes once data[keep:], the unfinished document, is read
    again with the next block: it holds no line end (line), or no blank line, though one may
    start at its last line end (paragraph)."""
    if split_by == "line":
        return len(data) - keep
    if split_by == "paragraph":
        return max(data.rfind(b"\n", keep) - keep, 0)
    return 0


def clean(text: str, split_by: str) -> str:
    """Paragraphs lose surrounding whitespace, lines their line ending; chunks stay verbatim."""
    if split_by == "paragraph":
        return text.strip()
    if split_by == "line":
        return text.rstrip("\r")
    return text


def blank(data: bytes, start: int, end: int) -> bool:
    """Whether data[start:end], valid UTF-8, holds only whitespace (Unicode's, as str.isspace)."""
    if end <= start:
        return True
    if 32 < data[start] < 127:  # most documents start with a visible ASCII character
        return False
    m = NOT_SPACE.search(data, start, end)
    if m is None:
        return True
    return data[m.start()] >= 0x80 and data[m.start() : end].decode("utf-8").isspace()


def documents(path: str, data: bytes, spans, base: int, split_by: str) -> list:
    """The non-blank documents of `data`'s spans as cleaned UTF-8 bytes; `base` is the file
    offset of data[0], for the messages. The spans' bytes are checked as UTF-8 at once; a
    verbatim piece (chunk, file) is a memoryview of `data`, not a copy: most are only hashed
    and counted, and a writer that keeps one copies it (`bytes(doc)`)."""
    if not spans:
        return []
    lo, hi = spans[0][0], spans[-1][1]
    if not data.isascii():
        decode(path, data[lo:hi], base + lo)
    docs = []
    view = memoryview(data)
    for start, end in spans:
        if end - start > MAX_DOC_BYTES:
            raise too_long(path, split_by, f"at byte {base + start}")
        if split_by not in ("paragraph", "line"):
            if not blank(data, start, end):
                docs.append(view[start:end])
            continue
        text = data[start:end].decode("utf-8")
        kept = clean(text, split_by)
        if kept and not kept.isspace():
            docs.append(kept.encode("utf-8"))
    return docs


def txt_batches(path: str, size: int, split_by: str, chunk_bytes: int, progress) -> Iterator[Part]:
    """The documents of one .txt file, a block at a time. Each block is searched once: the
    unfinished rest carried to the next block is at most MAX_DOC_BYTES, and its search resumes
    where it stopped, so time is linear in the file and memory bounded by BLOCK + MAX_DOC_BYTES."""
    if split_by == "file" and size > MAX_DOC_BYTES:
        raise too_long(path, split_by, f"({size} bytes, download.files.split_by: file)")
    with open(path, "rb") as f:
        # Never more than the file holds: a small file's bytes become its document, and a read
        # of BLOCK would carve each from an 8 MB allocation, scattering the heap.
        want = size if split_by == "file" else min(size, BLOCK)
        data = f.read(want)
        check_text_start(path, data)
        base, scan = 0, 0  # the file offset of data[0]; where the separator search resumes
        while True:
            final = len(data) < want or base + len(data) >= size
            spans, keep = cut(data, split_by, chunk_bytes, final, scan)
            docs = documents(path, data, spans, base, split_by)
            yield Part(docs, base, base + keep, xxh3_64_intdigest(memoryview(data)[:keep]), keep)
            progress.update(keep)
            if final:
                return
            if len(data) - keep > MAX_DOC_BYTES:
                raise too_long(path, split_by, f"at byte {base + keep}")
            # The unfinished rest is read again with the next block, from the page cache: one
            # copy of it, where joining it to the block would copy the block as well.
            scan = resume_at(data, keep, split_by)
            base += keep
            want = len(data) - keep + BLOCK
            f.seek(base)
            data = f.read(want)


class Record(NamedTuple):
    """One record of a .jsonl or .parquet file: where it is (for messages), its text (None for
    a blank line or a null), the bytes its part's hash takes in, and where the next one starts."""

    where: str
    text: str | None
    hashed: bytes
    end: int


def jsonl_records(path: str, field: str, lines, offset: int = 0):
    """The records of .jsonl `lines`, an iterable of bytes lines from byte `offset` on (line
    numbers count from there)."""
    for lineno, line in enumerate(lines, 1):
        if offset == 0:
            check_text_start(path, line)
        text = decode(path, line, offset)
        offset += len(line)
        if not text.strip():
            yield Record(f"line {lineno}", None, line, offset)
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(
                f"{path}: line {lineno}: not valid JSON ({e.msg}); .jsonl holds one JSON "
                "object per line"
            ) from None
        yield Record(
            f"line {lineno}", record_text(path, record, field, f"line {lineno}"), line, offset
        )


def record_text(path: str, record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        fields = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise UsageError(
            f"{path}: {where}: a record has no field {field!r} (fields: {fields}); "
            "set download.files.text_field"
        )
    text = record[field]
    if not isinstance(text, str):
        raise UsageError(f"{path}: {where}: field {field!r} holds {type(text).__name__}, not text")
    return text


def text_column(path: str, field: str) -> pq.ParquetFile:
    """The .parquet file, once `field` is known to be a text column of it."""
    pf = pq.ParquetFile(path)
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UsageError(
            f"{path}: a record has no field {field!r} (fields: {', '.join(sorted(schema.names))}); "
            "set download.files.text_field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UsageError(f"{path}: field {field!r} holds {kind}, not text")
    return pf


def parquet_records(path: str, field: str, progress) -> Iterator[Record]:
    """The records of a .parquet file. A text is hashed after its length, so moving a character
    between neighbours changes the hash; a null as 8 x 0xff."""
    pf = text_column(path, field)
    per_group = os.path.getsize(path) // max(pf.num_row_groups, 1)
    row = 0
    for group in range(pf.num_row_groups):
        for batch in pf.iter_batches(batch_size=1024, row_groups=[group], columns=[field]):
            for text in batch.column(0).to_pylist():
                row += 1
                yield Record(f"row {row}", text, hashed_text(text), row)
        progress.update(per_group)


class RowCursor:
    """A .parquet file's text column, read forward. Parts of one row group are read one after
    another (a piece's, then the next piece's): each continues the decode where the last one
    stopped, where starting at the row group each time would cost a group of n parts n times
    its decode. Rows skipped over are decoded by Arrow but never made str."""

    def __init__(self, path: str, field: str):
        self.key = cursor_key(path, field)
        self.batches = text_column(path, field).iter_batches(batch_size=1024, columns=[field])
        self.at = 0  # the row number of self.held[0]
        self.held = pa.array([], pa.string())

    def take(self, lo: int, hi: int) -> list[str | None]:
        """The texts of rows [lo, hi); lo must not be before where the last take ended."""
        texts: list[str | None] = []
        while self.at < hi:
            if len(self.held) == 0:
                batch = next(self.batches, None)
                if batch is None:
                    break
                self.held = batch.column(0)
            skip = max(lo - self.at, 0)
            n = min(len(self.held), hi - self.at)
            if skip < n:
                texts += self.held.slice(skip, n - skip).to_pylist()
            self.held, self.at = self.held.slice(n), self.at + n
        return texts


_cursor: list[RowCursor] = []  # the last one this process used


def cursor_key(path: str, field: str) -> tuple:
    """What a cursor may go on reading: the same column of the same file, unchanged since."""
    st = os.stat(path)
    return path, field, st.st_ino, st.st_size, st.st_mtime_ns


def parquet_rows(path: str, field: str, lo: int, hi: int) -> list[Record]:
    """The records of rows [lo, hi) of a .parquet file, through the cursor the last call left
    when it can go on from there."""
    if not _cursor or _cursor[0].key != cursor_key(path, field) or lo < _cursor[0].at:
        _cursor[:] = [RowCursor(path, field)]
    texts = _cursor[0].take(lo, hi)
    return [Record(f"row {i}", t, hashed_text(t), i) for i, t in enumerate(texts, lo + 1)]


def hashed_text(text: str | None) -> bytes:
    if text is None:
        return b"\xff" * 8
    data = text.encode("utf-8")
    return len(data).to_bytes(8, "little") + data


def record_documents(path: str, record: Record, split_by: str, chunk_bytes: int) -> list[bytes]:
    """A record's documents (a record is one under auto and file)."""
    data = record.text.encode("utf-8")
    if split_by in ("auto", "file"):
        spans = [(0, len(data))]
    else:
        spans, _ = cut(data, split_by, chunk_bytes, final=True)
    if any(end - start > MAX_DOC_BYTES for start, end in spans):
        raise too_long(path, split_by, f"in the record at {record.where}")
    return documents(path, data, spans, 0, split_by)


def record_batches(path: str, records, split_by: str, chunk_bytes: int) -> Iterator[Part]:
    """The records' documents in parts of at most BATCH_DOCS documents or BLOCK bytes; a part's
    hash takes in its records' `hashed` bytes."""
    docs: list[bytes] = []
    size, start, end = 0, 0, 0
    digest = xxh3_64()
    for record in records:
        digest.update(record.hashed)
        size += len(record.hashed)
        end = record.end
        if record.text is None:
            continue
        docs += record_documents(path, record, split_by, chunk_bytes)
        if len(docs) >= BATCH_DOCS or size >= BLOCK:
            yield Part(docs, start, end, digest.intdigest(), size)
            docs, size, start = [], 0, end
            digest = xxh3_64()
    yield Part(docs, start, end, digest.intdigest(), size)


def changed(path: str, unit: str, start: int, end: int) -> UsageError:
    return UsageError(
        f"{path}: changed since the download stage read it ({unit} {start} to {end} differ); "
        "rerun the download stage (dvc repro -f -s download, or snakemake -f download)"
    )


def read_part(path: str, ext: str, start: int, end: int, digest: int, cfg: dict) -> list[bytes]:
    """The documents of a part the download stage found at [start, end) of `path` with hash
    `digest`, cut as the `download.files` settings `cfg` say; a file that changed since (or went
    away) is an error that says to rerun the download stage."""
    split_by, chunk_bytes = cfg["split_by"], cfg["chunk_bytes"]
    unit = "rows" if ext == ".parquet" else "bytes"
    try:
        if ext == ".parquet":
            records = parquet_rows(path, cfg["text_field"], start, end)
            hashed = b"".join(r.hashed for r in records)
        else:
            with open(path, "rb") as f:
                f.seek(start)
                hashed = f.read(end - start)
    except PermissionError:
        raise UsageError(f"{path}: cannot read the file (check its permissions)") from None
    except (OSError, pa.ArrowException, UsageError):
        raise changed(path, unit, start, end) from None
    if xxh3_64_intdigest(hashed) != digest:
        raise changed(path, unit, start, end)
    if ext == ".txt":
        spans, _ = cut(hashed, split_by, chunk_bytes, final=True)
        return documents(path, hashed, spans, start, split_by)
    if ext != ".parquet":
        records = jsonl_records(path, cfg["text_field"], io.BytesIO(hashed), start)
    docs: list[bytes] = []
    for record in records:
        if record.text is not None:
            docs += record_documents(path, record, split_by, chunk_bytes)
    return docs


class FileSource:
    """Documents of the listed files, in the order of `download.files.paths` (globs sorted).
    `parts` lists (file number, start, end, documents, hash, bytes) of every part read so far."""

    def __init__(self, cfg: dict):
        self.split_by = cfg["split_by"]
        self.chunk_bytes = cfg["chunk_bytes"]
        self.field = cfg["text_field"]
        self.files = expand_paths(cfg["paths"])
        self.paths = [path for path, _ in self.files]
        self.kinds = [check_file(p) for p in self.paths]
        self.total = sum(size for _, size in self.files)
        self.parts: list[tuple[int, int, int, int, int, int]] = []

    def file_parts(self, path: str, size: int, ext: str, progress) -> Iterator[Part]:
        if ext == ".txt":
            yield from txt_batches(path, size, self.split_by, self.chunk_bytes, progress)
        elif ext == ".parquet":
            records = parquet_records(path, self.field, progress)
            yield from record_batches(path, records, self.split_by, self.chunk_bytes)
        else:
            with open(path, "rb") as f:
                records = jsonl_records(path, self.field, f)
                for part in record_batches(path, records, self.split_by, self.chunk_bytes):
                    progress.update(part.end - part.start)
                    yield part

    def batches(self) -> Iterator[tuple[list[bytes], list[str]]]:
        """(documents, the file each comes from): non-blank, as UTF-8 bytes, in file order,
        small files' documents together, about BATCH_DOCS documents or BLOCK bytes a batch. A
        file with no document is an error."""
        docs: list[bytes] = []
        origins: list[str] = []
        held = 0
        with bar(desc="download", total=self.total, unit="B") as progress:
            for number, ((path, size), ext) in enumerate(zip(self.files, self.kinds, strict=True)):
                found = False
                try:
                    for part in self.file_parts(path, size, ext, progress):
                        if not part.docs:
                            continue
                        found = True
                        self.parts.append(
                            (number, part.start, part.end, len(part.docs), part.digest, part.size)
                        )
                        docs += part.docs
                        origins += [path] * len(part.docs)
                        # What the part read, not what its documents hold: a .txt part's
                        # documents are views that keep its whole block alive.
                        held += part.size
                        if len(docs) >= BATCH_DOCS or held >= BLOCK:
                            yield docs, origins
                            docs, origins, held = [], [], 0
                except PermissionError:
                    raise UsageError(
                        f"{path}: cannot read the file (check its permissions)"
                    ) from None
                if not found:
                    raise UsageError(
                        f"{path}: no non-empty document (the file is empty or only whitespace); "
                        "remove it from download.files.paths"
                    )
        if docs:
            yield docs, origins
