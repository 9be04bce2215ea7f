"""Training throughput on one GPU: stock HF + DeepSpeed against dsflow's fast paths, side by side.

In one run on one GPU: first the bf16 matmul peak (what "of achievable" is against), then, for
each model config, the train stage (`python -m dsflow train`, so the real code path: DeepSpeed,
bf16, the same data, seed, batch and sequence length) twice:

- baseline: `train.perf` all off = stock HF `DeepseekV3ForCausalLM` (SDPA attention, eager),
  full logits + cross-entropy, batches read inline, DeepSpeed's own gradient checks, ZeRO-2,
  and HF's fastest experts kernel here, as a user would pick it (`train.perf.experts: hf-best`:
  `sonicmoe` on compute capability 9.x where the sonic-moe package loads, else `grouped_mm`;
  the table's `experts` column says which, results.json why);
- baseline-liger: the baseline with Liger Kernel applied as HF's Trainer applies it
  (`train.perf.liger`: its RMSNorm, SwiGLU MLPs, fused MoE experts, fused lm_head +
  cross-entropy); where liger-kernel is missing or does not support the model, the bench says
  why in one line and leaves it out;
- dsflow: params.yaml's defaults (`train.perf`: compiled layers, padded flash attention, fused
  lm_head + cross-entropy, prefetched pinned batches, fused gradient checks, for MoE models the
  sorted experts and the router hooks traced into the compiled layers; dsflow's fused
  optimizer, so `zero_stage: auto` is ZeRO-0 on one GPU; each step's numbers read one step
  late; `no-overlap` changes nothing there: use `zero2+no-overlap`);
- optionally other variants (`--variants`): one lever off at a time (`no-compile`, `no-flash`,
  `no-fused-ce`, `no-prefetch`, `no-fused-checks`) to see what each gives, an opt-in one on
  (`cudagraphs`; `autotune`: compile_mode max-autotune-no-cudagraphs), a ZeRO stage (`zero2`;
  `zero1`, `zero0`: one GPU has nothing to partition; `zero1` without DeepSpeed's
  per-parameter gradient hooks, as train.zero's auto has it on one rank, `zero1-hooks` with
  them) or DeepSpeed's overlap_comm off (`no-overlap`), DeepSpeed's ZeRO-1/2 bf16 step with its
  host syncs (`no-device-step`: train.perf.device_step false), DeepSpeed's own gradient copies
  (`ds-hooks`: train.perf.lean_grad_hooks false); the MoE levers off: `hf-experts` (train.perf.experts: hf), `eager-hooks`
  (train.perf.compile_router_hooks: false); `sorted-experts`, `compiled-hooks` and
  `sorted-compiled-hooks` turn them on whatever `auto` would pick;
  `fused-optimizer` (train.perf.optimizer: fused, at ZeRO-0: the default on one GPU),
  `deepspeed-optimizer` (DeepSpeed's bf16 optimizer: then `zero_stage: auto` is ZeRO-1 on one
  GPU), `sync-metrics` (train.perf.async_metrics: false: each step's numbers read at once).

- noise, noise-ce: the baseline with one exact change of kernel each (flash attention on
  zero-padded V; the chunked lm_head + cross-entropy), which measure bf16 noise: how far curves
  that differ from the baseline's only by rounding drift from it and from each other. A
  comparison asked for without any noise run of its reference gets one added (`noise`, or
  `no-flash` for dsflow; once, in the first round), unless `--add-runs` brings one.

Configs: `dense` and `moe` (the medium preset), `v2lite4` and `moonlight4` (DeepSeek-V2-Lite's
and Moonlight-16B-A3B's published widths, 4 layers: the two families at real widths);
`dense-mtp1` and `moe-mtp1` add one multi-token prediction depth (model.mtp_depth: 1). The
variants `lora` and `full-ft` continue the config's random init saved as a checkpoint
(train.finetune lora or full, every other setting at its default).

It prints tokens/s, MFU (useful FLOPs only: activated params + attention, no recompute) against
the GPU's datasheet dense bf16 peak (dsflow.model.flops, as the train stage reports it) and,
beside it, against the measured matmul peak ("of achievable"), step time, peak memory,
data-wait share, the planner's predicted reserved peak against torch.cuda.max_memory_reserved
(the train stage's metrics/train.json holds both), and the ratio dsflow/baseline, and checks
that the first 50 losses of the two agree within bf16 noise: dsflow's difference from the
baseline may be at most twice the largest difference between two of the reference runs
(baseline and noise runs; plus a small floor).
`--reference dsflow` measures the others against dsflow's defaults instead (its noise run:
`no-flash`), and `--compare-steps` sets how many first losses are compared: FP8 against bf16,

    python bench/train_throughput.py --configs dense,dense2048,dense4096 --steps 200 \
        --variants dsflow,no-flash,fp8 --reference dsflow --compare-steps 200

Needs data/shards and data/tokenizer (the data stages) in the working directory; writes $OUT
(or --out).

    python bench/train_throughput.py --configs dense,moe --variants baseline,noise,noise-ce,dsflow
    python bench/train_throughput.py --configs moe --variants baseline,baseline-liger,noise,dsflow
    python bench/train_throughput.py --configs dense --variants dsflow,no-compile --profile dsflow
    python bench/train_throughput.py --configs dense,moe --variants dsflow,zero2,cudagraphs
    python bench/train_throughput.py --configs moe --variants baseline,zero2+sorted-experts
    python bench/train_throughput.py --configs v2lite4,moonlight4 --variants dsflow,lora,full-ft

Seq 1024 x micro 16 unless `--seq` / `--micro` say otherwise (more tokens per expert GEMM):

    python bench/train_throughput.py --configs moe --variants dsflow --micro 32

Variants stack with +: `a+b` is b's overlay on a's. `--repeat N` runs the variant list N times
in turn (baseline, dsflow, baseline, dsflow, ...): step times are medians over the rounds and the
speedup is the median of the rounds' ratios, printed with their range, since the same baseline's
step time moves between runs (docs/performance.md). Every listed variant reruns each round, the
noise runs too: list only the timed ones with --repeat (the noise run the bench adds runs once).

    python bench/train_throughput.py --configs dense,moe --variants baseline,dsflow --repeat 3
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from dsflow.errors import UsageError
from dsflow.model import flops, hfkernels
from dsflow.model.fastpaths import DEFAULT_CE_CHUNK, PLAIN
from dsflow.model.presets import PRESETS, model_config, preset_model_type
from dsflow.params import deep_merge
from dsflow.paths import TOKENIZER
from dsflow.train.stage import vocab_size

SEQ, MICRO = 1024, 16
CONFIGS = {
    # The `medium` preset (the 3 x 24 GB one), all dense and as published (MoE).
    "dense": {"preset": "medium", "overrides": {"first_k_dense_replace": 16}},
    "moe": {"preset": "medium", "overrides": {}},
    # DeepSeek-V3's multi-token prediction, one depth (model.mtp_depth), on each of the two.
    # HF decides a layer's kind from its index: the MTP block is layer 16, dense only where
    # first_k_dense_replace passes it (the 16 main layers are the same as `dense`'s).
    "dense-mtp1": {"preset": "medium", "overrides": {"first_k_dense_replace": 17}, "mtp_depth": 1},
    "moe-mtp1": {"preset": "medium", "overrides": {}, "mtp_depth": 1},
    # Published widths cut to 4 layers: DeepSeek-V2-Lite (the V2 family: softmax routing and
    # its balance loss) and Moonlight-16B-A3B (the V3 family at the same widths).
    "v2lite4": {"preset": "deepseek-v2-lite", "overrides": {"num_hidden_layers": 4}},
    "moonlight4": {"preset": "moonlight-16b-a3b", "overrides": {"num_hidden_layers": 4}},
    # All-dense models at hidden 2048 and 4096 (with `dense` at 1024: train.perf.fp8 by width).
    "dense2048": {
        "preset": "medium",
        "overrides": {
            **{"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8},
            **{"first_k_dense_replace": 8, "q_lora_rank": 768, "kv_lora_rank": 512},
        },
    },
    "dense4096": {
        "preset": "medium",
        "overrides": {
            **{"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 4},
            **{"first_k_dense_replace": 4, "num_attention_heads": 32},
            **{"q_lora_rank": 1536, "kv_lora_rank": 512},
        },
    },
}
# Variants that continue a checkpoint: the bench saves the config's random init once as one
# (bf16 safetensors) and sets model.pretrained to it.
FROM_CHECKPOINT = {"lora": {"finetune": "lora"}, "full-ft": {"finetune": "full"}}
# Variants: overlays on the train section. baseline = every fast path off.
VARIANTS = {
    "baseline": {
        "zero_stage": 2,
        "perf": {**PLAIN, "experts": "hf-best", "optimizer": "deepspeed", "async_metrics": False},
    },
    "dsflow": {},
    # one lever off (or an opt-in one on) at a time, the rest at their defaults (--variants)
    "no-compile": {"perf": {"compile": False}},
    "no-flash": {"perf": {"attention": "sdpa"}},
    "no-fused-ce": {"perf": {"ce_chunk": 0}},
    "no-prefetch": {"perf": {"prefetch": False}},
    "no-fused-checks": {"perf": {"fused_grad_checks": False}},
    "hf-experts": {"perf": {"experts": "hf"}},
    "eager-hooks": {"perf": {"compile_router_hooks": False}},
    # the MoE levers on explicitly (params.yaml's defaults pick them where they apply)
    "sorted-experts": {"perf": {"experts": "sorted"}},
    "compiled-hooks": {"perf": {"compile_router_hooks": True}},
    "sorted-compiled-hooks": {"perf": {"experts": "sorted", "compile_router_hooks": True}},
    # ZeRO-1 on one rank: train.zero's auto leaves out DeepSpeed's per-parameter gradient hooks
    "zero2": {"zero_stage": 2},
    "zero1": {"zero_stage": 1},
    "zero1-hooks": {"zero_stage": 1, "zero": {"overlap_comm": True, "contiguous_gradients": True}},
    "zero0": {"zero_stage": 0},
    # dsflow's fused AdamW with fp32 masters instead of DeepSpeed's bf16 optimizer; with
    # zero_stage auto that is ZeRO-0; the default on one GPU
    "fused-optimizer": {"perf": {"optimizer": "fused"}},
    "deepspeed-optimizer": {"perf": {"optimizer": "deepspeed"}},
    # each step's numbers read at once (a host sync per step), not one step late
    "sync-metrics": {"perf": {"async_metrics": False}},
    "no-overlap": {"zero": {"overlap_comm": False}},
    # DeepSpeed's ZeRO-1/2 bf16 step with its host syncs (train.perf.device_step off)
    "no-device-step": {"perf": {"device_step": False}},
    # DeepSpeed's own per-parameter gradient copies at ZeRO-1/2 (train.perf.lean_grad_hooks off)
    "ds-hooks": {"perf": {"lean_grad_hooks": False}},
    # the classic setup's levers: fp16 with dynamic loss scaling, gradient accumulation
    "fp16": {"precision": "fp16"},
    "accum2": {"grad_accum": 2},
    # the fused lm_head + cross-entropy where auto leaves it off (fp16: train.perf.ce_chunk)
    "fused-ce": {"perf": {"ce_chunk": DEFAULT_CE_CHUNK}},
    "accum4": {"grad_accum": 4},
    "cudagraphs": {"perf": {"compile_mode": "reduce-overhead"}},
    # Inductor searches GEMM and fused-kernel configs for each layer's shapes (slow to compile)
    "autotune": {"perf": {"compile_mode": "max-autotune-no-cudagraphs"}},
    # FP8 matmuls in the larger dense linears (torchao float8), per tensor or per row
    "fp8": {"perf": {"fp8": "tensorwise"}},
    "fp8-rowwise": {"perf": {"fp8": "rowwise"}},
    # the routed experts' grouped GEMMs in FP8 (torchao, rowwise; SM90)
    "fp8-experts": {"perf": {"fp8_experts": True}},
    **FROM_CHECKPOINT,
}
# The noise references: the baseline with one exact change of kernel each (MLA's V zero-padded
# so SDPA takes its flash kernel; the lm_head + cross-entropy in chunks: the same math, tested on
# CPU, rounded differently). How far these curves drift from the baseline's and from each other
# is the bf16 noise the other runs are judged against. One such draw can come out small by
# chance, well below how far two rounding-only runs can drift apart: every pair counts.
NOISE = {
    "noise": {"attention": "flash_padded"},
    "noise-ce": {"ce_chunk": DEFAULT_CE_CHUNK},
}
for _name, _change in NOISE.items():
    VARIANTS[_name] = {**VARIANTS["baseline"], "perf": {**VARIANTS["baseline"]["perf"], **_change}}
# The stock path with Liger Kernel, as a user of HF's Trainer turns it on (use_liger_kernel).
VARIANTS["baseline-liger"] = deep_merge(VARIANTS["baseline"], {"perf": {"liger": True}})
# The runs others can be judged against (--reference) and their noise runs: dsflow's is its
# attention through SDPA instead of the padded flash kernel (the same math, another kernel), for
# an opt-in such as fp8 measured against dsflow's bf16.
NOISE_RUNS = {"baseline": tuple(NOISE), "dsflow": ("no-flash",)}


def variant(name: str) -> dict:
    """The overlay of a variant; `a+b` stacks b's overlay on a's (e.g. zero1+sorted-experts)."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; from: {', '.join(VARIANTS)}")
    overlay: dict = {}
    for part in parts:
        overlay = deep_merge(overlay, VARIANTS[part])
    return overlay


