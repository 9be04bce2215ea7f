import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from conftest import dsflow, update_params
from dsflow.data.shard import token_dtype
from dsflow.data.shards import ShardReader, load_index
from dsflow.errors import UsageError


def test_shards_hold_every_document_between_bos_and_eos(prepared):
    tok = AutoTokenizer.from_pretrained(prepared / "data/tokenizer")
    for split in ("train", "val"):
        index = load_index(prepared / f"data/shards/{split}")
        assert index["dtype"] == "uint16" and index["vocab_size"] == 384
        assert all(s["tokens"] == 4096 for s in index["shards"][:-1])
        stream = np.concatenate(
            [
                np.fromfile(prepared / f"data/shards/{split}" / s["file"], dtype="<u2")
                for s in index["shards"]
            ]
        )
        assert len(stream) == index["tokens"]
        docs = pq.read_table(prepared / f"data/raw/{split}.parquet").column("text").to_pylist()
        assert index["docs"] == len(docs)
        assert index["bytes"] == sum(len(d.encode()) for d in docs)
        assert int((stream == tok.eos_token_id).sum()) == len(docs)
        assert int((stream == tok.bos_token_id).sum()) == len(docs)
        decoded = tok.decode(stream.tolist(), skip_special_tokens=False)
        assert decoded == "".join(tok.bos_token + d + tok.eos_token for d in docs)


def test_tokenize_and_shard_identical_with_one_or_two_processes(prepared, tmp_path):
    copy = tmp_path / "two"
    shutil.copytree(prepared, copy)
    update_params(copy, {"tokenize": {"num_proc": 2, "batch_size": 37}})
    dsflow("tokenize", cwd=copy)
    dsflow("shard", cwd=copy)
    for split in ("train", "val"):
        a = (prepared / f"data/shards/{split}/index.json").read_bytes()
        assert (copy / f"data/shards/{split}/index.json").read_bytes() == a
    meta = json.loads((copy / "data/tokens/meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] == load_index(prepared / "data/shards/train")["tokens"]


def test_uint32_for_large_vocabularies():
    assert token_dtype(65535).name == "uint16"
    assert token_dtype(65536).name == "uint32"


def test_missing_inputs_name_the_stage_to_run(project):
    proc = dsflow("shard", cwd=project, check=False)
    assert proc.returncode == 2 and "run the tokenize stage first" in proc.stderr


@pytest.fixture
def reader_split(prepared):
    return prepared / "data/shards/train"


def test_reader_is_deterministic_and_covers_each_window_once(reader_split):
    r1, r2 = ShardReader(reader_split, 64, seed=7), ShardReader(reader_split, 64, seed=7)
    n = r1.num_windows
    a, b = r1.samples(0, n), r2.samples(0, n)
    assert a.shape == (n, 65) and np.array_equal(a, b)
    # One epoch visits every window exactly once: the targets cover the stream.
    starts = sorted(ShardReader(reader_split, 64, seed=7)._perm_for(0)[:n].tolist())
    assert starts == list(range(n))
    assert not np.array_equal(ShardReader(reader_split, 64, seed=8).samples(0, 4), a[:4])
    # Epoch 2 is a different order of the same windows.
    assert not np.array_equal(r1.samples(n, 4), a[:4])


def test_reader_data_parallel_split_matches_single_rank(reader_split):
    r = ShardReader(reader_split, 32, seed=1)
    single = np.concatenate([r.micro_batch(5, a, 0, 1, 6, 2) for a in range(2)])
    multi = np.concatenate(
        [r.micro_batch(5, a, rank, 3, 2, 2) for a in range(2) for rank in range(3)]
    )
    assert np.array_equal(single, multi)
    # And resuming at step 5 needs nothing but the step number.
    fresh = ShardReader(reader_split, 32, seed=1)
    assert np.array_equal(fresh.micro_batch(5, 0, 0, 1, 6, 2), single[:6])


def test_corrupt_and_truncated_shards_are_detected(prepared, tmp_path):
    copy = tmp_path / "corrupt"
    shutil.copytree(prepared / "data/shards", copy)
    shard = copy / "train/shard_00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="shard_00000.bin: sha256 mismatch.*rerun the shard stage"):
        ShardReader(copy / "train", 32)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(UsageError, match="shard_00000.bin: .* bytes, expected"):
        ShardReader(copy / "train", 32, verify=False)


def test_sequence_longer_than_the_split_is_a_clear_error(reader_split):
    with pytest.raises(UsageError, match="fewer than one sequence"):
        ShardReader(reader_split, 10_000_000)
