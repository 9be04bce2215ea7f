"""Language-model losses shared by training, validation and evaluation.

Windows from `ShardReader` hold seq_len + 1 tokens: inputs are the first seq_len, targets the
last seq_len. The loss is computed here, not by HF's `labels=` path, so every caller (trainer,
val, evaluate, the exported-model check) measures exactly the same thing.

Training goes through `TrainingLM`, whose forward is the loss, optionally fused with the lm_head
(`linear_cross_entropy`): the [tokens x vocab] logits are then never held in full.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

IGNORE = -100  # a target that counts neither in the loss nor in its mean (F.cross_entropy's)


def to_batch(windows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.ascontiguousarray(windows)).to(device=device, dtype=torch.long)
    return t[:, :-1], t[:, 1:]


def token_nll(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood in nats, [batch, seq], fp32."""
    return logits_nll(model(input_ids=inputs, use_cache=False).logits, targets)


def logits_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return nll.view_as(targets)


def mean_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_nll(model, inputs, targets).mean()


class _LinearCrossEntropy(torch.autograd.Function):
    """mean(cross_entropy(hidden @ weight.T, targets)) chunk by chunk; the gradients are
    computed in the forward pass, one chunk of logits at a time (the approach of Liger
    Kernel's fused linear cross-entropy), so no logits are kept for the backward pass and none
    are recomputed. Matmuls run in the inputs' dtype, the softmax in fp32, like `token_nll`.

    `scale`: the loss scale the backward will bring (fp16's dynamic loss scaling). The logits'
    gradients are formed already multiplied by it, as the plain path's are, so in fp16 the
    small ones stay above the underflow they would meet at scale 1; the backward divides it
    out again in fp32 (an exact 1 when grad_output is the scale).

    `count`: how many targets count (0: all). The others are IGNORE (a multi-token prediction
    depth's tail): no loss, no gradient, and the mean is over the `count` that count, as
    F.cross_entropy's. A number the caller knows, so that no device value is read back."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, scale, count, compiled):
        rows = hidden.shape[0]
        n = count or rows  # the mean's denominator
        # A frozen lm_head (LoRA) gets no gradient: neither its GEMM nor its fp32 buffer.
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 for bf16 inputs
        total = torch.zeros((), dtype=acc, device=hidden.device)
        vocab = weight.shape[0]
        # cuBLAS's Hopper GEMMs want rows aligned to 16 bytes: with a vocabulary that is no
        # multiple of 8 (a small tokenizer's) the logits' three GEMMs take an older, slower
        # kernel. Zero rows pad the weight; the softmax leaves their logits out.
        padded = F.pad(weight, (0, 0, 0, -vocab % 8)) if vocab % 8 else weight
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(padded, dtype=acc) if needs_weight else None
        factor = torch.full((), scale / n, dtype=acc, device=hidden.device)
        for start in range(0, rows, chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            # An IGNORE target's row: its loss, its hidden state's gradient and its part of
            # the weight's are zeroed through H-wide rows, not the V-wide logits.
            kept = (t != IGNORE)[:, None].to(hidden.dtype) if count else None
            t = t.clamp(min=0) if count else t
            if not (needs_hidden or needs_weight):
                nll = _nll((h @ padded.t())[:, :vocab].to(acc), t)
                total += (nll if kept is None else nll * kept[:, 0]).sum()
                continue
            nll, grad = _softmax_grad(h, padded, t, factor, vocab, compiled)
            total += (nll if kept is None else nll * kept[:, 0]).sum()
            if needs_hidden:
                rows_grad = grad @ padded
                grad_hidden[start : start + chunk] = rows_grad if kept is None else rows_grad * kept
            if needs_weight:
                grad_weight += (grad.t() @ (h if kept is None else h * kept)).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight[:vocab]
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype, ctx.scale = weight.dtype, scale
        return total / n

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        # In fp32, then cast: grad_output may be a loss scale beyond the 16-bit range.
        factor = grad_output.to(torch.promote_types(grad_output.dtype, torch.float32)) / ctx.scale
        if grad_hidden is not None:
            acc = torch.promote_types(grad_hidden.dtype, torch.float32)
            grad_hidden = (grad_hidden.to(acc) * factor.to(acc)).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * factor.to(grad_weight.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's NLL of its target, from fp32 (or fp64) logits."""
    lse = torch.logsumexp(logits, dim=-1)
    return lse - logits.gather(1, targets[:, None]).squeeze(1)


