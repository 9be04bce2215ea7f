"""The gradient overflow check and norm of DeepSpeed's ZeRO-1/2 optimizer, in a few fused launches.

DeepSpeed 0.19 checks every gradient tensor for inf/NaN with its own amax, amin and isfinite
launches, then takes each tensor's norm after copying it to fp64: about ten small kernels per
tensor, each launched from Python. After the overflow check's host sync the GPU has nothing
queued, so it idles while the host issues those launches (~40% of a 191M-parameter dense step on
an H200, docs/performance.md). The same two answers come from two multi-tensor launches:
`_amp_foreach_non_finite_check_and_unscale_` (GradScaler's exact elementwise inf/NaN test, at a
scale of 1) and `_foreach_norm` with fp32 accumulation.

What differs from DeepSpeed: the per-tensor norms accumulate in fp32 instead of fp64 (relative
differences around 1e-7, far below what gradient clipping can see). Installed only where the
result is the same quantity: no CPU offload (which keeps its own per-parameter norms), no model
or pipeline parallelism (whose parameter filters are skipped here), L2 norms.
"""

from __future__ import annotations

import types

import torch


def install(optimizer) -> bool:
    """Swap the fused check and norm into a DeepSpeedZeroOptimizer; False where it does not apply
    (another optimizer wrapper, CPU offload, model/pipeline parallel parameters)."""
    from deepspeed.comm import pg_utils
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(optimizer) is not DeepSpeedZeroOptimizer or optimizer.cpu_offload:
        return False
    if pg_utils.is_parallel(getattr(optimizer, "model_parallel_group", None)):
        return False
    for group in optimizer.params_in_partition:
        if any(getattr(p, "ds_pipe_replicated", False) for p in group):
            return False
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(_has_overflow, optimizer)
    optimizer.get_grad_norm_direct = types.MethodType(_grad_norm, optimizer)
    return True


def _grads(gradients) -> list[torch.Tensor]:
    # DeepSpeed pads the last partition with zero views it marks `_zero_padding`.
    return [g for g in gradients if g is not None and not getattr(g, "_zero_padding", False)]


def _has_overflow(self) -> torch.Tensor:
    """Any inf/NaN in this rank's gradient partition, as a [1] bool tensor on the device."""
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    found = torch.zeros(1, dtype=torch.float, device=device)
    one = torch.ones(1, dtype=torch.float, device=device)
    for i in range(len(self.bit16_groups)):
        grads = _grads(self.averaged_gradients.get(i) or [])
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            # Multiplies by 1 in place (exact) and sets `found` on any inf/NaN element.
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
    return found.bool()


def _grad_norm(self, gradients, params, norm_type=2):
    """DeepSpeed's get_grad_norm_direct (L2): the partition's norm, summed over data-parallel
    ranks; an inf/NaN norm comes back as -1, DeepSpeed's sentinel."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if float(norm_type) != 2.0:
        return DeepSpeedZeroOptimizer.get_grad_norm_direct(self, gradients, params, norm_type)
    grads = _grads(gradients)
    if grads:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total = torch.stack(norms).double().pow(2).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total
