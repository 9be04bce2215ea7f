"""Each data stage's MB/s and peak RSS on generated .txt corpora, next to a plain-Python read.

    python bench/data_stages.py [--small-mb 8] [--scale 8] [--num-proc 2] [--workdir DIR]

Two layouts: many small files (about 2 KB each) and a few big ones (4 files), each at two sizes
`--scale` times apart. For each corpus the bench first reads every file in plain Python (open,
read in 8 MB blocks, decode UTF-8), then reads them again and compresses every block with zstd
at the level the download writes (the floor of a stage that must store the text compressed),
both in a fresh process as the stages run. Then it runs download (at the default
`download.files.store: reference`: the files are read, cut, checked and hashed, not copied),
tokenizer, tokenize and shard, and the download once more with `store: copy` (the documents
written to zstd Parquet), each in a fresh process that loads params.yaml and calls the stage's
`run`, timed around that call (imports, transformers' included, excluded). CPU seconds count
the stage's process and its workers; MB per CPU second depends far less than MB/s on other
load on the machine. Peak RSS is sampled every 20 ms over the stage's process and its workers
(summed).

The tokenizer trains on a sample of `--small-mb` MB at both sizes (tokenizer.sample_bytes), so
its time and memory should not grow with the corpus. The tokenize stage's rate per process is
compared with a plain single-threaded `Tokenizer.encode_batch_fast` loop over the same train
texts (the first `--small-mb` MB), measured in the same run: in one process, and in
`--num-proc` processes at once (each on its share of the texts), the like-for-like baseline of
the stage at num_proc `--num-proc`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import yaml

from dsflow.data import grammar

ROOT = Path(__file__).resolve().parent.parent
STAGES = {
    "download": "dsflow.data.download",
    "tokenizer": "dsflow.data.tokenizer",
    "tokenize": "dsflow.data.tokenizing",
    "shard": "dsflow.data.shard",
}
RUNNER = """
import importlib, json, os, sys, time
os.environ["RAYON_NUM_THREADS"] = "1"
from dsflow import params
from dsflow.progress import setup_logging
import transformers.models.auto.tokenization_auto  # what a stage imports lazily: not timed
mod = importlib.import_module(sys.argv[1])
p = params.load()
setup_logging(sys.argv[2])
t0, c0 = time.perf_counter(), os.times()
mod.run(p)
c1 = os.times()
cpu = sum(c1[:4]) - sum(c0[:4])  # this process and its joined workers, user + system
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": cpu}))
"""


def make_corpus(folder: Path, mb: float, layout: str) -> int:
    """Distinct lines of grammar prose: `layout` many (about 2 KB files) or few (4 files)."""
    pool = [grammar.generate(1234, i)[0] for i in range(3000)]
    folder.mkdir(parents=True)
    target, written, i = int(mb * 1e6), 0, 0
    n_files = 4 if layout == "few" else max(1, target // 2000)
    per_file = target // n_files
    for f in range(n_files):
        parts, size = [], 0
        while size < per_file:
            text = f"{i}. {pool[(i * 7919) % len(pool)]}\n"
            parts.append(text)
            size += len(text.encode())
            i += 1
        (folder / f"f{f:06d}.txt").write_text("".join(parts))
        written += size
    return written


def plain_read(folder: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) to read and decode every file, 8 MB at a time."""
    t0, c0 = time.perf_counter(), time.process_time()
    for path in sorted(folder.iterdir()):
        with open(path, encoding="utf-8") as f:
            while f.read(8 << 20):
                pass
    return time.perf_counter() - t0, time.process_time() - c0


