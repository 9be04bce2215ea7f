"""Language-model losses shared by training, validation and evaluation.

Windows from `ShardReader` hold seq_len + 1 tokens: inputs are the first seq_len, targets the
last seq_len. The loss is computed here, not by HF's `labels=` path, so every caller (trainer,
val, evaluate, the exported-model check) measures exactly the same thing.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def to_batch(windows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.ascontiguousarray(windows)).to(device=device, dtype=torch.long)
    return t[:, :-1], t[:, 1:]


def token_nll(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood in nats, [batch, seq], fp32."""
    logits = model(input_ids=inputs, use_cache=False).logits
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return nll.view_as(targets)


def mean_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_nll(model, inputs, targets).mean()


@torch.no_grad()
def evaluate_loss(
    model,
    reader,
    *,
    micro: int,
    device,
    rank: int = 0,
    world: int = 1,
    max_windows: int | None = None,
    lockstep: bool = False,
) -> tuple[float, int]:
    """Summed NLL and token count over the reader's first `max_windows` windows, this rank's
    share (round-robin); callers all-reduce the pair across ranks.

    `lockstep`: every rank runs the same number of forwards (what ZeRO-3 needs: each forward
    gathers parameters from all ranks); a rank whose share is shorter runs forwards on a
    padding batch whose loss is not counted."""
    was_training = model.training
    model.eval()
    total, count, forwards = 0.0, 0, 0
    batch: list[np.ndarray] = []
    windows = reader.sequential(rank, world, max_windows)
    for window in windows:
        batch.append(window)
        if len(batch) == micro:
            total, count = _accumulate(model, batch, device, total, count)
            forwards += 1
            batch = []
    if batch:
        total, count = _accumulate(model, batch, device, total, count)
        forwards += 1
    if lockstep:
        n = reader.num_windows if max_windows is None else min(max_windows, reader.num_windows)
        most = math.ceil(math.ceil(n / world) / micro)  # rank 0's share is the largest
        pad = [reader.tokens(0, reader.seq_len + 1)]
        for _ in range(most - forwards):
            _accumulate(model, pad, device, 0.0, 0)
    model.train(was_training)
    return total, count


def _accumulate(model, batch, device, total, count):
    inputs, targets = to_batch(np.stack(batch), device)
    nll = token_nll(model, inputs, targets)
    return total + float(nll.double().sum()), count + nll.numel()
