"""Host-side cost of a training step, per phase, side by side for train.perf variants (CPU, no GPU).

On the H200 the GPU waits for the host for a large part of each step (docs/performance.md):
what the host does per step bounds the speed there. This measures that host work on a machine
without a GPU: the `medium` preset's layers and tensors (the same number of parameter tensors and
ops as the real model; widths divided by 16 so the arithmetic itself is small), the GPU's
grouped_mm experts, DeepSpeed bf16 on its CPU accelerator, one gloo rank, dsflow's TrainingLM
and expert balancer, eager (no torch.compile, which on the GPU fuses forward and backward ops).
Per variant, in a fresh process each: host milliseconds per step for forward, backward and the
optimizer step (median of --steps), and the number of aten ops dispatched per step in each
phase (from torch.profiler: on CUDA each is a launch or at least a trip through the
dispatcher). Then the ratio of each variant to the first. A proxy for the GPU host (other
CPU, kernels launched instead of run), not a GPU measurement.

    python bench/host_overhead.py --configs dense,moe --variants deepspeed,fused-checks,zero1
    python bench/host_overhead.py --configs moe --variants zero1,deepspeed,lean-hooks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from dsflow.launch import free_port

# Overlays on the train section (ZeRO-2 unless a variant says otherwise), as in
# bench/train_throughput.py. ZeRO-1 on this one rank gets no per-parameter gradient hooks
# (train.zero's auto); zero1-hooks turns them back on. DeepSpeed's own gradient hooks but in
# `lean-hooks` (train.perf.lean_grad_hooks).
DS_HOOKS = {"lean_grad_hooks": False}
VARIANTS = {
    "deepspeed": {"perf": DS_HOOKS},
    "lean-hooks": {"perf": {"lean_grad_hooks": True}},
    "fused-checks": {"perf": {"fused_grad_checks": True, **DS_HOOKS}},
    "zero1": {"zero_stage": 1, "perf": DS_HOOKS},
    "zero1-fused": {"zero_stage": 1, "perf": {"fused_grad_checks": True, **DS_HOOKS}},
    "zero1-hooks": {
        "zero_stage": 1,
        "zero": {"overlap_comm": True, "contiguous_gradients": True},
        "perf": {"fused_grad_checks": True, **DS_HOOKS},
    },
}
SHRUNK = {  # the medium preset's structure at 1/16 of its widths
    "hidden_size": 64,
    "intermediate_size": 176,
    "moe_intermediate_size": 24,  # grouped_mm wants 16-byte strides
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
PHASES = ("forward", "backward", "step")


def measure(config: str, variant: str, steps: int) -> dict:
    """One variant in this process (the parent runs each in its own)."""
    # Torch and DeepSpeed (and the dsflow modules that import them) load in the child only,
    # whose environment selects DeepSpeed's CPU accelerator; the parent just starts children.
    import deepspeed
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from dsflow import dsconfig
    from dsflow.model import fastpaths
    from dsflow.model.balance import ExpertBalancer
    from dsflow.model.build import build_model
    from dsflow.model.loss import TrainingLM
    from dsflow.model.presets import model_config
    from dsflow.params import deep_merge, load
    from dsflow.train import fusedgrads, gradhooks
    from dsflow.train.diagnostics import count_within

    deepspeed.init_distributed(dist_backend="gloo")
    train = deep_merge(load("params.yaml")["train"], {"zero_stage": 2, **VARIANTS[variant]})
    train["precision"] = "bf16"
    overrides = dict(SHRUNK, **({"first_k_dense_replace": 16} if config == "dense" else {}))
    torch.manual_seed(0)
    # The GPU's expert path (grouped_mm, which also runs on CPU), not the CPU's per-expert loop.
    model = build_model(model_config("medium", 512, overrides), device_type="cuda")
    balancer = ExpertBalancer(model, gamma=1e-3, seq_aux_alpha=1e-4)
    perf = fastpaths.resolve(train["perf"], "cpu", train["zero_stage"], "bf16")
    ds_config = dsconfig.build(train, dsconfig.Batch(2, 1, 1), 1000, "cpu")
    engine, *_ = deepspeed.initialize(
        model=TrainingLM(model), model_parameters=list(model.parameters()), config=ds_config
    )
    if perf.fused_grad_checks:
        assert fusedgrads.install(engine.optimizer)
    if perf.lean_grad_hooks:
        assert gradhooks.install(engine.optimizer)
    tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {p: [] for p in PHASES}

    def step() -> None:
        t = time.perf_counter()
        with record_function("forward"):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
        times["forward"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with record_function("backward"):
            engine.backward(loss + balancer.aux_loss())
        times["backward"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with record_function("step"):
            engine.step()
        times["step"].append(time.perf_counter() - t)
        balancer.update()

    for _ in range(3):  # warm-up: allocations, lazy state
        step()
    for p in PHASES:
        times[p].clear()
    for _ in range(steps):
        step()
    counted = 2
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(counted):
            step()
    events = prof.events()
    starts = [e.time_range.start for e in events if e.name.startswith("aten::")]
    ops = {
        p: count_within(
            [(e.time_range.start, e.time_range.end) for e in events if e.name == p], starts
        )
        for p in PHASES
    }
    return {
        "ms": {p: 1e3 * statistics.median(times[p]) for p in PHASES},
        "ops": {p: ops[p] / counted for p in PHASES},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="dense,moe")
    ap.add_argument("--variants", default="deepspeed,fused-checks", help=", ".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.steps)))
        from dsflow.train.loop import shutdown  # imports torch: the child's only, as above

        return shutdown(0)
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    print(f"{'config':<7} {'variant':<14} " + " ".join(f"{p + ' ms/ops':>18}" for p in PHASES)
          + f" {'host ms':>8} {'x first':>8}")  # fmt: skip
    results: dict[str, dict] = {}
    failed = False
    variants = args.variants.split(",")
    for config in args.configs.split(","):
        first = None
        for variant in variants:
            env["MASTER_PORT"] = str(free_port())
            cmd = [sys.executable, __file__, "--child", config, variant, "--steps", str(args.steps)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{config} {variant}: failed\n{proc.stderr[-2000:]}")
                failed = True
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.setdefault(config, {})[variant] = r
            total = sum(r["ms"].values())
            if variant == variants[0]:
                first = total
            cells = " ".join(f"{r['ms'][p]:>9.1f}/{r['ops'][p]:>8.0f}" for p in PHASES)
            ratio = f"{total / first:>7.2f}x" if first else f"{'-':>8}"
            print(f"{config:<7} {variant:<14} {cells} {total:>8.1f} {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
