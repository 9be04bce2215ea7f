"""A training step's numbers, read back from the device without making the host wait for it.

`float(t)` or `.tolist()` of a CUDA tensor waits until the device has run everything queued
before it. At the end of a step that empties the device's queue: the GPU then idles while the
host logs, and while it launches the next forward's first kernels (on one H200, MoE: 6 ms of
bookkeeping and 5 ms of forward ramp in a 110 ms step, docs/performance.md). A `Readback`
copies the values it is given into pinned host memory behind the step's work and records an
event; `values()` waits for that event only. Read one step later (train.perf.async_metrics),
that event has long passed, and the device has the next step's work queued meanwhile.

On CPU everything is already done when it is queued: the values are copied at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class Readback:
    """`values` maps names to tensors (any shape, any device, read as float64; 0-dim ones come
    back as floats, others as CPU tensors) or host values (returned as they are)."""

    def __init__(self, values: dict[str, Any], device: torch.device, timed: bool = False):
        self._host = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        self._layout = [(k, tuple(v.shape)) for k, v in tensors.items()]
        self.event = None
        self._buffer = None
        cuda = device.type == "cuda"
        if tensors:
            flat = torch.cat(
                [
                    v.detach().reshape(-1).to(device=device, dtype=torch.float64)
                    for v in tensors.values()
                ]
            )
            if cuda:
                self._buffer = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
                self._buffer.copy_(flat, non_blocking=True)
            else:
                self._buffer = flat.cpu()
        if cuda:
            self.event = torch.cuda.Event(enable_timing=timed)
            self.event.record()

    def values(self) -> dict[str, Any]:
        if self.event is not None:
            self.event.synchronize()
        out = dict(self._host)
        offset = 0
        for name, shape in self._layout:
            n = math.prod(shape)
            chunk = self._buffer[offset : offset + n]
            offset += n
            out[name] = float(chunk[0]) if shape == () else chunk.view(shape).clone()
        return out


class EventClock:
    """Step times from CUDA events, for steps whose end the host does not wait for: a step runs
    from the previous step's end event to its own (so the device's idle time between them
    counts, as with a host clock after a sync); the first step, and the first after `aside()`
    (validation, checkpoints: reported on their own), from an event recorded as it begins."""

    def __init__(self):
        self._last: torch.cuda.Event | None = None
        self._begin: torch.cuda.Event | None = None

    def step_begins(self) -> None:
        if self._last is None:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()

    def step_done(self, end: torch.cuda.Event) -> tuple:
        """The step's (begin, end) events: `seconds()` of them once `end` has passed."""
        begin = self._last if self._last is not None else self._begin
        self._last = end
        return (begin, end)

    def aside(self) -> None:
        """Call after work that is not a step (it then starts the next step's timing anew)."""
        self._last = None

    @staticmethod
    def seconds(span: tuple) -> float:
        begin, end = span
        return begin.elapsed_time(end) / 1e3
