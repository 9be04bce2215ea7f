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
its link's one-way bandwidth. DeepSpeed's ZeRO-1/2 overlap a reduction with the backward that
produces it (`overlap_comm`), bucket by bucket (`reduce_bucket_size`): at most the backward's
two thirds of a micro-step's compute hide it, and the last bucket, filled when the backward
ends, is sent after it. ZeRO-0's all-reduce follows the backward (DeepSpeed's engine does not
overlap it); the all-gather of the updated weights follows the optimizer step, with nothing to
hide behind.
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
# The gradient reduce buckets `train.zero.reduce_bucket_size: auto` chooses (16-bit elements):
# the last bucket of a backward is reduced after it, so its transfer is exposed every time;
# it may take TAIL_SHARE of a micro-step's compute. Never below BUCKET_FLOOR (40M elements, as
# Megatron-LM's default: smaller messages lose bandwidth, more so through host memory) nor
# above ONE_RANK_BUCKET, the fixed size a rank that reduces nothing keeps: ZeRO-2 holds two
# buckets per GPU, so a large model's long micro-steps must not buy a short tail with gigabytes.
TAIL_SHARE = 0.02
BUCKET_FLOOR = 40_000_000
ONE_RANK_BUCKET = 200_000_000
BUCKET_CEILING = ONE_RANK_BUCKET


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


def _ring_bytes(params: int, world: int, element_bytes: int) -> float:
    """Bytes each rank sends in one ring collective over `params` elements."""
    return 0.0 if world <= 1 else (world - 1) / world * element_bytes * params


def bytes_per_step(
    params: int, world: int, zero_stage: int, accum: int, element_bytes: int = 2
) -> float:
    """Bytes each rank sends in one step (module docstring; `element_bytes` 4 for fp32 runs,
    whose gradients DeepSpeed reduces in fp32)."""
    ring = _ring_bytes(params, world, element_bytes)
    if zero_stage in (0, 1):
        return 2 * ring
    if zero_stage == 2:
        return (accum + 1) * ring
    return 3 * accum * ring


def reduce_bucket(
    world: int, micro_compute_s: float, gbps: float = PCIE_GBPS, element_bytes: int = 2
) -> int:
    """The reduce bucket (elements) whose transfer takes TAIL_SHARE of a micro-step's compute
    (`micro_compute_s`) over the link, within BUCKET_FLOOR..BUCKET_CEILING, in millions."""
    if world <= 1:
        return ONE_RANK_BUCKET
    seconds = TAIL_SHARE * micro_compute_s
    elements = seconds * gbps * 1e9 / _ring_bytes(1, world, element_bytes)
    return int(min(max(round(elements / 1e6) * 1_000_000, BUCKET_FLOOR), BUCKET_CEILING))


def _overlapped(ring: float, backward: float, bucket_share: float) -> float:
    """What a reduction of `ring` seconds, sent in buckets of `bucket_share` of the gradients
    as the backward (`backward` seconds) fills them, leaves after the backward: the last
    bucket's transfer at least, the link's backlog where it is slower than the backward."""
    return max(ring - backward * (1 - bucket_share), ring * bucket_share)


