"""Tokenize-stage throughput vs a plain `tokenizers` loop, measured side by side in one run.

    python bench/tokenize_throughput.py [--mb 100] [--num-procs 1,2] [--repeat 2] [--workdir DIR]

Generates a builtin-grammar corpus of at least --mb MB, trains a BPE on a slice of it, then, per
repeat and per k in --num-procs, measures:

- plain k: a plain `Tokenizer.encode_batch_fast` loop (ids taken out as lists, as any caller
  must) over the texts cut in k parts, in k processes at once, single-threaded; only the loops
  are timed, so this is the library's own rate per process when k processes share the machine;
- stage k: dsflow's tokenize stage code (`tokenize_split` over data/raw/train.parquet laid out
  in the work folder as the download writes it: row groups encoded by k worker processes,
  parquet out), whole: the workers' start, the reading and the writing count;
- start k: k workers started and stopped with nothing to do (spawn, imports, tokenizer load).

CPU seconds count this process and its joined children, so other load on the machine counts
little; wall seconds do not. Ratios are per process: MB per CPU second of the stage over that of
plain 1 (the library alone) and of plain k (the same number of processes at once).
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

from dsflow.atomic import write_json  # noqa: E402
from dsflow.data import grammar, raw, tokenizing  # noqa: E402
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
    n_docs, n_bytes = len(texts), sum(len(t.encode()) for t in texts)
    split = {"docs": n_docs, "bytes": n_bytes}
    write_json(path.parent / "manifest.json", {"source": "builtin", "splits": {"train": split}})
    return n_docs, n_bytes


def train_tokenizer(corpus: Path, out: Path) -> int:
    texts = pq.read_table(corpus).column("text").to_pylist()[:10000]
    tok = train_bpe([texts], len(texts), 4096, 2)
    tok.save_pretrained(out)
    return tok.eos_token_id


def cpu_seconds() -> float:
    """User + system seconds of this process and its joined children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _plain_part(args) -> float:
    tokenizer_json, texts, batch_size = args
    tok = Tokenizer.from_file(tokenizer_json)
    t0 = time.process_time()
    for i in range(0, len(texts), batch_size):
        [e.ids for e in tok.encode_batch_fast(texts[i : i + batch_size])]
    return time.process_time() - t0


def plain(corpus: Path, tokenizer_dir: Path, batch_size: int, k: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the loops) of the plain loop over the texts cut in k parts,
    in k processes at once (k = 1: in this process)."""
    texts = pq.read_table(corpus).column("text").to_pylist()
    step = -(-len(texts) // k)
    parts = [
        (str(tokenizer_dir / "tokenizer.json"), texts[i : i + step], batch_size)
        for i in range(0, len(texts), step)
    ]
    if k == 1:
        t0 = time.perf_counter()
        cpu = _plain_part(parts[0])
        return time.perf_counter() - t0, cpu
    with mp.get_context("spawn").Pool(k) as pool:
        t0 = time.perf_counter()
        cpu = sum(pool.map(_plain_part, parts, chunksize=1))
        return time.perf_counter() - t0, cpu


def worker_start(tokenizer_dir: Path, eos: int, k: int) -> float:
    """CPU seconds to start k tokenize workers and stop them: spawn, imports, tokenizer load."""
    c0 = cpu_seconds()
    args = (str(tokenizer_dir / "tokenizer.json"), eos)
    pool = mp.get_context("spawn").Pool(k, tokenizing.init_worker, args)
    pool.close()  # each worker finishes its start, then exits: join waits for all of it
    pool.join()
    return cpu_seconds() - c0


def stage(eos: int, num_proc: int, batch_size: int, work: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its workers) of the stage's code, on
    data/raw and data/tokenizer of the work folder (the current directory)."""
    out = work / f"stage{num_proc}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    cfg = {"num_proc": num_proc, "batch_size": batch_size}
    meta = raw.manifest()
    pieces = raw.pieces(meta, "train")
    tokenizing.tokenize_split(meta, "train", pieces, out / "train.parquet", eos, cfg)
    times = time.perf_counter() - t0, cpu_seconds() - c0
    shutil.rmtree(out)
    return times


def measure(corpus: Path, tokenizer_dir: Path, eos: int, args, work: Path) -> dict:
    rows = {}
    for k in args.num_procs:
        rows[f"plain {k}"] = plain(corpus, tokenizer_dir, args.batch_size, k)
        rows[f"stage {k}"] = stage(eos, k, args.batch_size, work)
        # num_proc 1 encodes in the stage's own process: no worker to start.
        rows[f"start {k}"] = (0.0, worker_start(tokenizer_dir, eos, k) if k > 1 else 0.0)
    return rows


def report(rows: dict, mb: float, num_procs: list[int]) -> None:
    print(f"{'run':<10}{'wall s':>9}{'cpu s':>9}{'MB/s':>9}{'MB/cpu-s':>10}")
    for name, (wall, cpu) in rows.items():
        if name.startswith("start"):
            if cpu:
                print(f"{name:<10}{'':>9}{cpu:9.2f}")
            continue
        print(f"{name:<10}{wall:9.2f}{cpu:9.2f}{mb / wall:9.2f}{mb / cpu:10.2f}")
    base = rows["plain 1"][1]
    for k in num_procs:
        plain_k, stage_k, start_k = (rows[f"{r} {k}"][1] for r in ("plain", "stage", "start"))
        print(
            f"num_proc={k}: stage per process / plain 1 = {base / stage_k:.2f}, / plain {k} = "
            f"{plain_k / stage_k:.2f}; without the workers' start: {plain_k / (stage_k - start_k):.2f}"
            f" (start {start_k:.2f} cpu-s of {stage_k:.2f})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--num-procs", default="1,2")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    args.num_procs = [int(k) for k in args.num_procs.split(",")]
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="dsflow-bench-"))).resolve()
    (work / "data/raw").mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # the stage reads data/raw and data/tokenizer from where it runs
    corpus = work / "data/raw/train.parquet"
    t0 = time.perf_counter()
    n_docs, n_bytes = make_corpus(corpus, args.mb)
    print(
        f"corpus: {n_docs} docs, {n_bytes / 1e6:.1f} MB (generated in {time.perf_counter() - t0:.1f} s)"
    )
    eos = train_tokenizer(corpus, work / "data/tokenizer")
    for r in range(args.repeat):
        print(f"\nrepeat {r + 1}, load average {os.getloadavg()[0]:.1f}")
        report(
            measure(corpus, work / "data/tokenizer", eos, args, work), n_bytes / 1e6, args.num_procs
        )
    print(f"cores: {os.cpu_count()}")
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
