"""One MoE block of the `medium` preset on one GPU: HF's grouped_mm experts against dsflow's
sorted experts (`train.perf.experts`), side by side, eager and compiled.

Forward + backward of a `DeepseekV3MoE` (router, 64 routed experts top-6, 2 shared) on
micro 16 x seq 1024 tokens in bf16: median ms over the timed repetitions, the ratio to the
first variant, peak memory, and how far each variant's output and gradients are from the
first's (relative max difference: bf16 rounding, since the two sum in other orders). With
--profile, the top kernels of each variant by their GPU time.

    python bench/moe_layer.py
    python bench/moe_layer.py --variants hf,sorted,hf-compiled,sorted-compiled --profile
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from dsflow.model import fastpaths
from dsflow.model.presets import model_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke test of the script


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build(experts: str, compiled: bool):
    config = model_config("medium", 3489, {})
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = DeepseekV3MoE(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block = block.to(DEVICE, torch.bfloat16)
    if experts == "sorted":
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS.register(fastpaths.SORTED_EXPERTS, fastpaths.sorted_experts_forward)
        block.experts.config = copy.copy(config)
        block.experts.config._experts_implementation = fastpaths.SORTED_EXPERTS
    if compiled:
        block.compile(dynamic=False)
    return block


def run(block, x, grad, reps: int, profile: bool):
    def once():
        out = block(x)
        out.backward(grad)
        return out

    for _ in range(3):
        once()
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        block.zero_grad(set_to_none=True)
        x.grad = None
        t0 = time.perf_counter()
        out = once()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    table = None
    if profile:
        from torch.profiler import ProfilerActivity

        activity = ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(3):
                block.zero_grad(set_to_none=True)
                x.grad = None
                once()
            sync()
        table = prof.key_averages().table(
            sort_by="device_time_total" if DEVICE == "cuda" else "cpu_time_total",
            row_limit=15,
            max_name_column_width=60,
        )
    grads = {n: p.grad.float().clone() for n, p in block.named_parameters()}
    grads["input"] = x.grad.float().clone()
    return {
        "ms": statistics.median(times),
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0,
        "out": out.detach().float(),
        "grads": grads,
        "table": table,
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="hf,sorted,hf-compiled,sorted-compiled")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tokens", type=int, default=16 * 1024, help="micro 16 x seq 1024")
    args = ap.parse_args()
    torch.manual_seed(1)
    x0 = torch.randn(1, args.tokens, 1024, device=DEVICE, dtype=torch.bfloat16)
    g0 = torch.randn_like(x0)
    results = {}
    for name in args.variants.split(","):
        experts, _, mode = name.partition("-")
        block = build(experts, mode == "compiled")
        x = x0.clone().requires_grad_(True)
        results[name] = run(block, x, g0, args.reps, args.profile)
        del block
        torch.cuda.empty_cache()
    first = next(iter(results.values()))
    print(
        f"{'variant':<18} {'fwd+bwd ms':>10} {'x first':>8} {'peak GB':>8} {'out diff':>9} {'grad diff':>9}"
    )
    for name, r in results.items():
        grad_diff = max(rel(r["grads"][k], first["grads"][k]) for k in first["grads"])
        print(
            f"{name:<18} {r['ms']:>10.2f} {first['ms'] / r['ms']:>7.2f}x {r['peak_gb']:>8.2f} "
            f"{rel(r['out'], first['out']):>9.2e} {grad_diff:>9.2e}"
        )
    for name, r in results.items():
        if r["table"]:
            print(f"\n== {name}: top kernels over 3 forward + backward\n{r['table']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
