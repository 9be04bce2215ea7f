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
    compute at accum 1 has 0.667 s of backward. ZeRO-0's all-reduce (0.222 s) follows the
    backward: all of it shows. ZeRO-1's reduce-scatter goes out in buckets beside the backward:
    only the last bucket (a tenth of the gradients: 0.011 s) shows, then the all-gather after
    the step (0.111 s). At accum 8 each micro-step's backward is 0.083 s, shorter than the
    reduce-scatter: ZeRO-2 shows the link's backlog, 0.111 - 0.083 x 0.9 s, eight times."""
    peak = 1e15
    flops = peak * comm.ASSUMED_MFU  # one second of compute
    ring = 2 / 3 * 2 * GB / (12 * GB)
    tenth = P // 10
    zero0 = comm.step_traffic(P, 3, 0, 1, flops, peak, bucket=tenth)
    assert zero0.compute_s == pytest.approx(1.0) and zero0.exposed_s == pytest.approx(2 * ring)
    zero1 = comm.step_traffic(P, 3, 1, 1, flops, peak, bucket=tenth)
    assert zero1.exposed_s == pytest.approx(ring / 10 + ring)
    zero2 = comm.step_traffic(P, 3, 2, 8, flops, peak, bucket=tenth)
    assert zero2.exposed_s == pytest.approx(8 * (ring - 2 / 3 / 8 * 0.9) + ring)
    assert 0 < zero2.share < 1
    assert "ZeRO-2, accum 8" in comm.describe(zero2, 2, 8)
    # One bucket for all gradients: nothing is sent before the backward ends.
    whole = comm.step_traffic(P, 3, 1, 1, flops, peak, bucket=2 * P)
    assert whole.exposed_s == pytest.approx(2 * ring)


def test_auto_buckets_take_a_fiftieth_of_a_micro_step_on_the_link():
    """A reduce bucket's transfer (2 bytes an element, 2/3 of it sent by each of 3 ranks, 12
    GB/s) takes 2% of a micro-step's compute, in millions of elements, from 40M up to the 200M
    a rank that reduces nothing keeps (auto never holds more bucket memory than that)."""
    assert comm.reduce_bucket(3, 1.0) == 180_000_000  # 20 ms at 12 GB/s: 240 MB / (4/3)
    assert comm.reduce_bucket(3, 0.1) == comm.BUCKET_FLOOR  # 18M: too small a message
    assert comm.reduce_bucket(3, 10.0) == comm.BUCKET_CEILING
    assert comm.reduce_bucket(2, 0.5) == 120_000_000  # 2 ranks send half the buffer each
    assert comm.reduce_bucket(1, 1.0) == comm.ONE_RANK_BUCKET
    # fp32 runs reduce fp32 gradients: half the elements in the same time.
    assert comm.reduce_bucket(3, 1.0, element_bytes=4) == 90_000_000
    assert comm.bytes_per_step(P, 3, 1, 4, element_bytes=4) == pytest.approx(2 * 2 / 3 * 4 * GB)
    seconds = comm.TAIL_SHARE * 1.0
    bucket = comm.reduce_bucket(3, 1.0)
    assert 2 / 3 * 2 * bucket / (comm.PCIE_GBPS * 1e9) == pytest.approx(seconds)


def test_accumulation_hides_zero1_but_not_a_zero2_whose_micro_steps_are_too_short():
    """ZeRO-1 pays once a step, so enough micro-steps hide it; ZeRO-2 pays in every one: when
    a micro-step's backward is shorter than its reduce-scatter, no accumulation helps."""
    peak = 1e15
    micro = 0.05 * peak * comm.ASSUMED_MFU  # 50 ms of compute per micro-step
    assert comm.accumulation_that_hides(P, 3, 1, micro, peak) is not None
    assert comm.accumulation_that_hides(P, 3, 2, micro, peak) is None
    assert comm.accumulation_that_hides(P, 1, 2, micro, peak) == 1  # one rank: nothing to hide
