"""The planner's on-paper communication estimate (dsflow.plan.comm): what each ZeRO stage
sends per rank per step, and how much of it a step's backward hides."""

from __future__ import annotations

import pytest

from dsflow.plan import comm

P = 1_000_000_000  # parameters: 2 GB of 16-bit gradients or weights
GB = 1e9


@pytest.mark.parametrize(
    "stage,accum,sent",
    [
        (0, 4, 2 * 2 / 3 * 2 * GB),  # one all-reduce a step
        (1, 4, 2 * 2 / 3 * 2 * GB),  # reduce-scatter + all-gather at the boundary
        (2, 4, 5 * 2 / 3 * 2 * GB),  # a reduce-scatter every micro-step + the all-gather
        (3, 4, 12 * 2 / 3 * 2 * GB),  # two gathers and a reduce-scatter every micro-step
    ],
)
def test_each_zero_stage_sends_what_deepspeed_moves(stage, accum, sent):
    assert comm.bytes_per_step(P, 3, stage, accum) == pytest.approx(sent)
    assert comm.bytes_per_step(P, 1, stage, accum) == 0  # one rank sends nothing


def test_the_backward_hides_what_it_can_and_the_rest_shows():
    """3 ranks at 12 GB/s: one ring collective of 2 GB x 2/3 takes 0.111 s. A step of 1 s of
    compute at accum 1 has 0.667 s of backward: ZeRO-0's all-reduce (0.222 s) hides whole,
    ZeRO-1's all-gather after the step (0.111 s) shows; at accum 8 each micro-step's backward
    is 0.083 s, so ZeRO-2's per-micro-step reduce-scatter shows 0.028 s eight times."""
    peak = 1e15
    flops = peak * comm.ASSUMED_MFU  # one second of compute
    ring = 2 / 3 * 2 * GB / (12 * GB)
    zero0 = comm.step_traffic(P, 3, 0, 1, flops, peak)
    assert zero0.compute_s == pytest.approx(1.0) and zero0.exposed_s == 0
    assert comm.step_traffic(P, 3, 1, 1, flops, peak).exposed_s == pytest.approx(ring)
    zero2 = comm.step_traffic(P, 3, 2, 8, flops, peak)
    assert zero2.exposed_s == pytest.approx(8 * (ring - 2 / 3 / 8) + ring)
    assert 0 < zero2.share < 1
    assert "ZeRO-2, accum 8" in comm.describe(zero2, 2, 8)


def test_accumulation_hides_zero1_but_not_a_zero2_whose_micro_steps_are_too_short():
    """ZeRO-1 pays once a step, so enough micro-steps hide it; ZeRO-2 pays in every one: when
    a micro-step's backward is shorter than its reduce-scatter, no accumulation helps."""
    peak = 1e15
    micro = 0.05 * peak * comm.ASSUMED_MFU  # 50 ms of compute per micro-step
    assert comm.accumulation_that_hides(P, 3, 1, micro, peak) is not None
    assert comm.accumulation_that_hides(P, 3, 2, micro, peak) is None
    assert comm.accumulation_that_hides(P, 1, 2, micro, peak) == 1  # one rank: nothing to hide
