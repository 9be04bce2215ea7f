"""The largest micro batch that fits, at the same global batch.

A step of micro batch m and accumulation a runs a forwards and backwards of m sequences each.
Fewer, larger micro-steps do the same work with less host work per token (launches, DeepSpeed's
per-parameter ZeRO-2 hooks run once per micro-step) and fuller GPUs: on one H100 the `medium`
MoE ran 3.4x the tokens/s at micro 16 x 1 as at 4 x 4 (docs/performance.md). The planner
proposes the largest micro batch that divides the sequences a rank takes per step and still
fits, with the accumulation that keeps the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsflow.plan import memory, request


def largest_micro(
    config: Any, setup: Any, fits: Any, most: int | None = None
) -> tuple[int, int, dict] | None:
    """(micro batch, accumulation, its estimate) for the largest micro batch above
    `setup.micro_batch` that divides the rank's sequences per step (micro x accum) and for
    which `fits(estimate)` holds; None when no larger one fits. `setup` is the layout as
    planned (a memory.Setup with `grad_accum`)."""
    per_rank = setup.micro_batch * setup.grad_accum
    best = None
    for micro in range(setup.micro_batch + 1, min(per_rank, most or per_rank) + 1):
        if per_rank % micro:
            continue
        trial = dataclasses.replace(setup, micro_batch=micro, grad_accum=per_rank // micro)
        trial = request.rebucketed(trial)
        est = memory.estimate(config, trial)
        if fits(est):
            best = (micro, per_rank // micro, est)
    return best


def note(config: Any, setup: Any, fits: Any) -> str | None:
    """One line for the plan's notes when a larger micro batch fits, else None."""
    found = largest_micro(config, setup, fits)
    if found is None:
        return None
    micro, accum, est = found
    return (
        f"train.micro_batch: {micro} with train.grad_accum: {accum} keeps the global batch "
        f"({setup.micro_batch} x {setup.grad_accum} now) and fits "
        f"({est['gpu']['total'] / 1e9:.1f} GB per GPU): fewer, larger micro-steps are faster "
        "where the step waits on the host (docs/performance.md)"
    )
