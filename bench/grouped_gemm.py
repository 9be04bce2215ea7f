"""The routed experts' grouped GEMM, forward and backward, on one GPU: torch's against dsflow's
Triton kernels (dsflow.model.groupgemm), in bf16 and fp16, side by side in one run.

torch's is CUTLASS's kernel for bf16 on compute capability 9.x/10.x and a GEMM per expert after
a host sync elsewhere (fp16 everywhere). Shapes: the `medium` MoE's experts (hidden 768, expert
width 256: gate_up 768 -> 512, down 256 -> 768), 128 experts, top-8, micro 4 or 16 x 1024
tokens, routed uniformly at random; each expert's rows padded to the Triton tile for both.

    python bench/grouped_gemm.py --tokens 4096,16384
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dsflow.model import groupgemm


def routed_ends(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    counts = torch.bincount(torch.randint(0, experts, (tokens * top_k,)), minlength=experts)
    padded = (counts + groupgemm.BLOCK_M - 1) // groupgemm.BLOCK_M * groupgemm.BLOCK_M
    return padded.clamp_min(groupgemm.BLOCK_M).cumsum(0).to(torch.int32).cuda()


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step(gmm, x, w_up, w_down, ends):
    def run():
        up = gmm(x, w_up, ends)
        down = gmm(up[:, : up.shape[1] // 2].contiguous(), w_down, ends)
        down.float().square().mean().backward()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    print(
        f"{name}, compute capability {torch.cuda.get_device_capability()}, torch {torch.__version__}"
    )
    kernels = {
        "torch": lambda x, w, e: torch._grouped_mm(x, w, offs=e),
        "triton": groupgemm.grouped_mm,
    }
    for tokens in map(int, args.tokens.split(",")):
        torch.manual_seed(0)
        ends = routed_ends(tokens, args.experts, args.top_k)
        rows = int(ends[-1])
        flops = 3 * 2 * rows * (768 * 512 + 256 * 768)  # forward + two backward GEMMs
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(rows, 768, device="cuda", dtype=dtype, requires_grad=True)
            w_up = 0.05 * torch.randn(args.experts, 512, 768, device="cuda", dtype=dtype)
            w_down = 0.05 * torch.randn(args.experts, 768, 256, device="cuda", dtype=dtype)
            w_up = w_up.transpose(1, 2).requires_grad_()
            w_down = w_down.transpose(1, 2).requires_grad_()
            line = []
            for kname, gmm in kernels.items():
                ms = time_ms(step(gmm, x, w_up, w_down, ends))
                line.append(f"{kname} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
            print(f"{tokens} tokens ({rows} rows) {str(dtype)[6:]}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