def plain_read_compress(folder: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) to read and decode every file and zstd-compress what was read in
    8 MB pieces, as the download's Parquet writer compresses (level 1, Arrow's default)."""
    codec = pa.Codec("zstd", 1)
    t0, c0 = time.perf_counter(), time.process_time()
    held, size = [], 0
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                block.decode("utf-8")
                held.append(block)
                size += len(block)
                if size >= 8 << 20:
                    codec.compress(b"".join(held), asbytes=False)
                    held, size = [], 0
    codec.compress(b"".join(held), asbytes=False)
    return time.perf_counter() - t0, time.process_time() - c0


PLAIN = """
import json, sys
sys.path.insert(0, sys.argv[1])
import data_stages
from pathlib import Path
print(json.dumps(getattr(data_stages, sys.argv[2])(Path(sys.argv[3]))))
"""


def fresh(step: str, folder: Path) -> tuple[float, float]:
    """`step` (plain_read or plain_read_compress) in a fresh process, as the stages run. In the
    bench's own process, right after generating the corpus, a plain read ran 2.5 to 3.5 times
    faster: its 8 MB buffers came from heap the generation left behind, with no page faults,
    which a fresh process pays for every buffer."""
    out = subprocess.run(
        [sys.executable, "-c", PLAIN, str(Path(__file__).parent), step, str(folder)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def run_stage(project: Path, stage: str) -> tuple[float, float, float]:
    """(seconds inside run, CPU seconds, peak summed RSS in MB) of one stage in a fresh
    process."""
    env = {**os.environ, "DSFLOW_PROGRESS": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("DSFLOW_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, STAGES[stage], stage],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = [0]
    watch = psutil.Process(proc.pid)

    def sample() -> None:
        while proc.poll() is None:
            try:
                tree = [watch, *watch.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{stage} failed in {project}:\n{err[-3000:]}")
    times = json.loads(out.strip().splitlines()[-1])
    return times["seconds"], times["cpu"], peak[0] / 1e6


def make_project(work: Path, corpus: Path, sample_mb: float, num_proc: int) -> Path:
    project = work / f"project-{corpus.name}"
    project.mkdir()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["download"].update(source="files", max_docs=None)
    params["download"]["files"]["paths"] = [str(corpus / "*.txt")]
    params["tokenizer"]["sample_bytes"] = int(sample_mb * 1e6)
    params["tokenize"]["num_proc"] = num_proc
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


PLAIN_ENCODE = """
import os, sys, time
os.environ["RAYON_NUM_THREADS"] = "1"
from tokenizers import Tokenizer
from dsflow.data import raw
mb, part, parts = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tok = Tokenizer.from_file("data/tokenizer/tokenizer.json")
texts, size = [], 0
for batch, _ in raw.batches("train"):
    texts += batch; size += sum(len(t.encode()) for t in batch)
    if size >= mb * 1e6: break
texts = texts[part::parts]
size = sum(len(t.encode()) for t in texts)
t0 = time.process_time()
for i in range(0, len(texts), 1000):
    [e.ids for e in tok.encode_batch_fast(texts[i:i + 1000], add_special_tokens=False)]
print(size / 1e6, time.process_time() - t0)
"""


def plain_encode(project: Path, mb: float, processes: int) -> float:
    """MB per CPU second per process of a plain single-thread encode_batch_fast loop over the
    first `mb` MB of the train split, cut in `processes` shares encoded at once."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PLAIN_ENCODE, str(mb), str(i), str(processes)],
            cwd=project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    size = cpu = 0.0
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"plain encode failed:\n{err[-3000:]}")
        part_mb, part_cpu = map(float, out.split())
        size, cpu = size + part_mb, cpu + part_cpu
    return size / cpu


def bench_corpus(work: Path, layout: str, mb: float, args) -> dict:
    corpus = work / f"{layout}-{mb:g}MB"
    size = make_corpus(corpus, mb, layout)
    n_files = len(list(corpus.iterdir()))
    read = fresh("plain_read", corpus)
    compressed = fresh("plain_read_compress", corpus)
    project = make_project(work, corpus, args.small_mb, args.num_proc)
    row = {"layout": layout, "files": n_files, "MB": size / 1e6, "read": read}
    row["read_zstd"] = compressed
    for stage in STAGES:
        row[stage] = run_stage(project, stage)
    sample = json.loads((project / "data/raw/manifest.json").read_text())["splits"]["train"]
    row["sample_MB"] = min(sample["bytes"], args.small_mb * 1e6) / 1e6
    row["train_MB"] = sample["bytes"] / 1e6
    if mb == args.small_mb:
        row["encode"] = plain_encode(project, args.small_mb, 1)
        row["encode_np"] = plain_encode(project, args.small_mb, args.num_proc)
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["tokenize"]["num_proc"] = 1
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        row["tokenize1"] = run_stage(project, "tokenize")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["download"]["files"]["store"] = "copy"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    row["download_copy"] = run_stage(project, "download")
    shutil.rmtree(corpus)
    shutil.rmtree(project)
    return row