COMPARE_STEPS = 50
# Loss spikes near the peak learning rate come and go with rounding, a step or two each: the
# largest difference is taken between centred means over this many steps, not single steps.
SMOOTH = 5
# A run whose curve differs from the baseline's by rounding only is another draw of what the
# noise runs show; twice the largest leaves room for the draws, and the floors for noise runs
# that happen to round almost like the baseline. Without a noise run: fixed tolerances.
NOISE_FACTOR = 2.0
FLOOR_MEAN, FLOOR_MAX = 0.002, 0.005
FIXED_MEAN, FIXED_MAX = 0.01, 0.03


def matmul_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def tsv(path: Path, column: str) -> dict[int, float]:
    if not path.exists():
        return {}
    with open(path) as f:
        return {int(r["step"]): float(r[column]) for r in csv.DictReader(f, delimiter="\t")}


def datasheet_peak_tflops() -> tuple[float | None, str]:
    """(this GPU's datasheet dense bf16 peak in TFLOP/s, what it is): the MFU denominator."""
    import torch

    peak, what = flops.mfu_peak(torch.cuda.get_device_name(), "bf16")
    return (peak / 1e12 if peak else None), what


def run_stage(
    name: str, config: dict, variant: dict, steps: int, out: Path, profile: bool, until=None
) -> dict:
    """The train stage on `config` with the `variant` overlay for `steps` steps: its step time,
    losses and memory. `until`: polled while it runs; once it returns true the stage is asked to
    stop (checkpoints/.stop: the ranks leave at the next step boundary) and the result is
    {"name", "stopped": True, "wall_s"}, the rest left in dvclive/."""
    train = {
        "device": "cuda",
        "gpus": 1,
        "precision": "bf16",
        "zero_stage": "auto",
        "seq_len": SEQ,
        "micro_batch": MICRO,
        "grad_accum": 1,
        "global_batch": None,
        "max_steps": steps,
        "eval_every": steps,
        "eval_batches": 2,
        "checkpoint_every": steps,
        # Below the edge of stability: at 6e-4, single-step loss spikes near the end of the
        # warm-up come and go with rounding and swamp the comparison of the two curves.
        "optimizer": {"lr": 3e-4},
    }
    train.update(variant)
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    if variant.get("finetune"):
        config = {**config, "pretrained": str(checkpoint_of(config, out))}
    overlay = work / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({"model": config, "train": train}))
    env = dict(os.environ)
    if profile:
        table = out / f"profile-{name.replace('+', '_')}.txt"
        env["DSFLOW_PROFILE"] = f"{steps - 4}:{steps - 2}:{table}"
    for path in ("checkpoints", "models/final", "dvclive"):
        shutil.rmtree(path, ignore_errors=True)
    Path("metrics/train.json").unlink(missing_ok=True)
    t0 = time.time()
    log_path = work / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsflow", "--profile", str(overlay), "train"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        stopped = wait_or_stop(proc, until)
    wall = time.time() - t0
    if stopped:
        return {"name": name, "stopped": True, "wall_s": wall, "log": str(log_path)}
    if proc.returncode != 0:
        lines = log_path.read_text().splitlines()
        errors = rank_errors(lines)
        shutil.copy(log_path, out / f"failed-{name.replace('+', '_')}.log")
        print(f"{name}: train stage failed ({proc.returncode}):\n  " + "\n  ".join(lines[-25:]))
        print("  errors:\n  " + "\n  ".join(errors[-4:] or ["none logged"]))
        return {"name": name, "failed": True}
    live = Path("dvclive/plots/metrics")
    metrics = json.loads(Path("metrics/train.json").read_text())
    perf = json.loads(Path("checkpoints/run.json").read_text())["perf"]
    step_s = tsv(live / "perf/step_s.tsv", "step_s")
    warm = max(10, steps // 4)  # compilation and allocator warm-up stay out of the timing
    steady = [v for s, v in step_s.items() if s > warm]
    return {
        "name": name,
        "variant": variant,
        "loss": tsv(live / "train/loss.tsv", "loss"),
        "step_s": statistics.median(steady),
        "data_wait": statistics.median(
            v
            for s, v in tsv(live / "perf/data_wait_frac.tsv", "data_wait_frac").items()
            if s > warm
        ),
        "peak_gb": metrics["peak_memory_gb_per_rank"][0],
        "reserved_gb": metrics["peak_reserved_gb_per_rank"][0],
        "planned_gb": metrics.get("planned_reserved_gb"),
        "params_total": metrics["params_total"],
        "params_activated": metrics["params_activated"],
        **experts_taken(config, perf),
        "wall_s": wall,
        "log": str(log_path),
    }


def experts_taken(config: dict, perf: dict) -> dict:
    """{"experts": the routed experts' kernel a run took, "experts_why": why hf-best took it};
    "none" for a config whose layers are all dense."""
    shape = {**PRESETS[config["preset"]], **config["overrides"]}
    if shape["first_k_dense_replace"] >= shape["num_hidden_layers"]:
        return {"experts": "none", "experts_why": ""}
    return {"experts": experts_of(perf), "experts_why": perf.get("experts_why", "")}


def experts_of(perf: dict) -> str:
    """The routed experts' kernel a run took (its run.json's train.perf, as the stage resolved
    it), as the table names it."""
    if perf.get("liger"):
        return "liger"
    return "grouped_mm" if perf["experts"] == "hf" else perf["experts"]


def refusal(cname: str, vname: str) -> str | None:
    """Why variant `vname` cannot run on config `cname` here (one line), or None: Liger Kernel
    where liger-kernel is missing or does not support the model."""
    if not variant(vname).get("perf", {}).get("liger"):
        return None
    config = CONFIGS[cname]
    try:
        hfkernels.check_liger(preset_model_type(config["preset"]), config.get("mtp_depth", 0))
    except UsageError as e:
        return str(e)
    return None


def wait_or_stop(proc: subprocess.Popen, until=None, poll_s: float = 1.0) -> bool:
    """Wait for the stage; True when `until()` turned true first and the stage was asked to
    stop through checkpoints/.stop (its own signal handler does the same; how it exits then
    is not looked at). Should the bench itself stop (an error, Ctrl-C), so does the stage."""
    try:
        while proc.poll() is None:
            if until is not None and _holds(until):
                Path("checkpoints").mkdir(exist_ok=True)
                Path("checkpoints/.stop").touch()
                proc.wait()
                return True
            time.sleep(poll_s)
        return False
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def stop_the_stage_on_sigterm() -> None:
    """A SIGTERM (`timeout`, a scheduler's kill) ends the bench as Ctrl-C does, through
    wait_or_stop's clean-up, so the train stage it started stops too instead of running on
    and holding checkpoints/ against the next run."""

    def leave(signum, _frame):
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def _holds(until) -> bool:
    """until(); False while a file it reads is half-written (a row cut mid-line)."""
    try:
        return bool(until())
    except (ValueError, TypeError, KeyError):
        return False


def rank_errors(lines: list[str]) -> list[str]:
    """The error lines of the ranks and of dsflow in a stage's log: they come before the
    launcher's long report, which is all its last lines show."""
    mark = ("[dsflow train] error", "dsflow train: error")
    return [
        line
        for line in lines
        if (line.startswith("[rank") and "Error" in line) or any(m in line for m in mark)
    ]


def checkpoint_of(config: dict, out: Path) -> Path:
    """The config's random init (seed 0) saved as a bf16 HF checkpoint with the data's
    tokenizer, once per bench run: what the fine-tuning variants continue from."""
    import torch
    from transformers import AutoTokenizer

    from dsflow.model.build import build_model

    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    folder = out / "checkpoints" / f"{config['preset']}-{key}"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        net = build_model(
            model_config(config["preset"], vocab_size(), config["overrides"]),
            device_type="cpu",
            dtype="bf16",
        )
        net.save_pretrained(folder)
        AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder.resolve()


def planned_vs_measured(r: dict) -> str:
    """The planner's reserved peak against the measured one (torch.cuda.max_memory_reserved)."""
    if not r.get("planned_gb"):
        return "planned n/a"
    return (
        f"planned {r['planned_gb']:.1f} GB vs reserved {r['reserved_gb']:.1f} GB "
        f"({100 * (r['planned_gb'] / r['reserved_gb'] - 1):+.0f}%)"
    )


def flops_per_token(config: dict, frozen: bool = False, seq: int = SEQ) -> float:
    """As the train stage counts them; `frozen`: LoRA (no weight gradients of the base); the
    multi-token prediction depths of a config with `mtp_depth`."""
    model = model_config(config["preset"], vocab_size(), config["overrides"])
    depth = config.get("mtp_depth", 0)
    return flops.flops_per_token(model, seq, frozen=frozen, mtp_depth=depth)


def smoothed(curve: dict[int, float], steps: list[int], width: int = SMOOTH) -> list[float]:
    """Centred means over `width` consecutive steps (shorter windows at the ends)."""
    half = width // 2
    vals = [curve[s] for s in steps]
    return [statistics.mean(vals[max(0, i - half) : i + half + 1]) for i in range(len(vals))]


def loss_agreement(
    base: dict[int, float], run: dict[int, float], compare_steps: int = COMPARE_STEPS
) -> tuple[float, float] | None:
    """(mean relative difference per step, largest relative difference of the smoothed curves)
    over the first `compare_steps` steps both runs logged (a missing step is skipped: its
    neighbours in the list are averaged); None when there is no such step. A NaN loss makes
    both NaN, which no tolerance accepts."""
    steps = [s for s in range(1, compare_steps + 1) if s in base and s in run and base[s] != 0]
    if not steps:
        return None
    rel = [abs(run[s] - base[s]) / abs(base[s]) for s in steps]
    a, b = smoothed(base, steps), smoothed(run, steps)
    return statistics.mean(rel), max(abs(y - x) / abs(x) for x, y in zip(a, b, strict=True))


def noise_level(
    runs: dict[str, dict], reference: str = "baseline", compare_steps: int = COMPARE_STEPS
) -> tuple[float, float] | None:
    """The largest (mean, max) difference between two reference runs (`reference` and its
    noise runs, each component on its own), over every pair of them; None without the
    reference and a noise run."""
    refs = [runs[v]["loss"] for v in references(reference) if v in runs]
    if reference not in runs or len(refs) < 2:
        return None
    pairs = itertools.combinations(refs, 2)
    draws = [loss_agreement(a, b, compare_steps) for a, b in pairs]
    draws = [d for d in draws if d is not None]
    if not draws:
        return None
    return max(d[0] for d in draws), max(d[1] for d in draws)


def references(reference: str) -> tuple[str, ...]:
    """The run others are judged against and its noise runs."""
    return (reference, *NOISE_RUNS[reference])


def tolerance(noise: tuple[float, float] | None) -> tuple[float, float]:
    """(mean, max) a run may differ from the baseline by and still be the same math: scaled
    from the noise level (noise_level) when there is one."""
    if noise is None:
        return FIXED_MEAN, FIXED_MAX
    return NOISE_FACTOR * noise[0] + FLOOR_MEAN, NOISE_FACTOR * noise[1] + FLOOR_MAX


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="dense,moe")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seq", type=int, default=SEQ, help="sequence length")
    ap.add_argument("--micro", type=int, default=MICRO, help="micro batch (sequences)")
    ap.add_argument(
        "--reference",
        default="baseline",
        choices=sorted(NOISE_RUNS),
        help="the run the others' speed and losses are measured against; its noise runs: "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in NOISE_RUNS.items()),
    )
    ap.add_argument(
        "--compare-steps",
        type=int,
        default=COMPARE_STEPS,
        help="the losses of this many first steps are compared",
    )
    ap.add_argument(
        "--variants",
        default="baseline,noise,noise-ce,dsflow",
        help=f"comma-separated, from: {', '.join(VARIANTS)}; a+b stacks b on a",
    )
    ap.add_argument(
        "--profile",
        nargs="?",
        const="all",
        default="",
        help="torch.profiler tables + traces for these variants (comma-separated; bare: all "
        "but the baseline and noise runs)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the variant list, run in turn; step times are medians over rounds and "
        "the speedup over the baseline is printed with its spread",
    )
    ap.add_argument(
        "--add-runs",
        default="",
        metavar="FILES",
        help="results.json files of earlier bench runs (comma-separated): their runs of these "
        "configs join the comparison where this run has none of that name (e.g. noise runs "
        "made elsewhere: their losses count, their speed is theirs)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = ap.parse_args()
    # Steps past the run's last have no losses: the table and the verdict's wording stop there.
    args.compare_steps = min(args.compare_steps, args.steps)
    return args


def noise_run_to_add(variants: list[str], reference: str, added: set[str]) -> str | None:
    """The reference's first noise run, when `variants` compare runs with the reference but
    neither they nor the runs `added` from earlier benches hold one of its noise runs: without
    one the loss check falls back to fixed tolerances, which bf16 noise alone can exceed."""
    noise = NOISE_RUNS[reference]
    have = set(variants) | added
    judged = [v for v in variants if v not in references(reference)]
    if reference not in have or not judged or have & set(noise):
        return None
    return noise[0]


def variants_of(cname: str, args: argparse.Namespace, added: set[str]) -> tuple[list, list]:
    """(the listed variants config `cname` runs every round, those it runs in the first round
    only: the noise run the bench adds); a variant that cannot run here is left out, one line
    saying why."""
    listed = []
    for vname in args.variants.split(","):
        why = refusal(cname, vname)
        if why:
            print(f"  {cname}-{vname}: left out: {why}", flush=True)
        else:
            listed.append(vname)
    extra = noise_run_to_add(listed, args.reference, added)
    if extra is None:
        return listed, []
    print(
        f"  {cname}: no noise run of {args.reference} asked for: adding {extra}, the loss "
        "check's reference (once)",
        flush=True,
    )
    return listed, [extra]


def run_config(
    cname: str,
    args: argparse.Namespace,
    peaks: tuple,
    out: Path,
    results: dict,
    added: set[str] = frozenset(),
) -> dict:
    """Every variant of config `cname`, `--repeat` rounds of them in turn (so baseline and
    dsflow alternate and share the machine's drift), each saved into results.json as soon as
    it finishes, and the noise run variants_of adds, in the first round. A variant's step time
    is the median over its rounds; its losses are those of its first round that finished.
    `peaks` = (datasheet, measured) TFLOP/s: MFU and MFU of achievable; `added`: the names of
    the runs --add-runs brings."""
    config = CONFIGS[cname]

    def mfus(step_s: float, vname: str) -> tuple:  # (tokens/s, MFU, of achievable) at this step
        # A step is grad_accum micro-steps of micro x seq tokens each.
        tps = args.micro * args.seq * variant(vname).get("grad_accum", 1) / step_s
        lora = variant(vname).get("finetune") == "lora"
        fpt = flops_per_token(config, frozen=lora, seq=args.seq)
        return (tps, *(tps * fpt / (p * 1e12) if p else None for p in peaks))

    batch = {"seq_len": args.seq, "micro_batch": args.micro}

    runs = results["runs"][cname] = {}
    listed, once = variants_of(cname, args, added)
    for round_ in range(1, args.repeat + 1):
        for vname in listed + (once if round_ == 1 else []):
            name = f"{cname}-{vname}" + (f"-{round_}" if args.repeat > 1 else "")
            print(f"running {name} ...", flush=True)
            profile = round_ == 1 and (
                vname in args.profile.split(",")
                or (args.profile == "all" and vname not in references(args.reference))
            )
            r = run_stage(name, config, {**batch, **variant(vname)}, args.steps, out, profile)
            if r.get("failed"):
                continue
            first = runs.setdefault(vname, {**r, "step_s_rounds": {}})
            first["step_s_rounds"][round_] = r["step_s"]
            first["step_s"] = statistics.median(first["step_s_rounds"].values())
            first["tokens_per_s"], first["mfu"], first["mfu_of_achievable"] = mfus(
                first["step_s"], vname
            )
            tps, mfu, achv = mfus(r["step_s"], vname)  # this round's
            print(
                f"  {name}: {tps:,.0f} tok/s, MFU {percent(mfu)} ({percent(achv)} of "
                f"achievable), step {1e3 * r['step_s']:.1f} ms, peak {r['peak_gb']:.1f} GB, "
                f"data wait {100 * r['data_wait']:.2f}%, wall {r['wall_s']:.0f} s, "
                f"{planned_vs_measured(r)}",
                flush=True,
            )
            # Every finished run on disk at once: a bench stopped by a time limit keeps them.
            (out / "results.json").write_text(json.dumps(results, indent=2))
    return runs


def saved_runs(cname: str, files: str, shape: tuple[int, int]) -> dict[str, dict]:
    """Runs of `cname` with losses in earlier results.json files made at the same (seq, micro),
    the first file's where several hold a name (JSON keeps the steps as strings: back to ints)."""
    found: dict[str, dict] = {}
    for path in filter(None, files.split(",")):
        saved = json.loads(Path(path).read_text())
        theirs = (saved.get("seq", SEQ), saved.get("micro", MICRO))
        if theirs != shape:
            print(f"  {path}: seq x micro {theirs}, not {shape}: left out", flush=True)
            continue
        for vname, r in saved["runs"].get(cname, {}).items():
            if vname in found or "loss" not in r:
                continue
            ints = {
                k: {int(s): v for s, v in r.get(k, {}).items()} for k in ("loss", "step_s_rounds")
            }
            found[vname] = {**r, **ints, "added_from": path}
    return found


def add_runs(cname: str, runs: dict, saved: dict[str, dict]) -> None:
    """The `saved` runs (saved_runs) whose names `runs` lacks join it."""
    for vname, r in saved.items():
        if vname not in runs:
            runs[vname] = r
            print(f"  {cname}-{vname}: from {r['added_from']}", flush=True)


def speedup(r: dict, base: dict | None) -> str:
    """tokens/s over the reference run's: the median of the rounds' ratios (round k against
    the reference's round k) and, over several rounds, their spread."""
    if not base:
        return "n/a"
    rounds = base["step_s_rounds"].keys() & r["step_s_rounds"].keys()  # both ran (none failed)
    ratios = sorted(base["step_s_rounds"][k] / r["step_s_rounds"][k] for k in rounds)
    if not ratios:
        return "n/a"
    mid = statistics.median(ratios)
    if len(ratios) < 2:
        return f"{mid:.2f}x"
    return f"{mid:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def judge_config(cname: str, runs: dict, results: dict, rows: list, args) -> None:
    """Each run's loss difference from the reference run (`--reference`) and its verdict,
    against the tolerance the reference and its noise runs give; appends the config's table
    rows to `rows`."""
    ref, steps = args.reference, args.compare_steps
    base = runs.get(ref)
    if base:
        every = 5 * max(1, steps // 50)  # about ten columns
        shown = [s for s in range(1, steps + 1) if s == 1 or s % every == 0]
        print("  loss at steps " + " ".join(f"{s:>6}" for s in shown))
        for vname, r in runs.items():
            print(f"  {vname:<13}" + " ".join(f"{r['loss'].get(s, 0):6.3f}" for s in shown))
    noise_d = noise_level(runs, ref, steps)
    tol = tolerance(noise_d)
    for vname, r in runs.items():
        d = loss_agreement(base["loss"], r["loss"], steps) if base and vname != ref else None
        r["loss_mean_rel_diff"], r["loss_max_smoothed_rel_diff"] = d or (None, None)
        # Judged: every run but the references (a run with no losses disagrees).
        judged = base is not None and vname not in references(ref)
        r["loss_agrees"] = (d is not None and d[0] <= tol[0] and d[1] <= tol[1]) if judged else None
        rows.append((cname, vname, r, base))
    results.setdefault("loss_tolerance", {})[cname] = {
        "reference": ref, "steps": steps, "mean": tol[0], "max_smoothed": tol[1],
        "from_noise_run": noise_d is not None, "noise": noise_d
    }  # fmt: skip


def plan_ratio(r: dict) -> str:
    """The planned reserved peak over the measured one (1.00 = exact)."""
    return f"{r['planned_gb'] / r['reserved_gb']:.2f}" if r.get("planned_gb") else "n/a"


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


def print_table(rows: list, peaks: tuple, datasheet: str, args) -> None:
    print()
    print(
        f"MFU: of the {datasheet}; of achievable: of the measured bf16 matmul peak "
        f"{peaks[1]:.0f} TFLOP/s; seq {args.seq}, micro {args.micro}, 1 GPU, bf16"
    )
    header = (
        f"{'config':<7} {'run':<12} {'experts':<10} {'params tot/act':>16} {'tok/s':>9} "
        f"{'MFU':>6} {'of achv':>7} "
        f"{'step ms':>8} {'peak GB':>8} {'plan/rsv':>8} {'data wait':>9} "
        f"{'x ' + args.reference:>18} {'loss d mean/max':>17}"
    )
    print(header)
    print("-" * len(header))
    for cname, vname, r, base in rows:
        mean_d, max_d = r["loss_mean_rel_diff"], r["loss_max_smoothed_rel_diff"]
        agree = "" if mean_d is None else f"{100 * mean_d:.2f}/{100 * max_d:.2f}%"
        agree += "!" if r["loss_agrees"] is False else " " if agree else ""
        params = f"{r['params_total'] / 1e6:.0f}M/{r['params_activated'] / 1e6:.0f}M"
        print(
            f"{cname:<7} {vname:<12} {r.get('experts', ''):<10} {params:>16} "
            f"{r['tokens_per_s']:>9,.0f} "
            f"{percent(r['mfu']):>6} {percent(r['mfu_of_achievable']):>7} "
            f"{1e3 * r['step_s']:>8.1f} {r['peak_gb']:>8.1f} {plan_ratio(r):>8} "
            f"{100 * r['data_wait']:>8.2f}% {'added' if 'added_from' in r else speedup(r, base):>18} {agree:>17}"
        )
    print(
        f"\nloss d: relative difference from {args.reference} over the first "
        f"{args.compare_steps} steps, "
        f"mean per step / largest of {SMOOTH}-step means; ! = outside the tolerance; plan/rsv: "
        "the planner's reserved peak over torch.cuda.max_memory_reserved"
    )
    print_experts_choices(rows)


def print_experts_choices(rows: list) -> None:
    """Why train.perf.experts hf-best took the kernel it did, once per config and reason."""
    runs_of: dict[tuple[str, str, str], list[str]] = {}
    for cname, vname, r, _ in rows:
        if r.get("experts_why"):
            runs_of.setdefault((cname, r["experts"], r["experts_why"]), []).append(vname)
    for (cname, experts, why), vnames in runs_of.items():
        print(f"{cname}: experts hf-best took {experts} ({why}): {', '.join(vnames)}")


def print_verdicts(results: dict, rows: list) -> bool:
    """One line per judged run; True when every judged run agrees with its reference."""
    ok = True
    for cname, tol in results.get("loss_tolerance", {}).items():
        source = (
            f"{NOISE_FACTOR:g} x the noise runs' largest + "
            f"{100 * FLOOR_MEAN:.1f}/{100 * FLOOR_MAX:.1f}%"
            if tol["from_noise_run"]
            else "fixed: no noise run"
        )
        noisy = tol["noise"] and (tol["noise"][0] > FIXED_MEAN or tol["noise"][1] > FIXED_MAX)
        if noisy:
            print(
                f"{cname}: warning: the noise runs drifted apart by more than "
                f"{100 * FIXED_MEAN:.0f}%/{100 * FIXED_MAX:.0f}%: at this much bf16 noise the "
                "comparison can only catch large differences"
            )
        judged = [(v, r) for c, v, r, _ in rows if c == cname and r["loss_agrees"] is not None]
        if not judged:
            print(f"{cname}: losses not compared (needs {tol['reference']} and another run)")
            continue
        for vname, r in judged:
            ok &= r["loss_agrees"]
            print(
                f"{cname}: {vname} vs {tol['reference']} {'agree' if r['loss_agrees'] else 'DISAGREE'} "
                f"(tolerance {100 * tol['mean']:.2f}/{100 * tol['max_smoothed']:.2f}%: {source})"
            )
    return ok


def main() -> int:
    args = parse_args()
    stop_the_stage_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for vname in args.variants.split(","):
        variant(vname)  # a wrong name stops here, not after the runs before it
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak, measured: {peak:.0f} TFLOP/s (8192^3, median of 20)", flush=True)
    datasheet, what = datasheet_peak_tflops()
    print(f"MFU is against the {what}", flush=True)
    results = {"peak_tflops": peak, "datasheet_peak_tflops": datasheet, "runs": {}}
    results.update(seq=args.seq, micro=args.micro)
    rows = []
    for cname in args.configs.split(","):
        saved = saved_runs(cname, args.add_runs, (args.seq, args.micro))
        runs = run_config(cname, args, (datasheet, peak), out, results, set(saved))
        add_runs(cname, runs, saved)
        judge_config(cname, runs, results, rows, args)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    print_table(rows, (datasheet, peak), what, args)
    return 0 if print_verdicts(results, rows) else 1


if __name__ == "__main__":
    sys.exit(main())
