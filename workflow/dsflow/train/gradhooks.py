"""ZeRO-1/2's per-parameter gradient work in fewer launches (train.perf.lean_grad_hooks).

With contiguous gradients DeepSpeed 0.19's ZeRO-2 (and ZeRO-1 with overlap_comm) handles each
parameter's gradient up to three times per micro-step, one parameter at a time from Python:
its backward hook copies the gradient into the reduce bucket (narrow, view, copy, view_as and
`.data` swaps); once the bucket is reduced it copies the parameter's reduced gradient out into
the rank's partition buffer (as many again); and each micro-step after the first, the
epilogue adds the new gradients to those it holds from the micro-steps before, one `add_`
each. The `medium` MoE has 240 parameters: on a GPU host at a small micro batch the host's
launches are the step (docs/performance.md).

Here the same arithmetic is launched less often:
- the hook: one view of the bucket at the gradient's shape (`as_strided`), one copy, and the
  gradient's `.data` swapped to that view, as DeepSpeed swaps it;
- after a bucket's reduction, the gradients DeepSpeed copies into the partition buffer one by
  one are copied by one `_foreach_copy_`, on the stream DeepSpeed copies them on;
- the epilogue's accumulation is one `_foreach_add_`.
The order of the buckets' copies, their sizes and flushes, the reduction, the rest of the
epilogue and the step are DeepSpeed's own; the gradients are the same bit for bit. Where a
parameter is not the common case (larger than a bucket, a bucket about to flush, a gradient
not ready or not contiguous), DeepSpeed's own hook takes it.
"""

from __future__ import annotations

import types

import torch


def install(zero_optimizer) -> bool:
    """Swap the lean gradient path into a DeepSpeedZeroOptimizer; False where it does not apply
    (another optimizer, no per-parameter hooks, CPU offload, non-contiguous gradient buckets, a
    separate accumulation dtype, autocast, ZenFlow, tensor-parallel expert folding)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(zero_optimizer) is not DeepSpeedZeroOptimizer or not _fits(zero_optimizer):
        return False
    opt, accelerator = zero_optimizer, get_accelerator()
    opt.dsflow_deepspeed = DeepSpeedZeroOptimizer  # its own methods, for the uncommon cases
    opt.dsflow_accelerator = accelerator
    opt.dsflow_is_moe = is_moe_param
    # DeepSpeed notes the streams that filled a bucket, for its reduction to wait on them all.
    opt.dsflow_track_streams = bool(opt.overlap_comm and not accelerator.resolves_data_dependency())
    opt.dsflow_pending = None  # a list while a reduction defers its copies
    # The epilogue asks for each group's gradients by its list of parameters in the partition;
    # the accumulation is taken over only while it runs (DeepCompile also asks).
    opt.dsflow_groups = {id(params): i for i, params in enumerate(opt.params_in_partition)}
    opt.dsflow_in_epilogue = False
    opt.process_gradients = types.MethodType(_process_gradients, opt)
    opt.reduce_ipg_grads = types.MethodType(_reduce_ipg_grads, opt)
    opt.copy_grads_in_partition = types.MethodType(_copy_out, opt)
    opt.get_all_grad_tensors = types.MethodType(_all_grad_tensors, opt)
    # (the epilogue may be dsflow.train.devicestep's)
    opt.independent_gradient_partition_epilogue = _flagged(
        opt, opt.independent_gradient_partition_epilogue
    )
    return True


def hooked(zero_optimizer) -> bool:
    """Whether DeepSpeed hooks each parameter's gradient in this optimizer."""
    return bool(
        getattr(zero_optimizer, "partition_gradients", False)
        or getattr(zero_optimizer, "overlap_comm", False)
    )


def _fits(opt) -> bool:
    from deepspeed.runtime.torch_autocast import is_autocast_initialized

    return bool(
        hooked(opt)
        and opt.contiguous_gradients
        and not opt.cpu_offload
        and not opt.zenflow
        and not opt.use_grad_accum_attribute
        and opt.autoep_folding_tp_group is None
        and not is_autocast_initialized()
        and not any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups)))
    )


