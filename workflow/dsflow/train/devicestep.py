"""DeepSpeed's ZeRO-1/2 optimizer step in bf16 without waiting for the GPU (train.perf.device_step).

DeepSpeed 0.19's step stops the host three times per optimizer step in bf16: the overflow
check reads its verdict (`.item()`), and the gradient norm is tested for inf/NaN twice
(`is_invalid_grad_norm`, in `step` and again in `unscale_and_clip_grads`). With
`overlap_comm` each micro-step's gradient epilogue also waits for the whole device
(`synchronize()`) before it drops the reduced gradients. Each wait drains the GPU's queue, so
the host's next launches run while the GPU idles (docs/performance.md measures the ZeRO-1/2
step against ZeRO-0's).

Here the same decisions are taken on the device, as torch's GradScaler takes them:
- bf16 has no loss scale to lower, so an inf/NaN gradient is no scale to adjust but a step to
  skip. The global norm (which every rank gets from an all-reduce) is inf exactly when some
  rank's gradients hold an inf/NaN; from it comes `found_inf`, a device tensor, and torch's
  fused AdamW (the client optimizer DeepSpeed wraps) skips the step on the device when it is
  set: parameters, moments and step count stay as they were. DeepSpeed's own check is off
  (its `check_grad_overflow`), so DeepSpeed takes every step as applied; `applied` holds what
  happened, for the caller to read back later (dsflow.train.metrics).
- Clipping: the same factor as DeepSpeed's (norm / clip + 1e-6, at least 1), computed on the
  device; an invalid norm makes it infinite, as DeepSpeed does, and the step is skipped anyway.
- The epilogue's device-wide wait becomes a stream wait: the default stream waits for the
  reduction stream, so the gradients it drops are not reused before their reduction is done.

What differs: the learning-rate schedule advances over a skipped step (DeepSpeed's is not
told), as with dsflow's fused optimizer at ZeRO-0. Torch's fused AdamW is the same AdamW as
DeepSpeed's FusedAdam (decoupled weight decay, bias correction) with the step count on the
device; a checkpoint of either loads into the other (`after_load`).
"""

from __future__ import annotations

import types

import torch


def optimizer(params: list, opt: dict) -> torch.optim.AdamW:
    """train.optimizer as torch's fused AdamW, the client optimizer DeepSpeed's ZeRO wraps."""
    return torch.optim.AdamW(
        params,
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
        eps=opt["eps"],
        weight_decay=opt["weight_decay"],
        fused=True,
    )


def install(zero_optimizer) -> None:
    """Take the step's decisions on the device in a DeepSpeedZeroOptimizer (bf16, torch's fused
    AdamW inside, no CPU offload, a gradient norm computed: the train stage checked them; a
    ds_config that makes DeepSpeed build another optimizer wrapper fails here, in one line)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(zero_optimizer) is not DeepSpeedZeroOptimizer:
        raise ValueError(
            f"train.perf.device_step: DeepSpeed built {type(zero_optimizer).__name__}, not its "
            "ZeRO-1/2 optimizer (a train.ds_config setting such as data_types.grad_accum_dtype?); "
            "set train.perf.device_step: false"
        )
    inner = zero_optimizer.optimizer
    unfit = {
        "torch's fused AdamW inside": isinstance(inner, torch.optim.AdamW)
        and inner.defaults.get("fused"),
        "no CPU offload": not zero_optimizer.cpu_offload,
        "a gradient norm (zero_optimization.compute_grad_norm)": zero_optimizer.compute_grad_norm,
        "no autocast GradScaler": zero_optimizer.torch_autocast_gradscaler is None,
    }
    missing = [what for what, ok in unfit.items() if not ok]
    if missing:
        raise ValueError(
            f"train.perf.device_step needs {', '.join(missing)}; set train.perf.device_step: false"
        )
    zero_optimizer.check_grad_overflow = False
    zero_optimizer.dsflow_applied = None
    zero_optimizer.unscale_and_clip_grads = types.MethodType(_unscale_and_clip, zero_optimizer)
    if zero_optimizer.overlap_comm and zero_optimizer.reduction_stream is not None:
        zero_optimizer.independent_gradient_partition_epilogue = types.MethodType(
            _epilogue_with_a_stream_wait, zero_optimizer
        )


def applied(zero_optimizer) -> torch.Tensor | None:
    """Whether the last step was taken: a bool tensor on the device, not read here."""
    return zero_optimizer.dsflow_applied


def _unscale_and_clip(self, grad_groups_flat, total_norm) -> None:
    """DeepSpeed's unscale_and_clip_grads for bf16 (loss scale 1), with the step's skip decided
    on the device: called once per parameter group, just before the inner optimizer's step."""
    norm = torch.as_tensor(total_norm, dtype=torch.float32, device=grad_groups_flat[0].device)
    finite = torch.isfinite(norm) & (norm >= 0)
    self.optimizer.found_inf = (~finite).float()
    self.dsflow_applied = finite
    if self.clip_grad > 0.0:
        clip = torch.where(finite, norm, torch.full_like(norm, float("inf")))
        factor = torch.clamp((clip + 1e-6) / self.clip_grad, min=1.0)
        for grad in grad_groups_flat:
            grad.mul_(1.0 / factor)


def _epilogue_with_a_stream_wait(self) -> None:
    """DeepSpeed's epilogue, its device-wide synchronize replaced by the default stream waiting
    for the reduction stream: what the wait protects (the reduced gradients it clears) is then
    only reused after the reductions that read it."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    accelerator, stream = get_accelerator(), self.reduction_stream
    accelerator.synchronize = lambda *_, **__: accelerator.current_stream().wait_stream(stream)
    try:
        DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue(self)
    finally:
        del accelerator.synchronize  # the class's own again


def after_load(zero_optimizer) -> None:
    """A loaded optimizer state as the loading optimizer keeps it, so that a run resumes across
    train.perf.device_step. torch's load_state_dict hands the saved groups' settings to the
    loading optimizer: its own implementation settings are put back (torch's fused, foreach
    and capturable flags; FusedAdam's bias_correction, which torch's groups lack). The step
    count: DeepSpeed's FusedAdam counts in a Python int, torch's fused AdamW in a float32
    tensor on the parameter's device, torch's other AdamW paths in one on the host."""
    inner = getattr(zero_optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return
    flags = ("fused", "foreach", "capturable")
    for group in inner.param_groups:
        for key, value in inner.defaults.items():
            if key in flags or key not in group:
                group[key] = value
        for p in group["params"]:
            state = inner.state.get(p, {})
            if "step" in state:
                state["step"] = _step_for(inner, p, state["step"])


def _step_for(inner, p: torch.Tensor, step):
    """`step` as `inner` keeps it (see after_load)."""
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return int(step.item()) if torch.is_tensor(step) else step
    if inner.defaults.get("fused") or inner.defaults.get("capturable"):
        return torch.as_tensor(float(step), dtype=torch.float32, device=p.device)
    return torch.tensor(float(step))