def _softmax_grad_eager(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, factor: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's NLL, d(sum of NLL)/d logits x `factor` in `h`'s dtype) for one chunk: its
    logits `h @ weight.T`, softmax - one_hot(target) computed in `factor`'s dtype. Columns from
    `vocab` on are padding: no probability, no gradient. In place on one widened copy of the
    logits (the 16-bit product is freed once cast), so eagerly a chunk holds one fp32 and one
    16-bit copy at most, as the plan counts (dsflow.plan.memory._fused_head)."""
    wide = (h @ weight.t()).to(factor.dtype)
    if vocab < wide.shape[1]:
        wide[:, vocab:] = float("-inf")
    lse = torch.logsumexp(wide, dim=-1, keepdim=True)
    nll = (lse - wide.gather(1, targets[:, None])).squeeze(1)
    grad = wide.sub_(lse).exp_()
    grad[torch.arange(len(targets), device=targets.device), targets] -= 1.0
    return nll, grad.mul_(factor).to(h.dtype)


_compiled_softmax_grad = None


def _softmax_grad(h, weight, targets, factor, vocab, compiled):
    """_softmax_grad_eager; `compiled` (train.perf.compile) and on CUDA compiled into a
    reduction and one pass over the logits instead of the eager path's six (the upcast,
    logsumexp, subtraction, exp, scale and downcast each read the chunk's V-wide logits). The
    scale is a tensor: a new loss scale is no new graph."""
    global _compiled_softmax_grad
    if not (compiled and h.is_cuda):
        return _softmax_grad_eager(h, weight, targets, factor, vocab)
    if _compiled_softmax_grad is None:
        _compiled_softmax_grad = torch.compile(_softmax_grad_eager, dynamic=False)
    return _compiled_softmax_grad(h, weight, targets, factor, vocab)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    scale: float = 1.0,
    count: int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Mean token NLL of `hidden @ weight.T` ([N, H] x [V, H]) against `targets` ([N]), equal
    to `F.cross_entropy(logits.float(), targets)` without materialising all N x V logits.
    `scale`: the loss scale its backward will get (fp16), formed into the gradients early.
    `count` > 0: only that many targets count, the others are IGNORE. `compiled`: the softmax
    gradient compiled on CUDA (train.perf.compile)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if not torch.is_grad_enabled():
        # The Function sees its inputs' requires_grad, not the grad mode: under no_grad it
        # would still form every gradient.
        hidden, weight = hidden.detach(), weight.detach()
    args = (float(scale), int(count), bool(compiled))
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, *args)


def _not_packed(position_ids):
    return None


@contextlib.contextmanager
def unpacked_windows():
    """HF builds the causal mask by first asking whether the batch packs several sequences per
    row (position ids that restart), and answers with a host read of a device tensor: one
    host sync per forward, after which the GPU idles until the host has launched enough of
    the forward's kernels again. dsflow's windows are never packed (HF makes the position ids,
    0..seq-1 in every row, for which the check answers None): answer None without looking."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # another transformers: leave it as it is
        yield
        return
    masking_utils.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def mtp_weight_at(setting: float | dict, step: int, steps: int) -> float:
    """train.mtp.weight at optimizer step `step` (from 1) of `steps`: a number, or DeepSeek-V3's
    two phases ``{first, then, switch_fraction}``: `first` through step switch_fraction x
    steps, `then` after it."""
    if isinstance(setting, dict):
        late = step > setting["switch_fraction"] * steps
        return float(setting["then"] if late else setting["first"])
    return float(setting)


