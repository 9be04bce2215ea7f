"""Checkpoint saves on one GPU: how long training stops for one when the ranks write it
(train.async_checkpoints: false) and when a writer thread does (true), side by side in one run.

Runs the train stage (train_throughput.run_stage: the real code path, seq 1024) once per mode
with a checkpoint every `--every` steps, and reads from the stage's log each save's pause
(`checkpoint stepN: saved in S s`, or `training paused S s` with the writer thread) and how long
the writer took (`written in S s`); from DVCLive, the median time of the steps trained while a
writer ran (the step after a save, and as many more as the writing took) against the others'.
The checkpoint's size is the newest tag's.

Saves further apart than a write takes, or the next one waits for the writer (and its pause
shows that wait): docs/performance.md has how long the medium MoE's checkpoint takes to write.

    python bench/checkpoint_stall.py --configs moe --steps 500 --every 240 --variants zero2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from train_throughput import CONFIGS, VARIANTS, run_stage, tsv

from dsflow.params import deep_merge

PAUSE = re.compile(r"checkpoint step(\d+): (?:saved in|training paused) ([\d.]+) s")
WRITTEN = re.compile(r"checkpoint step(\d+): written in ([\d.]+) s")
WARM = 10  # compilation and allocator warm-up
MODES = {"sync": {"async_checkpoints": False}, "async": {"async_checkpoints": True}}


def measure(config: str, layout: str, mode: str, args, out: Path) -> dict:
    overlay = deep_merge(VARIANTS[layout], MODES[mode]) if layout else MODES[mode]
    # One tag kept: with the one being written, two checkpoints on the GPU host's disk at once.
    overlay = deep_merge(overlay, {"checkpoint_every": args.every, "keep_checkpoints": 1})
    name = f"{config}-{layout or 'default'}-{mode}"
    r = run_stage(name, CONFIGS[config], overlay, args.steps, out, profile=False)
    if r.get("failed"):
        return {"name": name, "failed": True}
    log = Path(r["log"]).read_text()
    # The last save ends the run (which waits for its writer): the periodic ones are timed.
    pauses = {int(s): float(t) for s, t in PAUSE.findall(log) if int(s) != args.steps}
    written = {int(s): float(t) for s, t in WRITTEN.findall(log)}
    step_s = tsv(Path("dvclive/plots/metrics/perf/step_s.tsv"), "step_s")
    busy = writing_steps(step_s, written or {s: 0.0 for s in pauses})
    after = [v for s, v in step_s.items() if s > WARM and s in busy]
    others = [v for s, v in step_s.items() if s > WARM and s not in busy]
    latest = Path("checkpoints/latest").read_text().strip()
    manifest = json.loads((Path("checkpoints") / latest / "dsflow_checkpoint.json").read_text())
    return {
        "name": name,
        "checkpoint_gb": sum(manifest["files"].values()) / 1e9,
        "pauses_s": pauses,
        "written_s": written,
        "step_s_while_writing": statistics.median(after) if after else None,
        "step_s_other": statistics.median(others) if others else None,
    }


def writing_steps(step_s: dict[int, float], written: dict[int, float]) -> set[int]:
    """The steps trained while a save's writer ran: from the step after the save until their
    times add up to its writing time (at least that one step)."""
    busy = set()
    for saved, seconds in written.items():
        step, spent = saved + 1, 0.0
        while step in step_s and (spent < seconds or step == saved + 1):
            busy.add(step)
            spent += step_s[step]
            step += 1
    return busy


def row(r: dict) -> str:
    if r.get("failed"):
        return f"{r['name']:<28} failed (its log is in the output folder)"
    pauses = sorted(r["pauses_s"].values())
    written = sorted(r["written_s"].values())
    after = r["step_s_while_writing"]
    return (
        f"{r['name']:<28} {r['checkpoint_gb']:6.2f} GB  pause median {statistics.median(pauses):6.2f} s "
        f"(min {pauses[0]:.2f}, max {pauses[-1]:.2f}, {len(pauses)} saves)"
        + (f"  written in median {statistics.median(written):.2f} s" if written else "")
        + (f"  step {r['step_s_other'] * 1e3:.0f} ms" if r["step_s_other"] else "")
        + (f", while writing {after * 1e3:.0f} ms" if after else "")
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="moe", help=f"from: {', '.join(CONFIGS)}")
    p.add_argument("--variants", default="zero2", help="layouts from train_throughput's variants")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=240)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for config in args.configs.split(","):
        for layout in args.variants.split(","):
            for mode in MODES:
                results.append(measure(config, layout, mode, args, out))
                print(row(results[-1]), flush=True)
    (out / "checkpoint_stall.json").write_text(json.dumps(results, indent=2))
    print("\n".join(["", "checkpoint saves, pause per save:", *map(row, results)]))
    return 0 if not any(r.get("failed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
