"""The gradient overflow check and norm of DeepSpeed's ZeRO-1/2 optimizer, in a few fused launches.

DeepSpeed 0.19 checks every gradient tensor for inf/NaN with its own amax, amin and isfinite
launches, then takes each tensor's norm after copying it to fp64: about ten small kernels per
tensor, each launched from Python. After the overflow check's host sync the GPU has nothing
queued, so it idles while the host issues those launches (docs/performance.md measures how
much of a dense step an H200 waits for the host). Both answers come from
per-tensor L2 norms taken by one multi-tensor launch (`_foreach_norm`, fp32 accumulation): a
norm is inf/NaN exactly when its tensor holds an inf/NaN. (GradScaler's
`_amp_foreach_non_finite_check_and_unscale_` would be the elementwise test, but its CUDA kernel
has no bf16 version in torch 2.11.)

What differs from DeepSpeed: the per-tensor norms accumulate in fp32 instead of fp64 (relative
differences around 1e-7, far below what gradient clipping can see); a finite gradient so large
that its squares overflow fp32 (~1e19) makes the check report an overflow, and DeepSpeed skips
that step too (its fp64 norm becomes inf when cast to fp32). The check takes one `_foreach_norm`
per parameter group, and the gradient norm that DeepSpeed asks for next reuses those per-tensor
norms while the gradients are the same tensors, unmodified (each tensor's version counter), so
a step reads its gradients once. Installed only where the result is the same quantity:
no CPU offload (which keeps its own per-parameter norms), no model or pipeline parallelism
(whose parameter filters are skipped here), L2 norms.
"""

from __future__ import annotations

import types
import weakref

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
    optimizer._dsflow_norms = _NormCache()
    return True


class _NormCache:
    """The per-tensor norms of the last overflow check, for the gradient norm of the same step.
    Weak references, so a skipped step (overflow: no norm follows) keeps no gradient alive."""

    def __init__(self):
        self._groups: list[tuple[list[weakref.ref], list[int], list[torch.Tensor]]] = []

    def clear(self) -> None:
        self._groups = []

    def put(self, grads: list[torch.Tensor], norms: list[torch.Tensor]) -> None:
        self._groups.append(([weakref.ref(g) for g in grads], [g._version for g in grads], norms))

    def get(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The norms of ``grads`` (a group, or its leading part) if none changed since put."""
        for refs, versions, norms in self._groups:
            if len(grads) <= len(refs) and all(
                ref() is g and g._version == version
                for ref, version, g in zip(refs, versions, grads, strict=False)
            ):
                return norms[: len(grads)]
        return None


def _grads(gradients) -> list[torch.Tensor]:
    # DeepSpeed pads the last partition with zero views it marks `_zero_padding`.
    return [g for g in gradients if g is not None and not getattr(g, "_zero_padding", False)]


def _has_overflow(self) -> torch.Tensor:
    """Any inf/NaN in this rank's gradient partition, as a [1] bool tensor on the device."""
    from deepspeed.accelerator import get_accelerator

    self._dsflow_norms.clear()
    norms = []
    for i in range(len(self.bit16_groups)):
        grads = _grads(self.averaged_gradients[i])
        group = _norms(grads)
        self._dsflow_norms.put(grads, group)
        norms += group
    if not norms:
        return torch.zeros(1, dtype=torch.bool, device=get_accelerator().current_device_name())
    return (~torch.isfinite(torch.stack(norms))).any().reshape(1)


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm, accumulated in fp32: inf or NaN exactly when the tensor holds an
    inf or NaN, or when its sum of squares exceeds fp32's range (a step DeepSpeed skips too)."""
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32)) if grads else []


def _grad_norm(self, gradients, params, norm_type=2):
    """DeepSpeed's get_grad_norm_direct (L2): the partition's norm, summed over data-parallel
    ranks; an inf/NaN norm comes back as -1, DeepSpeed's sentinel."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if float(norm_type) != 2.0:
        return DeepSpeedZeroOptimizer.get_grad_norm_direct(self, gradients, params, norm_type)
    # Paired with the parameters as DeepSpeed does: that drops the unmarked zeros it appends
    # to fill the last rank's partition.
    grads = [g for g, _ in zip(_grads(gradients), params, strict=False)]
    norms = self._dsflow_norms.get(grads)
    if norms is None:
        norms = _norms(grads)
    if norms:
        total = torch.stack(norms).double().pow(2).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total
