import json
import re
import shutil
from contextlib import chdir

import pyarrow.parquet as pq
from transformers import AutoTokenizer

from conftest import dsflow, update_params
from dsflow.data.tokenizer import Sample


def test_tokenizer_loads_with_autotokenizer_and_round_trips(prepared):
    tok = AutoTokenizer.from_pretrained(prepared / "data/tokenizer")
    assert len(tok) == 384
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eos|>" and tok.pad_token == "<|pad|>"
    text = 'Mia found a "shiny" key.\n\nShe smiled. Caf\u00e9 \u2603!'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: any UTF-8 text round-trips
    assert len(ids) < len(text.encode())  # merges were learned
    # By default it starts a text with BOS, as DeepSeek's tokenizers do (training did too).
    assert tok(text)["input_ids"] == [tok.bos_token_id] + ids


def test_tokenizer_is_deterministic(prepared, tmp_path):
    copy = tmp_path / "again"
    shutil.copytree(prepared, copy)
    dsflow("tokenizer", cwd=copy)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (copy / "data/tokenizer" / name).read_bytes() == (
            prepared / "data/tokenizer" / name
        ).read_bytes()


def test_vocab_too_small_for_specials(prepared, tmp_path):
    copy = tmp_path / "small"
    shutil.copytree(prepared, copy)
    update_params(copy, {"tokenizer": {"vocab_size": 200}})
    proc = dsflow("tokenizer", cwd=copy, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "tokenizer.vocab_size" in line and "259" in line and "\n" not in line
    # The previous tokenizer is untouched: failed stages never replace good outputs.
    assert json.loads((copy / "data/tokenizer/tokenizer.json").read_text())


def test_pretrained_tokenizer_is_copied(prepared, tmp_path):
    copy = tmp_path / "pre"
    shutil.copytree(prepared, copy)
    shutil.copytree(prepared / "data/tokenizer", tmp_path / "mytok")
    update_params(copy, {"tokenizer": {"pretrained": str(tmp_path / "mytok")}})
    dsflow("tokenizer", cwd=copy)
    assert len(AutoTokenizer.from_pretrained(copy / "data/tokenizer")) == 384
    update_params(copy, {"tokenizer": {"pretrained": str(tmp_path / "missing")}})
    proc = dsflow("tokenizer", cwd=copy, check=False, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "tokenizer.pretrained" in proc.stderr


def sampled(fraction, seed, batch_size=4096):
    sample = Sample(fraction, seed, batch_size)
    return [t for batch in sample for t in batch], sample


def test_the_sample_is_seeded_and_independent_of_batching(prepared):
    every = pq.read_table(prepared / "data/raw/train.parquet").column("text").to_pylist()
    with chdir(prepared):
        a, sample = sampled(0.3, seed=1)
        assert sampled(0.3, seed=1, batch_size=37)[0] == a
        assert sampled(0.3, seed=2)[0] != a
        assert sampled(1.0, seed=1)[0] == every
    assert 0.2 < len(a) / len(every) < 0.4
    assert set(a) <= set(every) and sample.docs == len(a)
    assert sample.bytes == sum(len(t.encode()) for t in a)


def test_sample_bytes_bounds_what_the_bpe_reads(prepared, tmp_path):
    copy = tmp_path / "sampled"
    shutil.copytree(prepared, copy)
    update_params(copy, {"tokenizer": {"sample_bytes": 20000}})
    dsflow("tokenizer", cwd=copy)
    log = (copy / "logs/tokenizer.log").read_text()
    trained = re.search(r"trained on (\d+) documents, (\d+) bytes", log)
    assert "% sample of" in log
    assert 10000 < int(trained.group(2)) < 30000
    assert len(AutoTokenizer.from_pretrained(copy / "data/tokenizer")) == 384