def step_traffic(
    params: int,
    world: int,
    zero_stage: int,
    accum: int,
    step_flops: float,
    peak_flops: float,
    gbps: float = PCIE_GBPS,
    mfu: float = ASSUMED_MFU,
    bucket: int = ONE_RANK_BUCKET,
    element_bytes: int = 2,
) -> Traffic:
    """A step's communication against its compute on one rank: `step_flops` are one rank's
    FLOPs in a step (all micro-steps), `peak_flops` its GPU's datasheet peak, `bucket` the
    reduce bucket in elements (train.zero.reduce_bucket_size)."""
    sent = bytes_per_step(params, world, zero_stage, accum, element_bytes)
    ring = _ring_bytes(params, world, element_bytes) / (gbps * 1e9)  # one collective, seconds
    compute = step_flops / (peak_flops * mfu)
    micro = compute / accum
    backward = BACKWARD_SHARE * micro
    share = min(1.0, bucket / params) if params else 1.0
    if zero_stage == 0:  # DeepSpeed's engine all-reduces after the last backward, not beside it
        exposed = 2 * ring
    elif zero_stage == 1:  # the reduce-scatter there too; the all-gather after the step
        exposed = _overlapped(ring, backward, share) + ring
    elif zero_stage == 2:  # a reduce-scatter beside every backward; the all-gather after
        exposed = accum * _overlapped(ring, backward, share) + ring
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
    bucket: int = ONE_RANK_BUCKET,
    element_bytes: int = 2,
) -> int | None:
    """The smallest accumulation at which, at this micro batch (`micro_flops`: one micro-step
    on one rank), the step waits on the link for at most `share` of its time; None when none
    up to `most` does (ZeRO-2 and ZeRO-3 pay again in every micro-step)."""
    for accum in range(1, most + 1):
        traffic = step_traffic(
            params,
            world,
            zero_stage,
            accum,
            micro_flops * accum,
            peak_flops,
            gbps,
            bucket=bucket,
            element_bytes=element_bytes,
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


def _on_paper(req: Any) -> tuple[int, float, float, str]:
    """(parameters whose gradients move, one rank's FLOPs a step, the GPU's datasheet peak,
    whose peak it is) for a request (dsflow.plan.request.Request): the GPU it names, an RTX
    4090 where it names none (the classic setup's card)."""
    from dsflow.model import flops, presets

    trained = req.lora_adapter or presets.param_counts(req.config, req.mtp_depth)["total"]
    tokens = req.micro_batch * req.grad_accum * req.seq_len
    step_flops = flops.flops_per_token(req.config, req.seq_len, mtp_depth=req.mtp_depth) * tokens
    name = _gpu_name(req.gpu_mem_source)
    peak = flops.peak_flops(name or "RTX 4090", req.precision) or flops.peak_flops(
        "RTX 4090", req.precision
    )
    return trained, step_flops, peak, "the GPU's" if name else "an RTX 4090's"


def _element_bytes(req: Any) -> int:
    """Bytes of a reduced gradient element: DeepSpeed reduces fp32 runs' gradients in fp32."""
    return 4 if req.precision == "fp32" else 2


def bucket_for(req: Any) -> int:
    """The reduce bucket (elements) `train.zero.reduce_bucket_size: auto` takes for a request:
    :func:`reduce_bucket` at its micro-step's compute; ONE_RANK_BUCKET on one rank or CPU."""
    if req.device != "cuda" or req.world <= 1:
        return ONE_RANK_BUCKET
    _, step_flops, peak, _ = _on_paper(req)
    micro_s = step_flops / req.grad_accum / (peak * ASSUMED_MFU)
    return reduce_bucket(req.world, micro_s, element_bytes=_element_bytes(req))


def note(req: Any) -> str | None:
    """The plan's line on communication for a request on several GPUs: what its layout sends,
    against its compute, with its reduce buckets (ZeRO-1/2: DeepSpeed's ZeRO-0 all-reduce
    takes its own). None on one rank or CPU."""
    if req.device != "cuda" or req.world <= 1:
        return None
    trained, step_flops, peak, whose = _on_paper(req)
    bucket, eb = req.bucket_sizes[0], _element_bytes(req)
    z, accum = req.zero_stage, req.grad_accum
    traffic = step_traffic(
        trained, req.world, z, accum, step_flops, peak, bucket=bucket, element_bytes=eb
    )
    hides = accumulation_that_hides(
        trained, req.world, z, step_flops / accum, peak, bucket=bucket, element_bytes=eb
    )
    buckets = f"; reduce buckets of {bucket / 1e6:g}M elements" if z in (1, 2) else ""
    # The card is named once, in the plan's GPU line; an unnamed one is taken as an RTX 4090.
    peak_line = f" (peak: {whose} {peak / 1e12:g} TFLOP/s in {req.precision}{buckets}); "
    return describe(traffic, z, accum) + peak_line + _what_hides(hides, z)


def _what_hides(accum: int | None, zero_stage: int) -> str:
    """The note's last clause: the accumulation that keeps the link under 10% of the step."""
    if accum:
        return f"at this micro batch, accumulation {accum} keeps the link under 10% of the step"
    why = f"ZeRO-{zero_stage} sends in every micro-step: " if zero_stage >= 2 else ""
    return (
        "no accumulation keeps the link under 10% of the step at this micro batch "
        f"({why}a larger micro batch does)"
    )
