"""What a training step moves between GPUs, on paper, beside the step's compute.

DeepSpeed's data parallelism over N ranks, per step of `accum` micro-steps, P parameters with
16-bit gradients and weights (2P bytes each); a ring collective sends (N-1)/N of its buffer
from each rank:

- ZeRO-0: one all-reduce of the gradients at the accumulation boundary: 2 (N-1)/N x 2P bytes.
- ZeRO-1: a reduce-scatter of the gradients at the boundary, then an all-gather of the updated
  weights: the same 2 (N-1)/N x 2P bytes.
- ZeRO-2: each micro-step's backward reduce-scatters the gradients (a rank keeps only its
  partition, DeepSpeed's `partition_gradients`): accum x (N-1)/N x 2P, plus the all-gather.
- ZeRO-3: each micro-step gathers the weights for the forward and again for the backward, and
  reduce-scatters the gradients: 3 accum (N-1)/N x 2P.

Without peer-to-peer (RTX 4090s: NCCL_P2P_DISABLE=1) NCCL stages every transfer through host
memory: a byte crosses the sender's PCIe link to the host and the receiver's back. A link
carries both directions at once, so a step's communication takes the bytes a rank sends over
its link's one-way bandwidth. DeepSpeed overlaps a reduction with the backward that produces
it (`overlap_comm`): at most the backward's two thirds of a micro-step's compute hide it; the
all-gather of the updated weights follows the optimizer step, with nothing to hide behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# PCIe 4.0 x8, about 12 GB/s one way in practice: three cards on a consumer board share its
# CPU's lanes (x16/x8/x8 or x8/x8/x4), and without peer-to-peer every byte goes through host
# memory.
PCIE_GBPS = 12.0
# The share of the GPU's datasheet peak a step's compute is taken to run at (an assumption:
# docs/performance.md has measured MFUs).
ASSUMED_MFU = 0.3
BACKWARD_SHARE = 2 / 3  # of a micro-step's FLOPs: backward w.r.t. inputs and weights


@dataclass(frozen=True)
class Traffic:
    bytes_per_step: float  # sent by each rank
    comm_s: float  # at the link's bandwidth
    compute_s: float  # the step's FLOPs at ASSUMED_MFU of the peak
    exposed_s: float  # communication no backward hides

    @property
    def share(self) -> float:
        """The step's time spent waiting on the link, of compute + exposed communication."""
        return self.exposed_s / (self.compute_s + self.exposed_s)


def bytes_per_step(params: int, world: int, zero_stage: int, accum: int) -> float:
    """Bytes each rank sends in one step (module docstring)."""
    if world <= 1:
        return 0.0
    ring = (world - 1) / world * 2 * params  # one collective over the 16-bit buffer
    if zero_stage in (0, 1):
        return 2 * ring
    if zero_stage == 2:
        return (accum + 1) * ring
    return 3 * accum * ring


def step_traffic(
    params: int,
    world: int,
    zero_stage: int,
    accum: int,
    step_flops: float,
    peak_flops: float,
    gbps: float = PCIE_GBPS,
    mfu: float = ASSUMED_MFU,
) -> Traffic:
    """A step's communication against its compute on one rank: `step_flops` are one rank's
    FLOPs in a step (all micro-steps), `peak_flops` its GPU's datasheet peak."""
    sent = bytes_per_step(params, world, zero_stage, accum)
    ring = 0.0 if world <= 1 else (world - 1) / world * 2 * params / (gbps * 1e9)  # seconds
    compute = step_flops / (peak_flops * mfu)
    micro = compute / accum
    backward = BACKWARD_SHARE * micro
    if zero_stage == 0:  # the all-reduce beside the last micro-step's backward
        exposed = max(0.0, 2 * ring - backward)
    elif zero_stage == 1:  # the reduce-scatter there too; the all-gather after the step
        exposed = max(0.0, ring - backward) + ring
    elif zero_stage == 2:  # a reduce-scatter beside every backward; the all-gather after
        exposed = accum * max(0.0, ring - backward) + ring
    else:  # gathers and reduce-scatter beside every micro-step, prefetched into its forward
        exposed = accum * max(0.0, 3 * ring - micro)
    return Traffic(sent, sent / (gbps * 1e9), compute, exposed)


def describe(traffic: Traffic, zero_stage: int, accum: int, gbps: float = PCIE_GBPS) -> str:
    """One line for the planner's output."""
    if traffic.bytes_per_step == 0:
        return "communication: none (one rank)"
    return (
        f"communication (ZeRO-{zero_stage}, accum {accum}): {traffic.bytes_per_step / 1e9:.2f} GB "
        f"sent per rank per step, {traffic.comm_s:.2f} s at {gbps:g} GB/s (PCIe through host "
        f"memory, no peer-to-peer) beside {traffic.compute_s:.2f} s of compute at "
        f"{ASSUMED_MFU:.0%} of the GPU's peak: {traffic.exposed_s:.2f} s not hidden by the "
        f"backward ({traffic.share:.0%} of the step)"
    )


def accumulation_that_hides(
    params: int,
    world: int,
    zero_stage: int,
    micro_flops: float,
    peak_flops: float,
    share: float = 0.1,
    gbps: float = PCIE_GBPS,
    most: int = 64,
) -> int | None:
    """The smallest accumulation at which, at this micro batch (`micro_flops`: one micro-step
    on one rank), the step waits on the link for at most `share` of its time; None when none
    up to `most` does (ZeRO-2 and ZeRO-3 pay again in every micro-step)."""
    for accum in range(1, most + 1):
        traffic = step_traffic(
            params, world, zero_stage, accum, micro_flops * accum, peak_flops, gbps
        )
        if traffic.share <= share:
            return accum
    return None


def _gpu_name(source: str) -> str | None:
    """The GPU a request's memory came from ("visible GPU NAME", "profile: NAME with ..."), if
    it names one."""
    if source.startswith("visible GPU "):
        return source[len("visible GPU ") :]
    if source.startswith("profile: "):
        return source[len("profile: ") :].split(" with ")[0]
    return None


def note(req: Any) -> str | None:
    """The plan's line on communication for a request (dsflow.plan.request.Request) on several
    GPUs: what its layout sends, against its compute on the GPU it names (an RTX 4090's
    datasheet peak where it names none: the classic setup's card). None on one rank or CPU."""
    from dsflow.model import flops, presets

    if req.device != "cuda" or req.world <= 1:
        return None
    trained = req.lora_adapter or presets.param_counts(req.config, req.mtp_depth)["total"]
    tokens = req.micro_batch * req.grad_accum * req.seq_len
    step_flops = flops.flops_per_token(req.config, req.seq_len, mtp_depth=req.mtp_depth) * tokens
    name = _gpu_name(req.gpu_mem_source) or "RTX 4090"
    peak = flops.peak_flops(name, req.precision) or flops.peak_flops("RTX 4090", req.precision)
    traffic = step_traffic(trained, req.world, req.zero_stage, req.grad_accum, step_flops, peak)
    # The card is named once, in the plan's GPU line; an unnamed one is taken as an RTX 4090.
    whose = "the GPU's" if _gpu_name(req.gpu_mem_source) else "an RTX 4090's"
    return describe(traffic, req.zero_stage, req.grad_accum) + (
        f" (peak: {whose} {peak / 1e12:g} TFLOP/s in {req.precision})"
    )
