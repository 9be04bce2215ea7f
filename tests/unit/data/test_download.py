import json
import math
import os
import random
import shutil
import tracemalloc
from contextlib import chdir

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT, dsflow, update_params
from dsflow import params as params_mod
from dsflow.data import download, grammar, raw, textfiles, tokenizer, tokenizing
from dsflow.data.raw import val_split
from dsflow.data.textfiles import FileSource
from dsflow.errors import UsageError
from grammar_ll1 import score


def read_split(repo, split):
    """The split's rows, as data/raw stores them or as the files it references say."""
    path = repo / f"data/raw/{split}.parquet"
    if path.exists():
        return pq.read_table(path).to_pylist()
    with chdir(repo):
        return [{"text": t} for texts, _ in raw.batches(split) for t in texts]


def test_builtin_download_manifest_and_split(prepared):
    manifest = json.loads((prepared / "data/raw/manifest.json").read_text())
    train, val = read_split(prepared, "train"), read_split(prepared, "val")
    assert manifest["source"] == "builtin"
    assert manifest["splits"]["train"]["docs"] == len(train)
    assert manifest["splits"]["val"]["docs"] == len(val)
    assert len(train) + len(val) == 400 and len(val) > 0
    assert all(val_split(d["text"], 0.05) for d in val)
    assert not any(val_split(d["text"], 0.05) for d in train)
    assert manifest["splits"]["val"]["bytes"] == sum(len(d["text"].encode()) for d in val)
    # The floor is the grammar's exact information per byte.
    docs = train + val
    nats = -sum(d["logprob"] for d in docs)
    nbytes = sum(len(d["text"].encode()) for d in docs)
    assert manifest["entropy_bits_per_byte"] == pytest.approx(nats / math.log(2) / nbytes)
    assert 0.1 < manifest["entropy_bits_per_byte"] < 3
    # Every recorded logprob is the grammar's own score of the text.
    for d in docs[:50]:
        assert score(d["text"]) == pytest.approx(d["logprob"], rel=1e-9)


def test_download_is_byte_identical_on_rerun(project):
    dsflow("download", cwd=project)
    first = {p.name: p.read_bytes() for p in (project / "data/raw").iterdir()}
    dsflow("download", cwd=project)
    assert {p.name: p.read_bytes() for p in (project / "data/raw").iterdir()} == first
    assert not list((project / "data").glob(".raw.tmp-*"))


def _files_params(project, paths, field="text", max_docs=None):
    update_params(
        project,
        {
            "download": {
                "source": "files",
                "max_docs": max_docs,
                "files": {"paths": paths, "text_field": field},
            }
        },
    )