def _process_gradients(self, param, i) -> None:
    """DeepSpeed's process_gradients, the common case's copy into the bucket in two launches."""
    if self._coalesce_grad_reduction:
        return
    self.setup_buckets()
    if not (self.partition_gradients or self.is_gradient_accumulation_boundary()):
        return  # ZeRO-1 reduces at the accumulation boundary only, as DeepSpeed does
    grad, n = param.grad, param.numel()
    bucket = self.ipg_buckets[self.get_param_comm_dtype(param)]
    if (
        grad is None
        or n == 0
        or bucket.elements + n > self.reduce_bucket_size
        or not getattr(param, "ds_grad_is_ready", True)
        or not grad.is_contiguous()
    ):
        self.dsflow_deepspeed.process_gradients(self, param, i)
        return
    param_id = self.param_id[id(param)]
    assert not self.params_already_reduced[param_id], "a gradient computed twice"
    buffer = bucket.buffer[bucket.index]
    slot = buffer.as_strided(grad.shape, grad.stride(), buffer.storage_offset() + bucket.elements)
    slot.copy_(grad)
    # As DeepSpeed does: the gradient tensor itself now holds the slot, so its own memory is
    # freed here even while the compiled backward that produced it still holds the tensor.
    grad.data = slot
    if self.dsflow_track_streams:
        bucket.copy_streams.add(self.dsflow_accelerator.current_stream())
    bucket.elements += n
    bucket.grads.append(grad)
    bucket.params.append((i, param.param_idx_in_group, param_id))
    if self.dsflow_is_moe(param):
        bucket.has_moe_params = True


def _reduce_ipg_grads(self, comm_dtype=None) -> None:
    """DeepSpeed's reduce_ipg_grads, its copies into the partition buffer made at the end in one
    launch on the stream DeepSpeed makes them on."""
    self.dsflow_pending = []
    try:
        self.dsflow_deepspeed.reduce_ipg_grads(self, comm_dtype)
        pending = self.dsflow_pending
    finally:
        self.dsflow_pending = None
    if pending:
        accelerator = self.dsflow_accelerator
        stream = self.reduction_stream if self.overlap_comm else accelerator.current_stream()
        with accelerator.stream(stream):
            _copy_all(self, pending)


def _copy_out(self, param, group_idx=None) -> None:
    """DeepSpeed's copy_grads_in_partition, deferred to the end of the reduction when one runs
    and the partition buffer exists (DeepSpeed allocates it at the first copy)."""
    if self.dsflow_pending is None or self.grads_in_partition is None:
        self.dsflow_deepspeed.copy_grads_in_partition(self, param, group_idx)
    else:
        self.dsflow_pending.append(param)


def _copy_all(self, params: list) -> None:
    """Each parameter's gradient into the partition buffer at the next offset, as DeepSpeed's
    copy_grads_in_partition does one by one, and the gradient's data swapped to it. (DeepSpeed
    allocates the buffer anew at every micro-step, so a view is made each time.)"""
    base = self.grads_in_partition
    views, grads = [], []
    for param in params:
        grad, offset = param.grad, self.grads_in_partition_offset
        if grad.is_contiguous():
            views.append(base.as_strided(grad.shape, grad.stride(), base.storage_offset() + offset))
        else:  # DeepSpeed's own views (and its error, view_as's)
            views.append(base.view(-1).narrow(0, offset, grad.numel()).view_as(grad))
        grads.append(grad)
        self.grads_in_partition_offset += grad.numel()
    torch._foreach_copy_(views, grads)
    for grad, view in zip(grads, views, strict=True):
        grad.data = view


def _all_grad_tensors(self, tensor_list, dtype) -> list:
    """DeepSpeed's get_all_grad_tensors. The epilogue of each micro-step adds what it returns to
    the gradients it holds from the micro-steps before, one tensor at a time; asked by the
    epilogue, that sum is made here in one launch, and nothing is left for it to add."""
    grads = self.dsflow_deepspeed.get_all_grad_tensors(self, tensor_list, dtype)
    group = self.dsflow_groups.get(id(tensor_list))
    held = self.all_grad_tensors.get(group) if group is not None else None
    if not (self.dsflow_in_epilogue and held):  # held is [] where the partition holds none
        return grads
    torch._foreach_add_(held, grads)
    return []


def _flagged(self, epilogue):
    """`epilogue` with self.dsflow_in_epilogue set while it runs."""

    def run() -> None:
        self.dsflow_in_epilogue = True
        try:
            epilogue()
        finally:
            self.dsflow_in_epilogue = False

    return run