def print_rows(rows: list[dict], num_proc: int) -> None:
    head = f"{'layout':<6}{'files':>7}{'MB':>7}  {'step':<22}{'s':>8}{'cpu s':>8}{'MB/s':>8}"
    print(f"\n{head}{'MB/cpu-s':>10}{'peak RSS MB':>13}")
    for r in rows:
        steps = [("plain read+decode", (*r["read"], 0), r["MB"])]
        steps.append(("read+decode+zstd", (*r["read_zstd"], 0), r["MB"]))
        for stage in STAGES:
            label = f"tokenize (np={num_proc})" if stage == "tokenize" else stage
            label = "tokenizer (sample)" if stage == "tokenizer" else label
            steps.append((label, r[stage], r["sample_MB"] if stage == "tokenizer" else r["MB"]))
        if "tokenize1" in r:
            steps.append(("tokenize (np=1)", r["tokenize1"], r["MB"]))
        steps.append(("download, store copy", r["download_copy"], r["MB"]))
        print(f"{r['layout']:<6}{r['files']:>7}{r['MB']:>7.1f}")
        for label, (seconds, cpu, rss), mb in steps:
            rss_text = f"{rss:>13.0f}" if rss else ""
            print(
                f"{'':<22}{label:<22}{seconds:>8.2f}{cpu:>8.2f}{mb / seconds:>8.2f}"
                f"{mb / cpu:>10.2f}{rss_text}"
            )
        if "encode" in r:
            print(f"{'':<22}{'plain encode_batch':<22}{'':>24}{r['encode']:>10.2f}")
            label = f"plain encode_batch x{num_proc}"
            print(f"{'':<22}{label:<22}{'':>24}{r['encode_np']:>10.2f}")


def print_ratios(rows: list[dict], num_proc: int) -> None:
    print()
    for r in rows:
        wall = r["read"][0] / r["download"][0]
        cpu = r["read"][1] / r["download"][1]
        copy = r["read"][1] / r["download_copy"][1]
        floor = r["read_zstd"][1] / r["download_copy"][1]
        print(
            f"{r['layout']} {r['MB']:.0f} MB: download / plain read = {wall:.2f} in wall time, "
            f"{cpu:.2f} in CPU time; with store copy {copy:.2f}, and against read + zstd "
            f"{floor:.2f} (CPU time)"
        )
    for r in rows:
        if "tokenize1" in r:
            # Per process: MB per CPU second, so other load on the machine counts little.
            one = r["MB"] / r["tokenize1"][1] / r["encode"]
            many = r["MB"] / r["tokenize"][1]
            print(
                f"{r['layout']}: tokenize per process / plain encode_batch = {one:.2f} at "
                f"num_proc=1, {many / r['encode']:.2f} at num_proc={num_proc}; against "
                f"{num_proc} plain loops at once {many / r['encode_np']:.2f} (MB per CPU second)"
            )
    for stage in STAGES:
        for layout in ("many", "few"):
            peaks = [f"{r[stage][2]:.0f}" for r in rows if r["layout"] == layout]
            sizes = [f"{r['MB']:.0f}" for r in rows if r["layout"] == layout]
            print(
                f"peak RSS {stage:<9} {layout:<4}: {' -> '.join(peaks)} MB at "
                f"{' -> '.join(sizes)} MB"
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--small-mb", type=float, default=8.0)
    ap.add_argument("--scale", type=float, default=8.0)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--layouts", default="many,few")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dsflow-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in args.layouts.split(","):
        for mb in (args.small_mb, args.small_mb * args.scale):
            rows.append(bench_corpus(work, layout, mb, args))
            print(json.dumps(rows[-1]), flush=True)
    print_rows(rows, args.num_proc)
    print_ratios(rows, args.num_proc)
    print(f"cores: {os.cpu_count()}, python {sys.version.split()[0]}")
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