def test_files_source_reads_txt_jsonl_parquet_and_globs(project, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"story{i:02d}.txt").write_text(
            f"Story {i}.\n\nIt has two paragraphs, number {i}.\n"
        )
    with open(src / "more.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"body": f"json document {i}", "id": i}) + "\n")
    pq.write_table(
        pa.table({"body": [f"parquet document {i}" for i in range(30)]}), src / "p.parquet"
    )
    _files_params(
        project, [str(src / "*.txt"), str(src / "more.jsonl"), str(src / "p.parquet")], "body"
    )
    proc = dsflow("download", cwd=project, check=False)
    # .txt files have no field to choose: the whole file is the document.
    assert proc.returncode == 0, proc.stderr
    texts = {d["text"] for s in ("train", "val") for d in read_split(project, s)}
    assert len(texts) == 90
    assert "Story 3.\n\nIt has two paragraphs, number 3.\n" in texts
    assert "json document 7" in texts and "parquet document 29" in texts


@pytest.mark.parametrize(
    "setup, expect",
    [
        ("missing_field", "no field 'text'"),
        ("not_utf8", "not valid UTF-8"),
        ("wrong_ext", "unsupported file type"),
        ("no_match", "matches no file"),
        ("empty", "no non-empty document"),
        ("zero_bytes", "no non-empty document"),
        ("binary", "looks binary"),
        ("utf16", "UTF-16 text"),
        ("bad_parquet", "cannot read as .parquet"),
    ],
)
def test_bad_files_fail_with_one_line_naming_the_file(project, tmp_path, setup, expect):
    bad = tmp_path / "bad"
    bad.mkdir()
    if setup == "missing_field":
        path = bad / "x.jsonl"
        path.write_text('{"body": "hello"}\n')
    elif setup == "not_utf8":
        path = bad / "x.txt"
        path.write_bytes(b"caf\xe9 au lait\n")
    elif setup == "wrong_ext":
        path = bad / "x.docx"
        path.write_text("hello")
    elif setup == "no_match":
        path = bad / "nothing*.txt"
    elif setup == "empty":
        path = bad / "x.txt"
        path.write_text("   \n")
    elif setup == "zero_bytes":
        path = bad / "x.txt"
        path.write_bytes(b"")
    elif setup == "binary":
        path = bad / "x.txt"
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    elif setup == "utf16":
        path = bad / "x.txt"
        path.write_text("caf\u00e9 au lait\n", encoding="utf-16")
    else:
        path = bad / "x.parquet"
        path.write_text("this is not parquet")
    _files_params(project, [str(path)])
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expect in lines[0]
    if setup != "no_match":
        assert str(path) in lines[0]
    assert not (project / "data/raw").exists()
    assert not list((project / "data").glob(".raw.tmp-*"))


def test_hf_source_streams_a_local_dataset_with_caps(project, tmp_path):
    # The same datasets.load_dataset(..., streaming=True) code the Hub uses, on a local folder.
    local = tmp_path / "hub_copy"
    local.mkdir()
    texts = [f"Once upon a time there was story number {i}." for i in range(500)]
    pq.write_table(pa.table({"text": texts}), local / "train-00000.parquet")
    update_params(
        project,
        {
            "download": {
                "source": "hf",
                "max_docs": 200,
                "hf": {"path": str(local), "split": "train"},
            }
        },
    )
    dsflow("download", cwd=project)
    manifest = json.loads((project / "data/raw/manifest.json").read_text())
    assert manifest["source"] == "hf"
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == 200
    update_params(project, {"download": {"max_docs": None, "max_bytes": 1000}})
    dsflow("download", cwd=project)
    manifest = json.loads((project / "data/raw/manifest.json").read_text())
    total = manifest["splits"]["train"]["bytes"] + manifest["splits"]["val"]["bytes"]
    assert 1000 <= total < 1100


def test_unreachable_hub_dataset_is_a_clear_error(project):
    update_params(project, {"download": {"source": "hf", "hf": {"path": "nobody/no-such-dataset"}}})
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if os.environ.get("DSFLOW_TEST_NETWORK"):
        env = {}
    proc = dsflow("download", cwd=project, check=False, env=env, timeout=300)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "download.hf.path" in line and "nobody/no-such-dataset" in line
    assert "Traceback" not in proc.stderr


def lines_of_text(n: int) -> str:
    """`n` distinct lines of grammar prose, with a blank line after every fifth."""
    out = []
    for i in range(n):
        out.append(f"{i}: {grammar.generate(7, i % 300)[0].splitlines()[0]}\n")
        if i % 5 == 4:
            out.append("\n")
    return "".join(out)


def file_docs(paths, split_by, chunk_bytes=8192, field="text") -> list[str]:
    cfg = {"paths": [str(p) for p in paths], "split_by": split_by}
    cfg.update(chunk_bytes=chunk_bytes, text_field=field)
    return [str(d, "utf-8") for docs, _ in FileSource(cfg).batches() for d in docs]


def test_split_by_cuts_files_into_paragraphs_lines_or_chunks(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("One.\nStill one.\n\n  \nTwo.\r\n\nThree\n")
    assert file_docs([path], "file") == [path.read_bytes().decode()]
    assert file_docs([path], "paragraph") == ["One.\nStill one.", "Two.", "Three"]
    assert file_docs([path], "line") == ["One.", "Still one.", "Two.", "Three"]
    # Chunks end at a line end and concatenate back to the file.
    chunks = file_docs([path], "chunk", chunk_bytes=20)
    assert "".join(chunks) == path.read_bytes().decode()
    assert all(len(c.encode()) <= 20 and c.endswith("\n") for c in chunks)
    # A line longer than a chunk is cut, never inside a character.
    path.write_text("\u00e9" * 50 + "\n")
    chunks = file_docs([path], "chunk", chunk_bytes=33)
    assert "".join(chunks) == path.read_bytes().decode() and [len(c.encode()) for c in chunks] == [
        32
    ] * 3 + [5]
    # Records are documents under auto; other modes cut them too.
    rec = tmp_path / "r.jsonl"
    rec.write_text(json.dumps({"text": "a\nb"}) + "\n")
    assert file_docs([rec], "auto") == ["a\nb"] and file_docs([rec], "line") == ["a", "b"]


@pytest.mark.parametrize("split_by", ["paragraph", "line", "chunk"])
def test_documents_do_not_depend_on_the_read_block_size(tmp_path, monkeypatch, split_by):
    path = tmp_path / "big.txt"
    path.write_text(lines_of_text(400))
    whole = file_docs([path], split_by, chunk_bytes=300)
    monkeypatch.setattr(textfiles, "BLOCK", 97)  # blocks end inside lines, paragraphs, chunks
    assert file_docs([path], split_by, chunk_bytes=300) == whole
    assert len(whole) > 20


@pytest.mark.parametrize("split_by", ["paragraph", "line"])
def test_cutting_does_not_depend_on_where_blocks_end(tmp_path, monkeypatch, split_by):
    """Blank lines, line ends and whitespace runs of every shape, cut by blocks of every size."""
    rng = random.Random(0)
    pieces = ["word", "b c", " ", "\t", "\n", "\n", "\r\n", "\n \n"]
    path = tmp_path / "mixed.txt"
    path.write_text("".join(rng.choice(pieces) for _ in range(3000)))
    whole = file_docs([path], split_by)
    assert len(whole) > 100
    for block in (1, 2, 3, 7, 64):
        monkeypatch.setattr(textfiles, "BLOCK", block)
        assert file_docs([path], split_by) == whole, block


@pytest.mark.parametrize("split_by", ["paragraph", "line"])
def test_a_document_with_no_end_stops_the_read_early_in_bounded_memory(
    tmp_path, monkeypatch, split_by
):
    """24 MB with no blank line (paragraph) or no line end (line): the read stops once the
    unfinished document outgrows MAX_DOC_BYTES, holding a few blocks, not the file."""
    monkeypatch.setattr(textfiles, "BLOCK", 1 << 18)
    monkeypatch.setattr(textfiles, "MAX_DOC_BYTES", 1 << 20, raising=False)
    path = tmp_path / "dump.txt"
    line = "a line of one paragraph that never ends\n" if split_by == "paragraph" else "word "
    path.write_text("head\n\n" + line * (24_000_000 // len(line)))
    tracemalloc.start()
    try:
        with pytest.raises(UsageError) as err:
            file_docs([path], split_by)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    assert str(path) in str(err.value) and "longer than 1048576 bytes at byte 6;" in str(err.value)
    assert "set download.files.split_by: chunk" in str(err.value)


class CountingPattern:
    """A compiled pattern that counts the bytes its searches start on."""

    def __init__(self, pattern):
        self.pattern, self.scanned = pattern, 0

    def finditer(self, data, pos=0):
        self.scanned += len(data) - pos
        return self.pattern.finditer(data, pos)


def test_a_long_paragraph_is_searched_once_not_once_per_block(tmp_path, monkeypatch):
    """Paragraphs of 500 KB read 16 KB at a time: each byte is searched for a blank line about
    once (a search from the paragraph's start at every block was quadratic)."""
    paragraphs = [f"paragraph {i}\n" + "a line in it\n" * 40_000 for i in range(16)]
    path = tmp_path / "long.txt"
    path.write_text("\n".join(paragraphs))
    counter = CountingPattern(textfiles.PARAGRAPH_BREAK)
    monkeypatch.setattr(textfiles, "PARAGRAPH_BREAK", counter)
    monkeypatch.setattr(textfiles, "BLOCK", 1 << 14)
    assert file_docs([path], "paragraph") == [p.strip() for p in paragraphs]
    assert counter.scanned < 1.2 * path.stat().st_size


def test_documents_longer_than_the_limit_name_the_file_and_where(tmp_path, monkeypatch):
    monkeypatch.setattr(textfiles, "MAX_DOC_BYTES", 1000)
    path = tmp_path / "whole.txt"
    path.write_text("x" * 999 + "\n")
    assert file_docs([path], "file") == ["x" * 999 + "\n"]
    path.write_text("x" * 1000 + "\n")
    with pytest.raises(UsageError, match=r"whole.txt: a document longer than 1000 bytes \(1001"):
        file_docs([path], "file")
    rec = tmp_path / "r.jsonl"
    rec.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "y" * 1001}) + "\n")
    with pytest.raises(
        UsageError, match=r"r.jsonl: a document .* in the record at line 2; .*chunk"
    ):
        file_docs([rec], "auto")
    assert len(file_docs([rec], "chunk", chunk_bytes=500)) == 4


def test_row_groups_do_not_depend_on_how_documents_arrive(tmp_path, monkeypatch):
    """A row group ends after the document that brings it to ROW_GROUP_DOCS documents or
    ROW_GROUP_BYTES, whether documents come one at a time or in batches of any size."""
    monkeypatch.setattr(download, "ROW_GROUP_DOCS", 7)
    monkeypatch.setattr(download, "ROW_GROUP_BYTES", 100)
    rng = random.Random(1)
    docs = [bytes([97 + i % 26]) * rng.randint(1, 40) for i in range(300)]
    files = []
    for sizes in ([1] * len(docs), [len(docs)], [rng.randint(1, 30) for _ in range(60)]):
        out = tmp_path / f"out{len(files)}"
        out.mkdir()
        writer = download.SplitWriter(out, pa.schema([("text", pa.string())]))
        start = 0
        for n in sizes:
            writer.add("train", docs[start : start + n])
            start += n
        writer.add("train", docs[start:])
        writer.close()
        files.append((out / "train.parquet").read_bytes())
    assert files[0] == files[1] == files[2]
    meta = pq.ParquetFile(tmp_path / "out0/train.parquet").metadata
    expect, rows, held = [], 0, 0
    for d in docs:
        rows, held = rows + 1, held + len(d)
        if rows == 7 or held >= 100:
            expect.append(rows)
            rows, held = 0, 0
    expect += [rows] if rows else []
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == expect


def test_one_big_txt_file_works_with_the_defaults(project, tmp_path):
    path = tmp_path / "shakespeare.txt"
    path.write_text(lines_of_text(6000))
    _files_params(project, [str(path)])
    dsflow("download", cwd=project)
    manifest = json.loads((project / "data/raw/manifest.json").read_text())
    splits = manifest["splits"]
    assert manifest["split_by"] == "auto" and splits["val"]["docs"] > 0
    assert splits["train"]["bytes"] + splits["val"]["bytes"] == path.stat().st_size
    val = [d["text"] for d in read_split(project, "val")]
    texts = val + [d["text"] for d in read_split(project, "train")]
    assert max(len(t.encode()) for t in texts) <= 8192
    assert [val_split(t, 0.05) for t in texts] == [True] * len(val) + [False] * (
        len(texts) - len(val)
    )


def test_a_document_too_long_for_the_split_names_the_file_and_the_key(project, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(lines_of_text(600))
    for i in range(5):
        (tmp_path / f"small{i}.txt").write_text(f"small file {i}\n")
    _files_params(project, [str(tmp_path / "*.txt")])
    update_params(project, {"download": {"files": {"split_by": "file"}}})
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and str(big) in line
    assert "download.files.split_by: chunk" in line and "download.val_fraction" in line
    # Already cut in chunks: the fix is smaller chunks.
    update_params(project, {"download": {"files": {"split_by": "auto", "chunk_bytes": 10**6}}})
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2 and "lower download.files.chunk_bytes (now 1000000)" in proc.stderr


def test_an_empty_val_split_says_what_to_set(project, tmp_path):
    path = tmp_path / "few.txt"
    path.write_text("one line\nanother line\n")
    _files_params(project, [str(path)])
    update_params(project, {"download": {"files": {"split_by": "line"}}})
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "leave the val split empty" in line and "download.val_fraction" in line
    assert "\n" not in line


def test_interrupted_hf_download_resumes_where_it_stopped(project, tmp_path):
    local = tmp_path / "hub_copy" / "data"
    local.mkdir(parents=True)
    n_files, per_file = 3, 6000
    for k in range(n_files):
        texts = [f"Shard {k} document {i} of the local hub copy." for i in range(per_file)]
        pq.write_table(pa.table({"text": texts}), local / f"train-{k:05d}-of-00003.parquet")
    hf = {"path": str(local.parent), "split": "train"}
    update_params(project, {"download": {"source": "hf", "max_docs": None, "hf": hf}})
    fresh = tmp_path / "fresh"
    shutil.copytree(project, fresh)
    dsflow("download", cwd=fresh)
    # Killed after the first commit, part-way into the second file.
    proc = dsflow("download", cwd=project, check=False, env={"DSFLOW_FAULT_DOWNLOAD_PARTS": "1"})
    assert proc.returncode == -9
    state = json.loads((project / "data/raw.partial/state.json").read_text())
    done = sum(state["tally"]["stats"][s]["docs"] for s in ("train", "val"))
    assert per_file < done < 2 * per_file and not (project / "data/raw").exists()
    # The first file changes: a resumed download never reads it again.
    pq.write_table(
        pa.table({"text": [f"changed {i}" for i in range(per_file)]}),
        local / "train-00000-of-00003.parquet",
    )
    proc = dsflow("download", cwd=project)
    assert f"resuming after {done} documents" in proc.stderr
    for name in ("train.parquet", "val.parquet", "manifest.json"):
        assert (project / "data/raw" / name).read_bytes() == (
            fresh / "data/raw" / name
        ).read_bytes()
    assert not (project / "data/raw.partial").exists()


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(UsageError, match=r"x.jsonl: line 2: field 'text' holds int"):
        file_docs([path], "auto")
    path.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(UsageError, match=r"x.jsonl: line 2: not valid JSON"):
        file_docs([path], "auto")


def test_blank_is_what_str_isspace_says():
    for text in (" \x1c\x1f \n", "\u3000\t", "\x85 "):
        data = text.encode()
        assert textfiles.blank(data, 0, len(data)), repr(text)
    for text in (" \x1cx", "\u3000a", "a"):
        data = text.encode()
        assert not textfiles.blank(data, 0, len(data)), repr(text)


def test_chunks_move_on_through_bytes_that_start_no_character():
    """A run of UTF-8 continuation bytes longer than a chunk is cut anyway (decoding then names
    the bad byte) instead of never leaving its first position."""
    data = b"ab" + b"\x80" * 100
    spans, rest = textfiles.cut_chunks(data, 64, True)
    assert rest == len(data) and spans[-1][1] == len(data)
    assert all(end > start for start, end in spans)


def mixed_corpus(folder):
    """A big .txt, a .txt of long lines of 3-byte characters between blank lines (chunks cut
    inside lines back off to a character), small .txt files, a .jsonl with blank lines and a
    .parquet in row groups of 7 with a null."""
    folder.mkdir()
    (folder / "a_big.txt").write_text(lines_of_text(1500))
    rng = random.Random(2)
    lines = ["\u6f22\u5b57" * rng.randint(1, 300) if rng.random() < 0.7 else "" for _ in range(300)]
    (folder / "a_cjk.txt").write_text("\n".join(lines) + "\n")
    for i in range(12):
        (folder / f"b_small{i:02d}.txt").write_text(f"Small {i}.\n\n{lines_of_text(4 + i)}")
    lines = [json.dumps({"text": lines_of_text(3 + i % 7)}) for i in range(60)]
    (folder / "c.jsonl").write_text("\n".join(lines[:30]) + "\n\n" + "\n".join(lines[30:]) + "\n")
    texts = [lines_of_text(2 + i % 5) for i in range(80)]
    table = pa.table({"text": texts[:40] + [None] + texts[40:]})
    pq.write_table(table, folder / "d.parquet", row_group_size=7)
    return [str(folder / "*.txt"), str(folder / "c.jsonl"), str(folder / "d.parquet")]


def in_process(repo, overlay):
    """Validated params of `repo`'s params.yaml under `overlay`."""
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    return params_mod.validate(params_mod.deep_merge(base, overlay))


@pytest.mark.parametrize(
    "split_by, max_docs", [("auto", None), ("paragraph", 400), ("line", 1111), ("chunk", 250)]
)
def test_referenced_files_give_what_a_copy_holds(tmp_path, monkeypatch, split_by, max_docs):
    """The two stores of the files source: the same documents per split, in the same order,
    also when a cap ends the corpus inside a part, and with parts and pieces far smaller than
    the files (so pieces span parts, and big files many parts)."""
    monkeypatch.setattr(textfiles, "BLOCK", 4096)
    monkeypatch.setattr(textfiles, "BATCH_DOCS", 16)
    monkeypatch.setattr(raw, "PIECE_BYTES", 10_000)
    files = {"paths": mixed_corpus(tmp_path / "src"), "split_by": split_by, "chunk_bytes": 700}
    got = {}
    for store in ("copy", "reference"):
        repo = tmp_path / store
        repo.mkdir()
        overlay = {"source": "files", "max_docs": max_docs, "files": {**files, "store": store}}
        with chdir(repo):
            download.run(in_process(repo, {"download": overlay}))
        got[store] = {s: read_split(repo, s) for s in ("train", "val")}
        manifest = json.loads((repo / "data/raw/manifest.json").read_text())
        assert {s: manifest["splits"][s]["docs"] for s in got[store]} == {
            s: len(got[store][s]) for s in got[store]
        }
    assert sorted((tmp_path / "reference/data/raw").iterdir()) == [
        tmp_path / "reference/data/raw/manifest.json",
        tmp_path / "reference/data/raw/parts.json",
    ]
    assert got["reference"] == got["copy"]
    assert len(got["copy"]["val"]) > 5 and len(got["copy"]["train"]) > 100
    # A split's reader skips the parts that hold none of its documents, unread.
    parts = json.loads((tmp_path / "reference/data/raw/parts.json").read_text())["parts"]
    read = []
    monkeypatch.setattr(raw, "read_part", lambda *a: read.append(a) or textfiles.read_part(*a))
    with chdir(tmp_path / "reference"):
        assert [t for texts, _ in raw.batches("val") for t in texts] == [
            d["text"] for d in got["copy"]["val"]
        ]
    assert len(read) == sum(1 for p in parts if p[5]) < len(parts)
    if max_docs:
        assert len(got["copy"]["train"]) + len(got["copy"]["val"]) == max_docs


def test_tokens_from_referenced_files_match_a_copy_and_a_changed_file_is_named(tmp_path):
    paths = mixed_corpus(tmp_path / "src")
    tokens = {}
    for store in ("copy", "reference"):
        repo = tmp_path / store
        repo.mkdir()
        files = {"paths": paths, "store": store, "chunk_bytes": 700}
        overlay = {
            "download": {"source": "files", "max_docs": None, "val_fraction": 0.1, "files": files},
            # A tenth: rows must count the same, and parts with no sampled row go unread.
            "tokenizer": {"sample_bytes": 20_000},
            "tokenize": {"num_proc": 1},
        }
        params = in_process(repo, overlay)
        with chdir(repo):
            for stage in (download, tokenizer, tokenizing):
                stage.run(params)
        tokens[store] = {
            s: pq.read_table(repo / f"data/tokens/{s}.parquet").to_pydict()
            for s in ("train", "val")
        }
        tokens[store]["bpe"] = (repo / "data/tokenizer/tokenizer.json").read_bytes()
    assert tokens["reference"] == tokens["copy"]
    # One changed byte in a referenced file, and the next reader names the file.
    big = tmp_path / "src/a_big.txt"
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0x01
    big.write_bytes(bytes(data))
    with chdir(tmp_path / "reference"), pytest.raises(UsageError) as err:
        tokenizing.run(params)
    assert str(err.value).startswith(f"{big}: changed since the download stage read it")
    assert "rerun the download stage" in str(err.value)
    assert not list((tmp_path / "reference/data").glob(".tokens.tmp*"))
    big.unlink()
    with chdir(tmp_path / "reference"), pytest.raises(UsageError, match="changed since"):
        list(raw.batches("train"))


class NoBar:
    def update(self, n):
        pass


@pytest.mark.parametrize("split_by", ["chunk", "line", "paragraph"])
def test_a_part_cut_again_on_its_own_gives_its_documents(tmp_path, monkeypatch, split_by):
    """What the referenced store rests on: each part's range, read and cut again with nothing
    after it (read_part), gives the documents the download cut from it, for blocks and chunks
    of many sizes over text of 1- to 4-byte characters, blank lines and line ends of every kind.
    The parts tile the file."""
    rng = random.Random(3)
    alphabet = ["a", "b", " ", "\n", "\n", "\r\n", "\t", "\u00e9", "\u20ac", "\U0001f600", "\u3000"]
    path = tmp_path / "mixed.txt"
    cfg = {"split_by": split_by, "text_field": "text"}
    for trial in range(60):
        data = "".join(rng.choice(alphabet) for _ in range(rng.randint(50, 400))).encode()
        path.write_bytes(data)
        monkeypatch.setattr(textfiles, "BLOCK", rng.choice([16, 33, 64, 100]))
        monkeypatch.setattr(textfiles, "MAX_DOC_BYTES", textfiles.BLOCK)
        cfg["chunk_bytes"] = rng.choice([4, 8, 13, 64])
        try:
            parts = list(
                textfiles.txt_batches(str(path), len(data), split_by, cfg["chunk_bytes"], NoBar())
            )
        except UsageError:  # a line or paragraph longer than the block: refused, as it should be
            continue
        assert [p.start for p in parts[1:]] == [p.end for p in parts[:-1]] and parts[-1].end == len(
            data
        )
        for p in parts:
            again = textfiles.read_part(str(path), ".txt", p.start, p.end, p.digest, cfg)
            assert list(map(bytes, again)) == list(map(bytes, p.docs)), (trial, p.start, p.end)
