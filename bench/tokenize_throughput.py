"""Tokenize-stage throughput vs a plain `tokenizers` loop, measured side by side in one run.

    python bench/tokenize_throughput.py [--mb 100] [--workdir DIR]

Generates a builtin-grammar corpus of at least --mb MB, trains a BPE on a slice of it, then times
(a) a plain single-process `Tokenizer.encode_batch_fast` loop over the texts, single-threaded, and
(b) dsflow's tokenize stage code (`tokenize_split`: parquet in, row groups encoded by worker
processes, parquet out) at 1 and 2 processes. Prints MB/s and the ratios b/a. Goals: 1 process >= 0.9x, 2 processes >= 1.8x.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

# Both sides single-threaded per process: the stage's parallelism is its num_proc.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from dsflow.data import grammar, tokenizing  # noqa: E402
from dsflow.data.tokenizer import train_bpe  # noqa: E402


def _docs(args):
    start, n = args
    return [grammar.generate(1234, i)[0] for i in range(start, start + n)]


def make_corpus(path: Path, mb: float) -> tuple[int, int]:
    per_doc = 520  # measured average document size of the builtin grammar
    n_docs = int(mb * 1e6 / per_doc * 1.02) + 1
    chunk = 20000
    texts: list[str] = []
    with mp.Pool(2) as pool:
        for part in pool.imap(
            _docs, [(s, min(chunk, n_docs - s)) for s in range(0, n_docs, chunk)]
        ):
            texts.extend(part)
    while sum(map(len, texts)) < mb * 1e6:
        texts.extend(_docs((len(texts), chunk)))
    pq.write_table(pa.table({"text": texts}), path, row_group_size=8192)
    return len(texts), sum(len(t.encode()) for t in texts)


def train_tokenizer(corpus: Path, out: Path) -> int:
    texts = pq.read_table(corpus).column("text").to_pylist()[:10000]
    tok = train_bpe([texts], len(texts), 4096, 2)
    tok.save_pretrained(out)
    return tok.eos_token_id


def plain_loop(corpus: Path, tokenizer_dir: Path, batch_size: int) -> float:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = pq.read_table(corpus).column("text").to_pylist()
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(texts), batch_size):
        n += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i : i + batch_size]))
    return time.perf_counter() - t0


def _plain_part(args) -> None:
    tokenizer_json, texts, batch_size = args
    tok = Tokenizer.from_file(tokenizer_json)
    for i in range(0, len(texts), batch_size):
        tok.encode_batch_fast(texts[i : i + batch_size])


def plain_two_processes(corpus: Path, tokenizer_dir: Path, batch_size: int) -> float:
    """The machine's own ceiling: the plain loop on two halves in two processes."""
    texts = pq.read_table(corpus).column("text").to_pylist()
    half = len(texts) // 2
    parts = [
        (str(tokenizer_dir / "tokenizer.json"), p, batch_size) for p in (texts[:half], texts[half:])
    ]
    with mp.Pool(2) as pool:
        t0 = time.perf_counter()
        pool.map(_plain_part, parts)
        return time.perf_counter() - t0


def stage(
    corpus: Path, tokenizer_dir: Path, eos: int, num_proc: int, batch_size: int, work: Path
) -> float:
    out = work / f"stage{num_proc}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    tokenizing.tokenize_split(
        corpus,
        out / "train.parquet",
        eos,
        {"num_proc": num_proc, "batch_size": batch_size},
        tokenizer_dir,
    )
    dt = time.perf_counter() - t0
    shutil.rmtree(out)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dsflow-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "train.parquet"
    t0 = time.perf_counter()
    n_docs, n_bytes = make_corpus(corpus, args.mb)
    print(
        f"corpus: {n_docs} docs, {n_bytes / 1e6:.1f} MB (generated in {time.perf_counter() - t0:.1f} s)"
    )
    eos = train_tokenizer(corpus, work / "tokenizer")
    mb = n_bytes / 1e6

    base = plain_loop(corpus, work / "tokenizer", args.batch_size)
    one = stage(corpus, work / "tokenizer", eos, 1, args.batch_size, work)
    two = stage(corpus, work / "tokenizer", eos, 2, args.batch_size, work)
    ceiling = plain_two_processes(corpus, work / "tokenizer", args.batch_size)
    print(f"{'run':<34}{'seconds':>9}{'MB/s':>9}{'vs plain':>10}")
    print(f"{'plain encode_batch loop (1 proc)':<34}{base:9.2f}{mb / base:9.2f}{1.0:10.2f}")
    print(f"{'tokenize stage, num_proc=1':<34}{one:9.2f}{mb / one:9.2f}{base / one:10.2f}")
    print(f"{'tokenize stage, num_proc=2':<34}{two:9.2f}{mb / two:9.2f}{base / two:10.2f}")
    print(
        f"{'plain loop, 2 processes (ceiling)':<34}{ceiling:9.2f}{mb / ceiling:9.2f}{base / ceiling:10.2f}"
    )
    print(
        f"goals: num_proc=1 >= 0.90x ({'met' if base / one >= 0.9 else 'NOT met'}), "
        f"num_proc=2 >= 1.80x ({'met' if base / two >= 1.8 else 'NOT met'}); cores: {os.cpu_count()}"
    )
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
