"""Time to quality on one GPU: wall-clock seconds of training until the val bits per byte is
within a margin of the builtin corpus's entropy floor, for the stock path and dsflow's defaults.

Each variant is the train stage (`python -m dsflow train`, as bench/train_throughput.py runs it:
same data, seed, batch, sequence length and variants) with validation every `--eval-every`
steps. A step's time is the wall time since the previous step ended, validations left out
(the train stage's step clock), so the first step's compilation is in it; the sum of the step
times up to a validation is the run's training time at that point (the process start and model
build before the first step are left out, and printed apart as the stage's wall time). Val
bits per byte come from the logged val loss (nats per token over `eval_batches` windows) and
the val split's bytes per token (its shard index); the floor is the builtin corpus's val
entropy (data/raw/manifest.json), a true lower bound for any model of it. A run is stopped at
its first validation within the margin (checkpoints/.stop, as the stage's own signal handler
does it): the later steps would not change the figure, and the schedule, set by `--steps`, is
the same for every variant. A run that reads the train split more than once trains on repeats,
which can hold val above the target: the bench says so first, and a run out of reach reports
its closest validation.

The first variant sets how far the others go: to the target if it got there, else to the
tightest level of MARGINS it reached, so the slower stock path runs only as long as the
comparison needs (`--max-seconds` caps any variant's training time). The figure is given at
every level of MARGINS: a table of training seconds and the first variant's speed-up
(time_to_quality.md) and val bits per byte against training seconds (time_to_quality.png).
time_to_quality.json holds every run's curves, a running one's as of its last validation;
`--reuse` takes the variants that got as far there (same corpus and settings) instead of running
them again, so the variants can run in separate invocations.

    python bench/time_to_quality.py --config dense --variants dsflow,baseline --within 0.10

Several configs (`--config moe,moe-mtp1`) run each variant on each, named `config/variant`; that
is how a model change (one multi-token prediction depth) is measured against the model without
it. `--evaluate` runs the evaluate stage on each run's model where it stopped (the stopped
checkpoint exported first): its val loss and, for a model with MTP layers, each depth's top-1
accuracy and the acceptance rate of greedy self-speculative decoding join the results and a
second table, beside each run's median step time.

Needs data/raw, data/shards and data/tokenizer of the builtin corpus in the working directory.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput as tt  # noqa: E402

from dsflow.paths import MANIFEST, shard_index  # noqa: E402

# The levels the figure is given at (margins over the floor), --within's added: a run that
# stops short of the target still compares at the looser ones.
MARGINS = (0.5, 0.3, 0.2, 0.15, 0.1)


def entropy_floor() -> float:
    """Bits per byte of the val split's generating process (the builtin corpus only)."""
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    floor = manifest.get("splits", {}).get("val", {}).get("entropy_bits_per_byte")
    if floor is None:
        raise SystemExit(f"{MANIFEST}: no val entropy; this bench needs the builtin corpus")
    return float(floor)


def bytes_per_token() -> float:
    index = json.loads(shard_index("val").read_text())
    return index["bytes"] / index["tokens"]


def passes(steps: int) -> float:
    """How many times a run of `steps` steps reads the train split. Past one pass the model
    sees documents again, which can leave val above a target that fresh documents would
    reach: the figure is cleanest on a corpus that outlasts the run."""
    tokens = json.loads(shard_index("train").read_text())["tokens"]
    return steps * tt.SEQ * tt.MICRO / tokens


def best(run: dict, per_token: float) -> tuple[int, float] | None:
    """(step, val bits per byte) of the run's lowest validation, or None without one."""
    if not run.get("val_loss"):
        return None
    step = min(run["val_loss"], key=run["val_loss"].get)
    return step, bits_per_byte(run["val_loss"][step], per_token)


def bits_per_byte(nats_per_token: float, per_token: float) -> float:
    return nats_per_token / math.log(2) / per_token


def seconds_to(run: dict, step: int) -> float:
    """Training seconds up to and including `step`."""
    return sum(s for k, s in run["step_s"].items() if k <= step)