class TrainingLM(torch.nn.Module):
    """What DeepSpeed trains: forward(inputs, targets) -> mean token NLL.

    It holds the HF model's own submodules under the HF names (`model`, `lm_head`), so its
    parameters, state_dict and checkpoints are the HF model's; `.hf` is the HF model itself
    (for validation, generation and `save_pretrained`). `ce_chunk` > 0 fuses the lm_head with
    the cross-entropy (`linear_cross_entropy`); 0 computes full logits, as `mean_loss` does.
    `compiled` (train.perf.compile): the fused loss's softmax gradient compiled on CUDA too.
    `loss_scale`, where set (fp16), returns the loss scale of the coming backward: the fused
    loss forms its gradients at that scale.

    With multi-token prediction (`hf.mtp`, :mod:`dsflow.model.mtp`, held here as `mtp`) the
    loss is main + mtp_weight / D * sum_k L_k, each L_k through the same head as the main
    loss; `last_losses` then holds the step's [main, L_1, ..., L_D], detached, for the logs.
    `mtp_weight` is train.mtp.weight: a number or its two phases over `steps` optimizer steps
    (`step_begins` picks the step's).

    `hf_loss`: the loss is the HF model's output, its forward given the targets as
    `shift_labels`, as HF's Trainer gets it; for Liger Kernel (train.perf.liger), whose fused
    lm_head + cross-entropy replaces that forward (stock HF's computes no loss from
    `shift_labels` alone).
    """

    def __init__(
        self,
        hf,
        ce_chunk: int = 0,
        mtp_weight: float | dict = 0.3,
        steps: int = 1,
        hf_loss: bool = False,
        compiled: bool = False,
    ):
        super().__init__()
        self.model = hf.model
        self.lm_head = hf.lm_head
        self.mtp = getattr(hf, "mtp", None)
        self._mtp_weight_at = functools.partial(mtp_weight_at, mtp_weight, steps=steps)
        self.mtp_weight = self._mtp_weight_at(1)
        self.last_losses: torch.Tensor | None = None
        self.ce_chunk = int(ce_chunk)
        self.hf_loss = hf_loss
        self.compiled = compiled
        self.loss_scale: Callable[[], float] | None = None
        object.__setattr__(self, "hf", hf)  # not a submodule: no second name for each weight

    def step_begins(self, step: int) -> None:
        """Optimizer step `step` (from 1) begins: its train.mtp.weight."""
        self.mtp_weight = self._mtp_weight_at(step)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, **kwargs):
        """The mean token NLL with `targets`; without, the HF model's output (validation goes
        through here too, so DeepSpeed's ZeRO-3 hooks on this module gather the weights)."""
        if targets is None:
            return self.hf(input_ids=input_ids, **kwargs)
        inputs = input_ids
        if self.hf_loss:
            # HF's losses view the labels flat: the windows' targets are a strided slice.
            labels = targets.contiguous()
            with unpacked_windows():
                return self.hf(input_ids=inputs, shift_labels=labels, use_cache=False).loss
        if not self.ce_chunk and self.mtp is None:
            with unpacked_windows():
                return mean_loss(self.hf, inputs, targets)
        # The MTP depths take the inputs' embeddings shifted: looked up once, for all.
        embeds = self.model.embed_tokens(inputs) if self.mtp is not None else None
        with unpacked_windows():
            hidden = self.model(
                input_ids=None if embeds is not None else inputs,
                inputs_embeds=embeds,
                use_cache=False,
            ).last_hidden_state
        head = self._head_loss()
        main = head(hidden.flatten(0, 1), targets.flatten())
        if self.mtp is None:
            return main
        extra = self.mtp.losses(self.hf, inputs, targets, hidden, head, embeds, ignore=IGNORE)
        self.last_losses = torch.stack([main.detach(), *(x.detach() for x in extra)])
        return main + (self.mtp_weight / len(extra)) * torch.stack(extra).sum()

    def _head_loss(self) -> Callable[..., torch.Tensor]:
        """Mean NLL of hidden [N, H] against targets [N] through the lm_head: fused
        (`ce_chunk` > 0) or from full logits (as `mean_loss` computes them). A third argument,
        `count`, says how many targets count where the others are IGNORE."""
        weight = self.lm_head.weight
        if not self.ce_chunk:
            return lambda h, t, count=0: F.cross_entropy(
                self.lm_head(h).float(), t, ignore_index=IGNORE
            )
        scale = self.loss_scale() if self.loss_scale is not None else 1.0
        chunk, compiled = self.ce_chunk, self.compiled
        return lambda h, t, count=0: linear_cross_entropy(
            h, weight, t, chunk, scale, count, compiled
        )


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
