import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import dsflow, update_params
from dsflow.data import grammar
from dsflow.data.download import val_split


def read_split(repo, split):
    return pq.read_table(repo / f"data/raw/{split}.parquet").to_pylist()


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
        assert grammar.score(d["text"]) == pytest.approx(d["logprob"], rel=1e-9)


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
    else:
        path = bad / "x.parquet"
        path.write_text("this is not parquet")
    _files_params(project, [str(path)])
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expect in lines[0]
    if setup not in ("no_match", "empty"):
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
