"""The routed experts' grouped GEMM in Triton, for the GPUs and dtypes torch's does not serve fast.

torch's grouped GEMM (`torch._grouped_mm`) has one fast kernel, CUTLASS's, for bf16 on compute
capability 9.x and 10.x. Everywhere else (fp16; bf16 on an RTX 4090 or an A100) it falls back to
one GEMM per expert after copying the group ends to the host: a device-to-host sync in every
expert GEMM of every layer, forward and backward. This module is the same product without the
sync, for fp16 and bf16 on compute capability 8.0 and newer:

- the rows (tokens routed to experts, sorted by expert) come padded so that every expert's
  rows start at a multiple of BLOCK_M (fastpaths._pad_groups: zero rows fill the gaps), so each
  BLOCK_M-row tile belongs to one expert, found on the device from the group ends;
- forward `out = x @ w[e]` and the input gradient `dx = dout @ w[e]^T` are the same kernel
  (`_gmm_kernel`, `w` passed with its strides, so a transposed view costs no copy);
- the weight gradient `dw[e] = x[rows of e]^T @ dout[rows of e]` loops over that expert's
  rows (`_gmm_dw_kernel`), accumulating in fp32.

`grouped_mm` is a torch custom op (torch.library.triton_op), so torch.compile traces it into a
layer's graph with no break. The kernels are built on first use, so the tests can run them in
Triton's interpreter on CPU (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from dsflow.model import fastpaths

# Rows per tile: every expert's rows start at a multiple of it (fastpaths._pad_groups).
BLOCK_M = fastpaths.TRITON_GEMM_ROWS
_BLOCK_N, _BLOCK_K = 64, 64


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """(the forward / input-gradient kernel, the weight-gradient kernel), built once per mode:
    triton.jit reads TRITON_INTERPRET when it decorates."""
    del interpret  # the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def _gmm_kernel(
        x, w, out, tile_expert, sxm, sxk, swe, swk, swn, som, son,
        N: tl.constexpr, K: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(tile_expert + pid_m).to(tl.int64)  # int64: E x K x N may pass 2**31
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        x_at = x + rm[:, None] * sxm + rk[None, :] * sxk
        w_at = w + e * swe + rk[:, None] * swk + rn[None, :] * swn
        acc = tl.full(
            (BM, BN), 0.0, tl.float32
        )  # tl.zeros: a jit function the interpreter cannot call
        for k in range(0, K, BK):
            left = K - k
            a = tl.load(x_at, mask=rk[None, :] < left, other=0.0)
            b = tl.load(w_at, mask=(rk[:, None] < left) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(a, b)
            x_at += BK * sxk
            w_at += BK * swk
        out_at = out + rm[:, None] * som + rn[None, :] * son
        tl.store(out_at, acc.to(out.dtype.element_ty), mask=rn[None, :] < N)

    @triton.jit
    def _gmm_dw_kernel(
        x, dy, dw, starts, ends, sxm, sxk, sym, syn, swe, swk, swn,
        K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        e, pid_k, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = tl.load(starts + e), tl.load(ends + e)
        rk = pid_k * BK + tl.arange(0, BK)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        acc = tl.full((BK, BN), 0.0, tl.float32)
        m = start
        while m < end:  # a while loop: Triton's interpreter takes no loaded range bounds
            rows = m + rm
            a = tl.load(
                x + rows[None, :] * sxm + rk[:, None] * sxk, mask=rk[:, None] < K, other=0.0
            )
            b = tl.load(
                dy + rows[:, None] * sym + rn[None, :] * syn, mask=rn[None, :] < N, other=0.0
            )
            acc += tl.dot(a, b)
            m += BM
        dw_at = dw + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :] * swn
        tl.store(dw_at, acc.to(dw.dtype.element_ty), mask=(rk[:, None] < K) & (rn[None, :] < N))

    return _gmm_kernel, _gmm_dw_kernel


def _launch(kernel: Any) -> Any:
    """The kernel as a triton_op launches it: wrapped, so that torch.compile and fake tensors
    see a kernel call instead of running it."""
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.triton_op("dsflow::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x (rows, K) @ w[e] (K, N) for the rows of expert e, which end at ends[e] (int32, each
    group starting at a multiple of BLOCK_M, the last one at the last row): (rows, N)."""
    rows, k = x.shape
    n = w.shape[2]
    out = x.new_empty((rows, n))
    tiles = torch.arange(0, rows, BLOCK_M, device=x.device, dtype=ends.dtype)
    tile_expert = torch.searchsorted(ends, tiles, right=True).clamp_(max=w.shape[0] - 1)
    kernel = _launch(_kernels(_interpret())[0])
    grid = (rows // BLOCK_M, _cdiv(n, _BLOCK_N))
    kernel[grid](
        x, w, out, tile_expert,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        N=n, K=k, BM=BLOCK_M, BN=_BLOCK_N, BK=_BLOCK_K,
    )  # fmt: skip
    return out


@torch.library.triton_op("dsflow::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(
    x: torch.Tensor, dy: torch.Tensor, ends: torch.Tensor, experts: int
) -> torch.Tensor:
    """dw[e] = x[rows of e]^T @ dy[rows of e]: (experts, K, N), in x's dtype."""
    k, n = x.shape[1], dy.shape[1]
    dw = x.new_empty((experts, k, n))
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    kernel = _launch(_kernels(_interpret())[1])
    grid = (experts, _cdiv(k, _BLOCK_K), _cdiv(n, _BLOCK_N))
    kernel[grid](
        x, dy, dw, starts, ends,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        K=k, N=n, BM=BLOCK_M, BK=_BLOCK_K, BN=_BLOCK_N,
    )  # fmt: skip
    return dw


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, w, ends = inputs
    ctx.save_for_backward(x, w, ends)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, w, ends = ctx.saved_tensors
    grad = grad.contiguous()
    dx = grouped_mm(grad, w.transpose(1, 2), ends) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_weight_grad(x, grad, ends, w.shape[0]) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