def reached(run: dict, target_bpb: float, per_token: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first validation at or under `target_bpb`, or None."""
    for step in sorted(run["val_loss"]):
        if bits_per_byte(run["val_loss"][step], per_token) <= target_bpb:
            return step, seconds_to(run, step)
    return None


def milestones(run: dict, floor: float, per_token: float, margins) -> dict:
    """{margin: (step, training seconds)} of the first validation within each margin over the
    floor that the run reached: the figure at every level, also for a run that stops short of
    the tightest."""
    hits = {m: reached(run, (1 + m) * floor, per_token) for m in margins}
    return {m: hit for m, hit in hits.items() if hit}


def run_variant(
    name: str, args: argparse.Namespace, out: Path, target: float, per: float, progress=None
) -> dict:
    """The stage as train_throughput runs it, validating every --eval-every steps, stopped at
    the first validation within the target (the later steps would not change the figure) or
    once its training time passes --max-seconds. `progress(curves)` is called at each new
    validation, so a bench stopped from outside keeps the curves so far."""
    config, vname = split_name(name, args)
    overlay = tt.deep_merge(
        tt.variant(vname), {"eval_every": args.eval_every, "eval_batches": args.eval_batches}
    )
    live = Path("dvclive/plots/metrics")

    def curves() -> dict:
        return {
            "val_loss": tt.tsv(live / "val/loss.tsv", "loss"),
            "step_s": tt.tsv(live / "perf/step_s.tsv", "step_s"),
        }

    seen = [0]

    def there() -> bool:
        run = curves()
        if progress and len(run["val_loss"]) > seen[0]:
            seen[0] = len(run["val_loss"])
            progress(run)
        over_time = args.max_seconds and sum(run["step_s"].values()) > args.max_seconds
        return bool(over_time) or reached(run, target, per) is not None

    stage_name = f"ttq-{name.replace('/', '-')}"
    r = tt.run_stage(stage_name, tt.CONFIGS[config], overlay, args.steps, out, False, until=there)
    return r if r.get("failed") else {**r, **curves()}


def split_name(name: str, args: argparse.Namespace) -> tuple[str, str]:
    """(config, variant) of a run's name: `config/variant`, or a variant of the one config."""
    if "/" in name:
        config, vname = name.split("/", 1)
        return config, vname
    return args.config, name


def run_names(args: argparse.Namespace) -> list[str]:
    """The runs, in order: each variant on each config; `config/variant` when there are
    several configs, so a run's name says which model it trained."""
    configs = args.config.split(",")
    unknown = [c for c in configs if c not in tt.CONFIGS]
    if unknown:
        raise SystemExit(f"--config: unknown {', '.join(unknown)}; from: {', '.join(tt.CONFIGS)}")
    variants = args.variants.split(",")
    if len(configs) == 1:
        return variants
    return [f"{c}/{v}" for c in configs for v in variants]


def evaluated(r: dict) -> dict:
    """The evaluate stage on the model a run left: its stopped checkpoint exported to
    models/final first (the train stage exports only at its last step), with the run's own
    params overlay. metrics/eval.json's numbers, or {"eval_failed": why}."""
    overlay = Path(r["log"]).parent / "overlay.yaml"
    stage = [sys.executable, "-m", "dsflow", "--profile", str(overlay)]
    steps = {"evaluate": [*stage, "evaluate"]}
    if r.get("stopped"):
        shutil.rmtree("models/final", ignore_errors=True)
        export = [*stage, "export", "--dtype", "bf16", "--out", "models/final"]
        steps = {"export": export, **steps}
    for what, cmd in steps.items():
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return {"eval_failed": f"{what} failed: {' | '.join(tail)}"}
    return {"eval": json.loads(Path("metrics/eval.json").read_text())}


def step_median(run: dict, skip: int = 10) -> float | None:
    """The median step time past the first `skip` steps (compilation, allocator warm-up)."""
    steady = [s for k, s in run.get("step_s", {}).items() if k > skip]
    return statistics.median(steady) if steady else None


def eval_table(runs: dict) -> str:
    """Markdown: each run's median step time (and its cost over the first run's), and what the
    evaluate stage measured on its model: val loss, and per MTP depth the head's top-1
    accuracy and the speculative acceptance rate, with the speed-up they imply."""
    names = [n for n, r in runs.items() if not r.get("failed")]
    first = step_median(runs[names[0]]) if names else None
    head = "| run | step ms | vs first | val loss | val bits/byte | MTP top-1 (t+2) | accepted "
    head += "/ draft | speed-up |"
    rows = [head, "|" + "---|" * 8]
    for name in names:
        r, e = runs[name], runs[name].get("eval", {})
        step = step_median(r)
        cells = [
            name,
            f"{1e3 * step:.1f}" if step else "n/a",
            f"{step / first - 1:+.1%}" if step and first else "",
            f"{e['val_loss']:.4f}" if "val_loss" in e else r.get("eval_failed", "n/a"),
            f"{e['bits_per_byte']:.4f}" if "bits_per_byte" in e else "",
            f"{e['mtp_top1_accuracy_1']:.3f}" if "mtp_top1_accuracy_1" in e else "",
            f"{e['speculative_acceptance_1']:.3f}" if "speculative_acceptance_1" in e else "",
            f"{e['speculative_speedup']:.2f}x" if "speculative_speedup" in e else "",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def stop_level(first: dict, target: float, floor: float, per_token: float, margins) -> float:
    """Where the later variants stop: the target if the first variant reached it, else the
    tightest margin it did reach. A later variant then runs only as long as the comparison
    needs, not to the end of a schedule the first one already showed falls short."""
    hits = milestones(first, floor, per_token, margins) if not first.get("failed") else {}
    if not hits or reached(first, target, per_token):
        return target
    return (1 + min(hits)) * floor


def table(runs: dict, floor: float, per_token: float, margins) -> str:
    """Markdown: for each margin over the floor, each variant's training seconds to its first
    validation within it, and the first variant's speed-up over every later one."""
    names = [n for n, r in runs.items() if not r.get("failed")]
    head = ["within", "val bits/byte", *(f"{n} s (step)" for n in names)]
    head += [f"{names[0]} vs {n}" for n in names[1:]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in sorted(margins, reverse=True):
        hits = [milestones(runs[n], floor, per_token, [m]).get(m) for n in names]
        cells = [f"{m:.0%}", f"{(1 + m) * floor:.4f}"]
        cells += [f"{h[1]:.1f} ({h[0]})" if h else "not reached" for h in hits]
        cells += [f"{h[1] / hits[0][1]:.2f}x" if h and hits[0] else "" for h in hits[1:]]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(runs: dict, floor: float, target: float, per_token: float, path: Path) -> None:
    """Val bits per byte against training seconds, one line per variant, with the floor and
    the target: the time-to-quality figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for name, run in runs.items():
        if run.get("failed") or not run.get("val_loss"):
            continue
        steps = sorted(run["val_loss"])
        seconds = [seconds_to(run, step) for step in steps]
        bpb = [bits_per_byte(run["val_loss"][step], per_token) for step in steps]
        ax.plot(seconds, bpb, marker=".", label=name)
    ax.axhline(floor, color="black", linewidth=0.8, label=f"entropy floor {floor:.3f}")
    ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target:.3f}")
    ax.set(xlabel="training seconds", ylabel="val bits per byte", title="Time to quality")
    ax.set_ylim(floor * 0.97, max(floor * 1.6, target * 1.1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config",
        default="dense",
        help="a config, or several (comma-separated): each variant "
        f"runs on each, named config/variant; from: {', '.join(tt.CONFIGS)}",
    )
    ap.add_argument("--variants", default="dsflow,baseline", help="the first sets the levels")
    ap.add_argument("--within", type=float, default=0.10, help="margin over the floor")
    ap.add_argument("--steps", type=int, default=1500, help="the longest a variant trains")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument(
        "--max-seconds", type=float, default=0, help="stop a variant past this training time"
    )
    ap.add_argument("--out", default="bench-out")
    ap.add_argument(
        "--evaluate",
        action="store_true",
        help="run the evaluate stage on each run's model (val loss; MTP accuracy and "
        "speculative acceptance where the model has MTP layers)",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="take a variant from --out's time_to_quality.json where it got as far as this "
        "run would go, instead of running it (list every variant: the file is rewritten)",
    )
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    tt.stop_the_stage_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    floor, per_token = entropy_floor(), bytes_per_token()
    target = (1 + args.within) * floor
    margins = sorted({*MARGINS, args.within}, reverse=True)
    print(f"target: val {target:.4f} bits/byte ({floor:.4f} floor + {args.within:.0%})")
    reads = passes(args.steps)
    if reads > 1:
        print(
            f"warning: {args.steps} steps read the train split {reads:.1f} times; the model "
            "trains on repeats, which can hold val above the target: generate more documents "
            "(download.max_docs) or lower --steps"
        )
    results = {
        "floor_bpb": floor, "target_bpb": target, "bytes_per_token": per_token,
        "train_passes": reads, "settings": settings(args), "runs": {},
    }  # fmt: skip
    done_before = finished_runs(out / "time_to_quality.json", results) if args.reuse else {}
    level = target
    for i, name in enumerate(run_names(args)):
        if usable(done_before.get(name), level, per_token, args.steps):
            print(f"{name}: taken from {out / 'time_to_quality.json'}")
            r = done_before[name]
        else:
            until = "" if level == target else f" (until val {level:.4f}, as the first got)"
            print(f"running {name} ...{until}", flush=True)
            save = functools.partial(keep_partial, results, name, out / "time_to_quality.json")
            r = run_variant(name, args, out, level, per_token, progress=save)
            if args.evaluate and not r.get("failed"):
                r = {**r, **evaluated(r)}
        hit = None if r.get("failed") else reached(r, target, per_token)
        done = {} if r.get("failed") else milestones(r, floor, per_token, margins)
        results["runs"][name] = {**r, "reached": hit, "milestones": done}
        (out / "time_to_quality.json").write_text(json.dumps(results, indent=2))
        report(name, r, hit, args, floor, per_token)
        if i == 0:
            level = stop_level(r, target, floor, per_token, margins)
    runs = results["runs"]
    summary = table(runs, floor, per_token, margins)
    if args.evaluate:
        summary += "\n\n" + eval_table(runs)
    (out / "time_to_quality.md").write_text(summary + "\n")
    plot(runs, floor, target, per_token, out / "time_to_quality.png")
    print(summary)
    return 0


def settings(args: argparse.Namespace) -> dict:
    """What a run's curves depend on besides the corpus: a run is reused only under the same."""
    return {k: getattr(args, k) for k in ("config", "steps", "eval_every", "eval_batches")}


def finished_runs(path: Path, now: dict) -> dict:
    """The runs in an earlier time_to_quality.json that ended (not failed, not cut off while
    running) under the same corpus and settings; a run made under others is not comparable, and
    the bench says so and runs it again."""
    if not path.exists():
        return {}
    before = json.loads(path.read_text())
    same = ("floor_bpb", "bytes_per_token", "settings")
    if any(before.get(k) != now[k] for k in same):
        print(f"not reusing {path}: made on another corpus or with other settings")
        return {}
    runs = {}
    for name, run in before["runs"].items():
        if run.get("running") or run.get("failed"):
            continue
        run = {k: v for k, v in run.items() if k not in ("reached", "milestones")}
        for curve in ("val_loss", "step_s"):  # JSON made their step keys strings
            run[curve] = {int(step): x for step, x in run[curve].items()}
        runs[name] = run
    return runs


def usable(run: dict | None, level: float, per_token: float, steps: int) -> bool:
    """Whether an earlier run answers what this one would: it got to `level`, or it trained
    every step of the schedule. A run stopped short (--max-seconds) is run again."""
    if run is None:
        return False
    return reached(run, level, per_token) is not None or max(run["step_s"], default=0) >= steps


def keep_partial(results: dict, name: str, path: Path, run: dict) -> None:
    """Write a running variant's curves so far into the results (marked "running")."""
    results["runs"][name] = {"name": name, "running": True, **run}
    path.write_text(json.dumps(results, indent=2))


def report(name: str, r: dict, hit, args: argparse.Namespace, floor: float, per: float) -> None:
    """One line on a finished variant: where it reached the target, or its closest validation."""
    if hit:
        print(f"  {name}: step {hit[0]}, {hit[1]:.1f} s of training, stage {r['wall_s']:.0f} s")
    elif low := best(r, per):
        last = max(r["step_s"], default=0)
        print(
            f"  {name}: not within {args.within:.0%} of the floor by step {last}; best val "
            f"{low[1]:.4f} bits/byte ({low[1] / floor - 1:.1%} over) at step {low[0]}"
        )
    else:
        print(f"  {name}: {'the stage failed' if r.get('failed') else 'no validation logged'}")


if __name__ == "__main__":
    sys.exit(main())
